"""Rollouts recorded by an external inference engine (vLLM, SGLang): their routes as our
replay tensor, and an offline rollout file the trainer can train on (`rl.offline_rollouts`).

Letters: Bf responses in a file, B in a batch, P prompt slots (task.max_prompt_len), C
completion slots (sampling.max_new_tokens), S = P + C, L layers, K top-k, E experts; P_b /
C_b response b's prompt / completion length; Te the longest P_b + C_b − 1 in a batch.

vLLM (`enable_return_routed_experts`, `CompletionOutput.routed_experts`) and SGLang
(`return_routed_experts`, `meta_info["routed_experts"]`) return per request the experts of
each token the engine *processed* (the prompt, then every sampled token but the last):
[P_b + C_b − 1, L, K], int16 in vLLM. `engine_routes_to_replay` maps a right-padded batch
[B, Te, L, K] to the slots of `rollout.Rollout` (prompt left-padded to P):

    routes_mu_BxSxLxK[b, P − P_b + i]   = routed[b, i]          i < P_b      (prompt)
    routes_mu_BxSxLxK[b, P + j]         = routed[b, P_b + j]    j < C_b − 1  (completion)
    -1 elsewhere: left padding, the last sampled token (never processed), padding after

Offline rollout file (`.npz`, no pickles; ragged fields concatenated over responses in
order, with per-response lengths):

    prompt_ids      int   [Σ P_b]              prompt token ids
    prompt_lens     int   [Bf]
    completion_ids  int   [Σ C_b]              sampled tokens, EOS included if emitted
    completion_lens int   [Bf]
    logp_mu         float [Σ C_b]              the sampler's log-prob of each sampled token
    routes          int   [Σ (P_b + C_b − 1), L, K]   optional (needed for R3)
    route_weights   float [Σ (P_b + C_b − 1), L, K]   optional (needed for weight replay)
    rewards         float [Bf]                  or `answers` (str [Bf]: scored by the task)
    group_size      int   []                   responses g·G … g·G + G − 1 share a prompt

`OfflineRollouts.load` (the archive, each field's dtype and rank) and `check_values` (the
values) check everything when the trainer opens the file, before any training, each error
naming the file, field and, for a bad value, the record (response index). A non-.npz file
(an .npy array, empty, truncated) or a pickled object array is refused, never unpickled.
Global step s trains on responses [s·B, (s + 1)·B), B = rl.prompts_per_step · G; the
sampler's temperature must be `sampling.temperature` (the trainer scores π_old at it).
"""
from __future__ import annotations

import dataclasses
import zipfile
import zlib

import numpy as np

from stablerl_jax.runs import storage
from stablerl_jax.sampling.rollout import Rollout


def _check_routes(routed, field: str, num_layers: int, top_k: int):
    if routed.ndim != 4 or routed.shape[2:] != (num_layers, top_k):
        raise ValueError(f"{field}: shape {routed.shape} must be [responses, tokens, "
                         f"num_layers={num_layers}, top_k={top_k}]; check that the engine "
                         "served this model (all its layers are MoE layers)")
    if not np.issubdtype(routed.dtype, np.integer):
        raise ValueError(f"{field}: dtype {routed.dtype} must be integer expert ids")


def engine_routes_to_replay(routed_BxTexLxK, prompt_lens_B, completion_lens_B, *,
                            max_prompt_len: int, max_new_tokens: int, num_layers: int,
                            top_k: int, num_experts: int, weights_BxTexLxK=None):
    """An engine's right-padded routes [B, Te, L, K] as `routes_mu_BxSxLxK` (int32, -1 where
    nothing was processed) and, given its combine weights alike, `route_weights_mu_BxSxLxK`
    (float32, 0 there); ValueError naming the field if not this model's recording of them."""
    routed = np.asarray(routed_BxTexLxK)
    p_b = np.asarray(prompt_lens_B, np.int64)
    c_b = np.asarray(completion_lens_B, np.int64)
    _check_routes(routed, "routed_experts", num_layers, top_k)
    b = routed.shape[0]
    if p_b.shape != (b,) or c_b.shape != (b,):
        raise ValueError(f"prompt_lens / completion_lens: shapes {p_b.shape} / {c_b.shape} "
                         f"must be [B]=[{b}], one length per row of routed_experts")
    if b and (p_b.min() < 1 or p_b.max() > max_prompt_len):
        raise ValueError(f"prompt_lens: must be in [1, max_prompt_len={max_prompt_len}], got "
                         f"{p_b.min()}..{p_b.max()}; raise task.max_prompt_len")
    if b and (c_b.min() < 1 or c_b.max() > max_new_tokens):
        raise ValueError(f"completion_lens: must be in [1, max_new_tokens={max_new_tokens}],"
                         f" got {c_b.min()}..{c_b.max()}; raise sampling.max_new_tokens")
    processed_B = p_b + c_b - 1
    if b and processed_B.max() > routed.shape[1]:
        r = int(np.argmax(processed_B - routed.shape[1]))
        raise ValueError(f"routed_experts: row {r} needs {processed_B[r]} recorded tokens "
                         f"(prompt {p_b[r]} + completion {c_b[r]} − 1: every token but the "
                         f"last sampled one) but the array holds {routed.shape[1]}")
    if weights_BxTexLxK is not None:
        weights = np.asarray(weights_BxTexLxK)
        if weights.shape != routed.shape or not np.issubdtype(weights.dtype, np.floating):
            raise ValueError(f"route_weights: shape {weights.shape} dtype {weights.dtype} "
                             f"must be float with routed_experts' shape {routed.shape}")
    s = max_prompt_len + max_new_tokens
    routes_BxSxLxK = np.full((b, s, num_layers, top_k), -1, np.int32)
    weights_BxSxLxK = np.zeros((b, s, num_layers, top_k), np.float32)
    for r in range(b):
        valid = routed[r, :processed_B[r]]
        if valid.size and (valid.min() < 0 or valid.max() >= num_experts):
            raise ValueError(f"routed_experts: row {r} holds expert ids outside [0, "
                             f"num_experts={num_experts}): min {valid.min()} max "
                             f"{valid.max()}")
        srt = np.sort(valid, axis=-1)
        if (srt[..., 1:] == srt[..., :-1]).any():
            raise ValueError(f"routed_experts: row {r} repeats an expert within a token's "
                             "top-k; a recording holds K distinct experts")
        slots = np.concatenate([np.arange(max_prompt_len - p_b[r], max_prompt_len),
                                max_prompt_len + np.arange(c_b[r] - 1)])
        routes_BxSxLxK[r, slots] = valid
        if weights_BxTexLxK is not None:
            weights_BxSxLxK[r, slots] = weights[r, :processed_B[r]]
    return routes_BxSxLxK, (weights_BxSxLxK if weights_BxTexLxK is not None else None)


_REQUIRED = ("prompt_ids", "prompt_lens", "completion_ids", "completion_lens", "logp_mu",
             "group_size")
# {field: (numpy dtype kinds it may have, what they hold, rank)}. Answers as bytes would
# read as "b'5'", which no response matches; integers read as their decimal strings.
_INT, _FLOAT = ("iu", "integers"), ("f", "floats")
_FIELDS = {"prompt_ids": (*_INT, 1), "prompt_lens": (*_INT, 1), "completion_ids": (*_INT, 1),
           "completion_lens": (*_INT, 1), "logp_mu": (*_FLOAT, 1), "rewards": (*_FLOAT, 1),
           "answers": ("Uiu", "str or integers", 1), "routes": (*_INT, 3),
           "route_weights": (*_FLOAT, 3), "group_size": (*_INT, 0)}
_REWRITE = "write the file with stablerl_jax.interop.rollouts.write_rollouts"
# What reading a damaged archive raises: a non-archive or pickled content (ValueError),
# an empty or cut file (EOFError, BadZipFile), a corrupt or unknown compression.
_DAMAGED = (ValueError, EOFError, zipfile.BadZipFile, zlib.error, NotImplementedError)
# A drawn token's log-probability is above this: a token of probability e^−10⁴ is never
# drawn, so a value below it is not a recorded log μ (it would pin the IS weight at its
# cap and the k1 monitor at −10²⁹ without a word).
LOGP_FLOOR = -1e4


def write_rollouts(path: str, responses: list[dict], group_size: int) -> None:
    """Write an offline rollout file from per-response dicts: prompt_ids, completion_ids,
    logp_mu, and optionally routes ([P_b + C_b − 1, L, K]), route_weights, reward or answer."""
    cat = lambda key, dt: np.concatenate([np.asarray(r[key], dt) for r in responses])
    out = {"prompt_ids": cat("prompt_ids", np.int32),
           "prompt_lens": np.array([len(r["prompt_ids"]) for r in responses], np.int32),
           "completion_ids": cat("completion_ids", np.int32),
           "completion_lens": np.array([len(r["completion_ids"]) for r in responses],
                                       np.int32),
           "logp_mu": cat("logp_mu", np.float32),
           "group_size": np.array(group_size, np.int32)}
    for key, dt in (("routes", np.int32), ("route_weights", np.float32)):
        if all(key in r for r in responses):
            out[key] = cat(key, dt)
    if all("reward" in r for r in responses):
        out["rewards"] = np.array([r["reward"] for r in responses], np.float32)
    elif all("answer" in r for r in responses):
        out["answers"] = np.array([str(r["answer"]) for r in responses])
    with storage.open_file(path, "wb") as f:  # a local file or a gs:// object
        np.savez(f, **out)


def _offsets(lens: np.ndarray) -> np.ndarray:
    return np.concatenate([[0], np.cumsum(lens, dtype=np.int64)])


def _refuse(path: str, field: str, bad, what: str, lens=None):
    """Raise naming the first bad record of mask `bad`; `lens` maps token entries to records."""
    pos = int(np.argmax(bad))
    rec = pos if lens is None else int(np.searchsorted(_offsets(lens), pos, side="right") - 1)
    raise ValueError(f"{path}: record {rec} (response index), field {field!r}: {what} "
                     f"({int(np.sum(bad))} bad entries in the file); fix or drop those "
                     "records")


def _why(e: Exception, pickled: str) -> str:
    # numpy's own words for content it would unpickle suggest loading it unsafely; ours
    # say what the content is.
    return pickled if "pickle" in str(e) else f"{type(e).__name__}: {e}"


def _read_npz(path: str) -> dict:
    """{field: array} of an .npz (local or gs://), pickles refused; else ValueError naming it."""
    try:
        f = storage.open_file(path, "rb")
    except FileNotFoundError:
        raise FileNotFoundError(f"{path}: no such file; rl.offline_rollouts must name an "
                                ".npz rollout file") from None
    with f:
        try:
            loaded = np.load(f, allow_pickle=False)
        except (*_DAMAGED, MemoryError) as e:
            why = _why(e, "neither .npz nor .npy data, and never unpickled")
            raise ValueError(f"{path}: not a readable .npz archive ({why}); "
                             "rl.offline_rollouts must name a complete .npz file of named "
                             f"arrays: {_REWRITE}") from None
        return _read_fields(path, loaded)


def _read_fields(path: str, loaded) -> dict:
    if not isinstance(loaded, np.lib.npyio.NpzFile):
        raise ValueError(f"{path}: a single .npy array {loaded.shape}, not an .npz archive "
                         f"of named fields; {_REWRITE}")
    arrays = {}
    with loaded:
        for k in loaded.files:
            _check_header(path, loaded.zip, k)
            try:
                arrays[k] = loaded[k]
            except (*_DAMAGED, MemoryError) as e:
                why = _why(e, "an object array: pickled Python objects, never unpickled")
                raise ValueError(f"{path}: field {k!r} cannot be read ({why}); store it as "
                                 f"a plain numeric or str array: {_REWRITE}") from None
    return arrays


def _check_header(path: str, archive: zipfile.ZipFile, field: str) -> None:
    """Refuse a member whose .npy header claims more bytes than it holds (a header of 2^40
    entries would be allocated before the read fails)."""
    member = field + ".npy"
    if member not in archive.namelist():
        return  # numpy reads it (or refuses it) by its own rules
    have = archive.getinfo(member).file_size
    try:
        with archive.open(member) as f:
            version = np.lib.format.read_magic(f)
            read = (np.lib.format.read_array_header_1_0 if version == (1, 0)
                    else np.lib.format.read_array_header_2_0)
            shape, _, dtype = read(f)
            have -= f.tell()
    except _DAMAGED:
        return  # a damaged member: numpy's read says so
    if dtype.hasobject:
        return  # pickled: refused when read
    need = int(np.prod(shape, dtype=object)) * dtype.itemsize
    if need > have:
        raise ValueError(f"{path}: field {field!r}: its header says {shape} of {dtype} "
                         f"({need:,} bytes), but the archive holds {have:,} bytes of it; "
                         f"the file is damaged or not an array of that size: {_REWRITE}")


def _check_kinds(path: str, arrays: dict) -> None:
    """Refuse a field of the wrong dtype or rank (before any length or value is read)."""
    for field, (kinds, what, ndim) in _FIELDS.items():
        x = arrays.get(field)
        if x is None:
            continue
        if x.dtype.kind not in kinds:
            raise ValueError(f"{path}: field {field!r} has dtype {x.dtype}; it must hold "
                             f"{what}; {_REWRITE}")
        if ndim == 0 and x.size != 1:
            raise ValueError(f"{path}: field {field!r} has shape {x.shape}; it must be one "
                             f"integer (the responses per prompt); {_REWRITE}(..., "
                             "group_size=G)")
        if ndim and x.ndim != ndim:
            raise ValueError(f"{path}: field {field!r} has shape {x.shape}; it must have "
                             f"{ndim} dimension(s) (module docstring); {_REWRITE}")


@dataclasses.dataclass(frozen=True)
class OfflineRollouts:
    """The arrays of an offline rollout file (module docstring), validated on load."""

    arrays: dict
    path: str

    @classmethod
    def load(cls, path: str) -> "OfflineRollouts":
        """The file's arrays, fields, dtypes, ranks and lengths checked (module docstring)."""
        arrays = _read_npz(path)
        missing = [k for k in _REQUIRED if k not in arrays]
        if missing:
            raise ValueError(f"{path}: missing field(s) {missing}; see "
                             "stablerl_jax/interop/rollouts.py for the format")
        if "rewards" not in arrays and "answers" not in arrays:
            raise ValueError(f"{path}: needs 'rewards' [Bf] or 'answers' [Bf]; give "
                             "write_rollouts a 'reward' or an 'answer' in each response")
        _check_kinds(path, arrays)
        out = cls(arrays, path)
        out._check_lengths()
        return out

    @property
    def num_responses(self) -> int:
        return int(self.arrays["prompt_lens"].shape[0])

    @property
    def group_size(self) -> int:
        return int(self.arrays["group_size"].reshape(-1)[0])

    def _check_lengths(self) -> None:
        a, r = self.arrays, self.num_responses
        p, c = a["prompt_lens"], a["completion_lens"]
        for field, lo in (("prompt_lens", 1), ("completion_lens", 0)):
            if (bad := a[field] < lo).any():  # before the totals, which they make wrong
                _refuse(self.path, field, bad, f"{a[field][np.argmax(bad)]} is below {lo}")
        want = {"prompt_ids": (int(p.sum()),), "completion_lens": (r,),
                "completion_ids": (int(c.sum()),), "logp_mu": (int(c.sum()),)}
        want.update({k: (r,) for k in ("rewards", "answers") if k in a})
        want.update({k: (int((p + c - 1).sum()),) for k in ("routes", "route_weights")
                     if k in a})
        for k, shp in want.items():
            if a[k].shape[:1] != shp:
                raise ValueError(f"{self.path}: {k} has {a[k].shape[:1]} entries, the "
                                 f"lengths say {shp}; rewrite the file with write_rollouts")
        if self.group_size < 1:
            raise ValueError(f"{self.path}: field 'group_size' is {self.group_size}; it must "
                             f"be >= 1 (the responses per prompt); {_REWRITE}(..., "
                             "group_size=G)")
        if r % self.group_size:
            raise ValueError(f"{self.path}: {r} responses are not whole groups of "
                             f"group_size={self.group_size}")

    def check(self, *, group_size: int, responses_per_step: int, steps: int,
              num_layers: int, top_k: int, need_routes: bool, need_weights: bool) -> None:
        """Refuse a file that cannot feed `steps` global steps of this config."""
        a = self.arrays
        if self.group_size != group_size:
            raise ValueError(f"rl.group_size={group_size} must equal the file's group_size="
                             f"{self.group_size} ({self.path})")
        have = self.num_responses // responses_per_step
        if have < steps:
            raise ValueError(f"rl.steps={steps}: {self.path} holds {self.num_responses} "
                             f"responses = {have} global steps of {responses_per_step}; "
                             f"lower rl.steps to {have} or record more rollouts")
        for key, need, why in (("routes", need_routes, "rl.replay=r3 or rl.attribution"),
                               ("route_weights", need_weights, "rl.replay_weights")):
            if need and key not in a:
                raise ValueError(f"{why} reads the sampler's {key}, which {self.path} "
                                 "does not hold; record them or change the setting")
            if key in a and a[key].shape[1:] != (num_layers, top_k):
                raise ValueError(f"{self.path}: {key} is [tokens, {a[key].shape[1:]}], the "
                                 f"model needs [tokens, num_layers={num_layers}, "
                                 f"top_k={top_k}]")

    def check_values(self, *, vocab_size: int, num_experts: int, max_prompt_len: int,
                     max_new_tokens: int) -> None:
        """Refuse a value this model cannot train on, naming the first bad record (response
        index) and field, on open, not at the step reading it (after a checkpoint) or never
        (an update skipped as non-finite): token ids in [0, vocab_size); lengths in [1,
        max_prompt_len] and [0, max_new_tokens] (≥ 1 with routes: the engine processed ≥ 1
        token); logp_mu finite, in [LOGP_FLOOR, 0]; rewards and route_weights finite;
        routes in [0, num_experts), K distinct per token and layer."""
        a, p = self.arrays, self.path
        lens = {"prompt_lens": None, "completion_lens": None, "rewards": None,
                "prompt_ids": a["prompt_lens"], "completion_ids": a["completion_lens"],
                "logp_mu": a["completion_lens"],
                "routes": a["prompt_lens"] + a["completion_lens"] - 1,
                "route_weights": a["prompt_lens"] + a["completion_lens"] - 1}

        def refuse(field, bad, what):
            _refuse(p, field, bad, what, lens.get(field))

        _check_kinds(p, a)
        c_min = 1 if "routes" in a else 0
        for field, lo, hi, where in (
                ("prompt_lens", 1, max_prompt_len, "task.max_prompt_len"),
                ("completion_lens", c_min, max_new_tokens, "sampling.max_new_tokens")):
            bad = (a[field] < lo) | (a[field] > hi)
            if bad.any():
                refuse(field, bad, f"{a[field][np.argmax(bad)]} is not in [{lo}, {hi}] "
                       f"({where}={hi})")
        for field in ("prompt_ids", "completion_ids"):
            bad = (a[field] < 0) | (a[field] >= vocab_size)
            if bad.any():
                refuse(field, bad, f"token id {a[field][np.argmax(bad)]} is outside "
                       f"[0, model.vocab_size={vocab_size})")
        logp = a["logp_mu"]
        if (bad := ~np.isfinite(logp)).any() or (bad := logp > 0).any():
            refuse("logp_mu", bad, f"{logp[np.argmax(bad)]} is not a log-probability "
                   "(finite and <= 0)")
        if (bad := logp < LOGP_FLOOR).any():
            refuse("logp_mu", bad, f"{logp[np.argmax(bad)]:.4g} is below {LOGP_FLOOR:g}, the "
                   "floor of a drawn token's log-probability (LOGP_FLOOR): not a recorded "
                   "log μ")
        if "rewards" in a and (bad := ~np.isfinite(a["rewards"])).any():
            refuse("rewards", bad, f"{a['rewards'][np.argmax(bad)]} is not finite")
        if "routes" in a:
            r = a["routes"]
            if (bad := ((r < 0) | (r >= num_experts)).any(axis=(1, 2))).any():
                refuse("routes", bad, f"an expert id outside [0, model.num_experts="
                       f"{num_experts})")
            srt = np.sort(r, axis=-1)
            if (bad := (srt[..., 1:] == srt[..., :-1]).any(axis=(1, 2))).any():
                refuse("routes", bad, "an expert repeated within a token's top-k")
        if "route_weights" in a and (bad := ~np.isfinite(a["route_weights"]).all(
                axis=(1, 2))).any():
            refuse("route_weights", bad, "a weight that is not finite")

    def batch(self, rows, *, max_prompt_len: int, max_new_tokens: int, pad_id: int,
              num_layers: int, top_k: int, num_experts: int):
        """(Rollout, rewards [B] or None, answers or None) of responses `rows`."""
        a = self.arrays
        rows = np.asarray(rows)
        p_b, c_b = a["prompt_lens"][rows], a["completion_lens"][rows]
        if p_b.max() > max_prompt_len or c_b.max() > max_new_tokens:
            raise ValueError(f"{self.path}: prompts up to {p_b.max()} / completions up to "
                             f"{c_b.max()} tokens exceed task.max_prompt_len={max_prompt_len}"
                             f" / sampling.max_new_tokens={max_new_tokens}; raise them")
        po, co = _offsets(a["prompt_lens"]), _offsets(a["completion_lens"])
        ro = _offsets(a["prompt_lens"] + a["completion_lens"] - 1)
        b, P, s = len(rows), max_prompt_len, max_prompt_len + max_new_tokens
        tokens = np.full((b, s), pad_id, np.int32)
        prompt_mask = np.zeros((b, s), bool)
        completion_mask = np.zeros((b, s), bool)
        logp = np.zeros((b, s), np.float32)
        m = int((p_b + c_b - 1).max())
        routed = np.zeros((b, m, num_layers, top_k), np.int32)
        weights = np.zeros((b, m, num_layers, top_k), np.float32)
        for i, r in enumerate(rows):
            tokens[i, P - p_b[i]:P] = a["prompt_ids"][po[r]:po[r + 1]]
            tokens[i, P:P + c_b[i]] = a["completion_ids"][co[r]:co[r + 1]]
            prompt_mask[i, P - p_b[i]:P] = True
            completion_mask[i, P:P + c_b[i]] = True
            logp[i, P:P + c_b[i]] = a["logp_mu"][co[r]:co[r + 1]]
            if "routes" in a:
                routed[i, :ro[r + 1] - ro[r]] = a["routes"][ro[r]:ro[r + 1]]
            if "route_weights" in a:
                weights[i, :ro[r + 1] - ro[r]] = a["route_weights"][ro[r]:ro[r + 1]]
        if "routes" in a:
            routes, w = engine_routes_to_replay(
                routed, p_b, c_b, max_prompt_len=P, max_new_tokens=max_new_tokens,
                num_layers=num_layers, top_k=top_k, num_experts=num_experts,
                weights_BxTexLxK=weights if "route_weights" in a else None)
        else:
            routes, w = np.full((b, s, num_layers, top_k), -1, np.int32), None
        rollout = Rollout(tokens, prompt_mask, completion_mask, c_b.astype(np.int32), logp,
                          routes, w)
        rewards = a["rewards"][rows].astype(np.float32) if "rewards" in a else None
        answers = [str(x) for x in a["answers"][rows]] if "answers" in a else None
        return rollout, rewards, answers
