"""`ExperimentConfig` (every section of one run, validated together) and the
command-line overrides: `apply_overrides`, `flat_dict`, `changed_fields`."""
from __future__ import annotations

import dataclasses
import typing

from stablerl_jax.config.checks import ConfigError, check, is_int, Section
from stablerl_jax.config.combinations import check_bitwise, check_sizes
from stablerl_jax.config.model import ModelConfig, SamplingConfig
from stablerl_jax.config.task import TaskConfig
from stablerl_jax.config.training import LossConfig, RLConfig, SFTConfig


@dataclasses.dataclass(frozen=True)
class ExperimentConfig(Section):
    """One run: every section, plus the name and the device mesh.

    mesh: (data, fsdp, expert), the whole mesh over every device of every slice.
    mesh_dcn: slices each axis spans (data-center network, sharding.make_mesh): each factor
      divides its mesh axis, a slice holds a mesh / mesh_dcn block, the product is the slice
      count (checked against the devices when the mesh is built). (1, 1, 1): one slice."""

    name: str = "run"
    model: ModelConfig = ModelConfig()
    task: TaskConfig = TaskConfig()
    sampling: SamplingConfig = SamplingConfig()
    loss: LossConfig = LossConfig()
    rl: RLConfig = RLConfig()
    sft: SFTConfig = SFTConfig()
    mesh: tuple = (1, 1, 1)
    mesh_dcn: tuple = (1, 1, 1)

    def __post_init__(self):
        # Cross-section rules, grouped by what they protect. None rewrites a section.
        self._check_lengths_and_mesh()   # every sequence fits; the mesh is well formed
        self._check_batch_splits()       # every batch divides over the mesh
        self._check_router()             # a frozen router has no losses of its own
        self._check_sampler_slots()      # the sampler's slots hold whole steps or groups
        self._check_packing()            # packed rows hold whole sequences, and no more
        self._check_probes()             # dynamic sampling's rounds, the attribution probe
        self._check_sampler_q()          # loss.center / rl.drift_monitor's q
        check_bitwise(self)              # zero mismatch: what could make the engines part
        check_sizes(self)                # size-like ints bounded by what a run can use

    def _dp(self) -> int:
        """Devices every batch is split over (sharding.RULES["batch"]: every mesh axis)."""
        return self.mesh[0] * self.mesh[1] * self.mesh[2]

    def _check_lengths_and_mesh(self):
        rl = self.rl
        need = self.task.max_prompt_len + self.sampling.max_new_tokens
        check(need <= self.model.max_seq_len, "model.max_seq_len",
              f"must be >= task.max_prompt_len + sampling.max_new_tokens = {need}, "
              f"got {self.model.max_seq_len}")
        check(isinstance(self.mesh, tuple) and len(self.mesh) == 3
              and all(is_int(m) and m > 0 for m in self.mesh), "mesh",
              f"must be three positive ints (data, fsdp, expert), got {self.mesh!r}")
        check(isinstance(self.mesh_dcn, tuple) and len(self.mesh_dcn) == 3
              and all(is_int(m) and m > 0 for m in self.mesh_dcn), "mesh_dcn",
              f"must be three positive ints (slices spanned by data, fsdp, expert), got "
              f"{self.mesh_dcn!r}")
        check(all(m % d == 0 for m, d in zip(self.mesh, self.mesh_dcn)), "mesh_dcn",
              f"{self.mesh_dcn} must divide mesh={self.mesh} axis by axis (a slice holds "
              f"mesh / mesh_dcn); change mesh_dcn or the mesh, e.g. mesh_dcn=N,1,1 with "
              f"the data axis a multiple of N (data parallel across N slices)")
        check(rl.overlong_buffer <= self.sampling.max_new_tokens, "rl.overlong_buffer",
              f"must be <= sampling.max_new_tokens = {self.sampling.max_new_tokens} (the "
              f"penalty ramps over the last overlong_buffer tokens), got {rl.overlong_buffer}")

    def _check_batch_splits(self):
        rl = self.rl
        dp = self._dp()
        minibatch = rl.prompts_per_step * rl.group_size // rl.num_minibatches
        # The eval batch is padded to the mesh and sampler multiple (rl/loop.py).
        for what, rows in [("the RL micro-batch (rl.prompts_per_step*rl.group_size/"
                            "rl.num_minibatches/rl.microbatches)", minibatch // rl.microbatches),
                           ("the SFT micro-batch (sft.batch_size/sft.microbatches)",
                            self.sft.batch_size // self.sft.microbatches)]:
            check(rows % dp == 0, "mesh",
                  f"data*fsdp*expert = {dp} must divide {what} = {rows}; change the mesh or "
                  "the batch")
        check(not self.model.expert_parallel or self.model.num_experts % self.mesh[2] == 0,
              "model.expert_parallel", f"needs the mesh's expert axis ({self.mesh[2]}) to "
              f"divide num_experts={self.model.num_experts}; change the mesh or set it false")
        # The serving layout splits the experts over every device (sharding.SERVE_RULES).
        sampler_ep = (self.model.expert_parallel
                      and (self.sampling.dispatch or self.model.dispatch) == "grouped")
        check(self.sampling.layout != "serve" or not sampler_ep
              or self.model.num_experts % dp == 0, "sampling.layout",
              f"'serve' puts num_experts={self.model.num_experts} on data*fsdp*expert = "
              f"{dp} devices, which must divide it; use layout 'train' or another mesh")

    def _check_router(self):
        rl = self.rl
        router_losses = [f"model.{f}={getattr(self.model, f)}" for f in (
            "router_z_loss_weight", "router_aux_loss_weight") if getattr(self.model, f)]
        check(not rl.freeze_router or not router_losses, "rl.freeze_router",
              f"a frozen router cannot follow its own losses ({', '.join(router_losses)}); "
              "set them to 0 or rl.freeze_router=false")

    def _check_sampler_slots(self):
        rl, dp = self.rl, self._dp()
        rows = self.sampling.max_batch
        if rows:
            check(rows % dp == 0, "sampling.max_batch",
                  f"must be a multiple of data*fsdp*expert = {dp}, got {rows}")
            n = rl.prompts_per_step * rl.group_size
            # Partial rollouts may keep more slots than a step's responses in flight.
            check(rl.max_staleness or n % rows == 0, "sampling.max_batch",
                  f"must divide rl.prompts_per_step*rl.group_size = {n}, got {rows} (only "
                  "partial rollouts, rl.max_staleness >= 1, may have more slots)")
        if rl.max_staleness:
            slots = self.sampling.max_batch or rl.prompts_per_step * rl.group_size
            check(slots % rl.group_size == 0, "sampling.max_batch",
                  f"partial rollouts (rl.max_staleness >= 1) keep whole groups in flight: "
                  f"the sampler's slots ({slots}) must be a multiple of rl.group_size = "
                  f"{rl.group_size}")

    def _check_packing(self):
        rl, dp = self.rl, self._dp()
        if rl.pack_tokens:
            longest = self.task.max_prompt_len + self.sampling.max_new_tokens
            check(rl.pack_tokens >= longest, "rl.pack_tokens",
                  f"must hold the longest possible sequence, task.max_prompt_len + "
                  f"sampling.max_new_tokens = {longest} (sequences are packed whole, never "
                  f"cut); raise it to >= {longest}, got {rl.pack_tokens}")
            check(rl.pack_rows % dp == 0, "rl.pack_rows",
                  f"must be a multiple of data*fsdp*expert = {dp} (each batch shard packs "
                  f"its own rows), got {rl.pack_rows}")
            # Bounded by what a step's batch can fill: a packed row holds sequences of one
            # batch shard (at most B/dp of them, each at most `longest`), and a micro-batch
            # never needs more tokens than the padded batch has slots.
            b = rl.prompts_per_step * rl.group_size
            fill = b // dp * longest
            check(rl.pack_tokens <= fill, "rl.pack_tokens",
                  f"{rl.pack_tokens:,} tokens is more than a packed row can ever fill: one "
                  f"batch shard's {b // dp} sequences of at most {longest} tokens = {fill:,}; "
                  f"set it between {longest} and {fill}")
            rows = max(rl.pack_rows, dp)
            check(rows * rl.pack_tokens <= b * longest, "rl.pack_rows",
                  f"{rows:,} packed rows of rl.pack_tokens={rl.pack_tokens:,} is "
                  f"{rows * rl.pack_tokens:,} tokens a forward, more than the step's whole "
                  f"padded batch ({b} rows × {longest} = {b * longest:,}); set rl.pack_rows <= "
                  f"{max(dp, b * longest // rl.pack_tokens // dp * dp)} (0: one per batch "
                  "shard)")

    def _check_probes(self):
        rl, dp = self.rl, self._dp()
        if rl.dynamic_sampling and self.task.kind == "arithmetic":
            # The synthetic train split's size is known here (a file's, once read:
            # rl/preflight.check_sampling_rounds); more rounds would draw prompts again.
            most = max(1, self.task.num_train // rl.prompts_per_step)
            check(rl.max_sampling_rounds <= most, "rl.max_sampling_rounds",
                  f"{rl.max_sampling_rounds} rounds of rl.prompts_per_step="
                  f"{rl.prompts_per_step} prompts is more than the train split's "
                  f"task.num_train={self.task.num_train} problems (a step would draw prompts "
                  f"again); set rl.max_sampling_rounds={most} or fewer")
        if rl.attribution and rl.attribution_every:
            check(rl.attribution_rows % dp == 0, "rl.attribution_rows",
                  f"must be a multiple of data*fsdp*expert = {dp} (the probe's rows are a "
                  f"sharded batch), or 0, got {rl.attribution_rows}")
            probed = rl.attribution_rows or -(-8 // dp) * dp
            check(probed <= rl.prompts_per_step * rl.group_size, "rl.attribution_rows",
                  f"the probe's {probed} rows (one per batch shard at least) exceed the "
                  f"step's {rl.prompts_per_step * rl.group_size} responses; set "
                  "rl.attribution_every=0 or a larger batch")

    def _check_sampler_q(self):
        """loss.center and rl.drift_monitor recompute the sampler's whole-vocabulary q in the
        score step (method/centering.py) from this sampler's full softmax, on padded rows."""
        users = [f for f, on in (("loss.center", self.loss.center != "none"),
                                 ("rl.drift_monitor", self.rl.drift_monitor)) if on]
        if not users:
            return
        field = users[0]
        check(not self.rl.pack_tokens, field, f"needs q at every padded position; set "
              f"rl.pack_tokens=0 (got {self.rl.pack_tokens}) or turn {field} off")
        check(not self.rl.offline_rollouts, field, "recomputes q with this project's "
              "sampler, which did not draw an offline rollout file; set "
              f"rl.offline_rollouts='' or turn {field} off")
        check(self.sampling.top_k == 0 and self.sampling.top_p == 1.0, field,
              f"q is the sampler's full softmax; set sampling.top_k=0 and "
              f"sampling.top_p=1.0 (got {self.sampling.top_k}, {self.sampling.top_p}) or "
              f"turn {field} off")
        check(self.loss.center != "topk" or self.loss.center_k < self.model.vocab_size,
              "loss.center_k", f"must be < model.vocab_size = {self.model.vocab_size} (at "
              f"K = V use loss.center=exact), got {self.loss.center_k}")


def _parse(value: str, current, key: str):
    """`value` (a command-line string) as the type of the field's current value."""
    low = value.strip().lower()
    if isinstance(current, (bool, int, float, tuple)) and not value.isascii():
        # int() and float() read any Unicode digit ('٣', full-width '３'): a typo's
        # lookalike would pass as a number.
        raise ConfigError(f"override {key!r}: {value!r} is not ASCII; write numbers with "
                          "the digits 0-9")
    if isinstance(current, bool):
        if low not in ("true", "false", "1", "0"):
            raise ConfigError(f"override {key!r}: expected true/false, got {value!r}")
        return low in ("true", "1")
    if isinstance(current, tuple):
        parts = value.strip().strip("()").split(",")
        if len(parts) > 1 and not parts[-1].strip():
            parts = parts[:-1]  # a trailing comma, as in Python's (2,)
        if any(not v.strip() for v in parts):
            raise ConfigError(f"override {key!r}: {value!r} has an empty entry; write "
                              "comma-separated ints like 2,2,2")
        try:
            return tuple(int(v) for v in parts)
        except ValueError:
            raise ConfigError(f"override {key!r}: expected comma-separated ints like 2,2,2, "
                              f"got {value!r}") from None
    if current is None:  # an optional string field (LossConfig.aggregation)
        return None if low == "none" else value
    if isinstance(current, float):
        try:
            return float(value)
        except ValueError:
            raise ConfigError(f"override {key!r}: cannot parse {value!r} as a number") \
                from None
    if isinstance(current, int):
        try:
            return int(value)
        except ValueError:
            raise ConfigError(f"override {key!r}: cannot parse {value!r} as an int") from None
    return value


def _field_names(obj) -> list[str]:
    return [f.name for f in dataclasses.fields(obj)]


def apply_overrides(cfg: ExperimentConfig, overrides: typing.Sequence[str]) -> ExperimentConfig:
    """Apply `path=value` overrides (`name=x`, `mesh=2,2,2`, `rl.num_minibatches=4`,
    `rl.optim.learning_rate=3e-4`): each config rebuilt once, validated on its final values."""
    changes: dict = {}  # nested {field: value or {sub-field: ...}}
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep:
            raise ConfigError(f"override {item!r}: expected section.field=value")
        path = key.strip().split(".")
        node, tree = cfg, changes
        for i, name in enumerate(path):
            names = _field_names(node)
            if name not in names:
                where = ".".join(path[:i]) or "the experiment config"
                hint = ("use section.field=value with section in "
                        f"{[n for n in names if dataclasses.is_dataclass(getattr(node, n))]}"
                        if i == 0 else f"{where} has {names}")
                raise ConfigError(f"override {key!r}: unknown field {name!r}; {hint}")
            child = getattr(node, name)
            if i == len(path) - 1:
                if dataclasses.is_dataclass(child):
                    raise ConfigError(f"override {key!r}: {key} is a section; set one of its "
                                      f"fields, e.g. {key}.{_field_names(child)[0]}=...")
                tree[name] = _parse(value, child, key)
            else:
                if not dataclasses.is_dataclass(child):
                    raise ConfigError(f"override {key!r}: {'.'.join(path[:i + 1])} is not a "
                                      "section")
                tree = tree.setdefault(name, {})
                node = child
    # Bitwise numerics compute per token in both engines (model.batch_invariant): an
    # override that asks for them sets it too, unless it sets the model's own value.
    numerics = changes.get("sampling", {}).get("numerics", cfg.sampling.numerics)
    if numerics == "bitwise" and "batch_invariant" not in changes.get("model", {}):
        changes.setdefault("model", {})["batch_invariant"] = True
    return _rebuild(cfg, changes)


def _rebuild(obj, changes: dict):
    """dataclasses.replace with nested changes, innermost first; errors get the section path."""
    kw = {}
    for name, change in changes.items():
        if isinstance(change, dict):
            try:
                kw[name] = _rebuild(getattr(obj, name), change)
            except ConfigError as e:
                raise ConfigError(f"{name}.{e}" if not str(e).startswith(f"{name}.") else
                                  str(e)) from None
        else:
            kw[name] = change
    try:
        return dataclasses.replace(obj, **kw)
    except TypeError as e:  # a value of the wrong type reached a comparison
        raise ConfigError(f"{type(obj).__name__}: {e}") from None


def flat_dict(cfg) -> dict:
    """{"section.field": value}, JSON-ready (tuples as lists): a checkpoint's stored config."""
    out = {}
    for f in dataclasses.fields(cfg):
        v = getattr(cfg, f.name)
        if dataclasses.is_dataclass(v):
            out.update({f"{f.name}.{k}": x for k, x in flat_dict(v).items()})
        else:
            out[f.name] = list(v) if isinstance(v, tuple) else v
    return out


def changed_fields(saved: dict, cfg) -> list[str]:
    """Paths whose value in `cfg` differs from a stored `flat_dict`; a field missing there (newer
    than the run) counts only if `cfg` sets it off its default (the old behaviour)."""
    now, default = flat_dict(cfg), flat_dict(type(cfg)())
    return sorted(k for k in set(saved) | set(now)
                  if saved.get(k, default.get(k)) != now.get(k))
