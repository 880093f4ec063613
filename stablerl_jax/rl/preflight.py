"""Checks before any work: the workdir, the devices and processes a config needs, and whether a
resumed run keeps the config it was trained with."""
from __future__ import annotations

import os

import jax

from stablerl_jax import distributed, presets, sharding
from stablerl_jax.config import ConfigError, changed_fields, flat_dict, parse_eval_sets
from stablerl_jax.rl import history
from stablerl_jax.runs import storage, storage_gcs

# Fields a resumed run may change without asking: how long it runs and how it reports, not
# what it trains. The cold start (sft.*) is checked where it is cached (rl/sft.py).
RUN_CONTROL = ("name", "rl.steps", "rl.eval_every", "rl.eval_k", "rl.eval_problems",
               "rl.eval_sets", "rl.checkpoint_every", "rl.keep_checkpoints",
               "rl.async_checkpoints", "rl.max_consecutive_skips", "rl.log_samples",
               "rl.log_samples_every", "rl.phase_sync")


def add_arguments(ap, where: str) -> None:
    """A command line's `--allow-config-change` (`allowed_changes`) and `--replace-history`
    (`check_history`); `where` names what may hold another run's history."""
    ap.add_argument("--allow-config-change", default="",
                    help="comma-separated section.field names a resumed run may change")
    ap.add_argument("--replace-history", action="store_true",
                    help=f"start over in {where} history (metrics, a summary, an export) "
                         "but no checkpoint that restores, its files moved aside to "
                         "replaced.<n>/; without it that is refused")


def check_workdir(workdir: str) -> None:
    """A clear error, before any work, for a workdir that cannot hold a run. A `gs://` one must
    be a valid URL whose bucket exists (`check_url`); whether this account may write it shows at
    the run lock, the run's first write."""
    check_url(workdir, "workdir")
    remote = storage.is_remote(workdir)
    if storage.isfile(workdir):
        raise ValueError(f"workdir {workdir!r} is a file; pass a directory path")
    if remote:
        return
    parent = workdir if os.path.isdir(workdir) else os.path.dirname(os.path.abspath(workdir))
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not os.access(parent, os.W_OK):
        raise PermissionError(f"workdir {workdir!r}: {parent!r} is not writable; fix its "
                              "permissions or choose another --workdir")


def url_settings(cfg, hf: str = "", export_hf: str = "") -> list[tuple[str, str]]:
    """(setting, value) of every path a run reads or writes besides its workdir: data, tokenizer,
    eval sets, cold-start data, offline rollouts, the --hf checkpoint, the export."""
    sets = [(f"rl.eval_sets ({name})", path)
            for name, path in parse_eval_sets(cfg.rl.eval_sets).items()]
    return [(k, v) for k, v in [("task.jsonl_dir", cfg.task.jsonl_dir),
                                ("task.tokenizer_dir", cfg.task.tokenizer_dir),
                                *sets, ("sft.data", cfg.sft.data),
                                ("rl.offline_rollouts", cfg.rl.offline_rollouts),
                                ("--hf", hf), ("--export-hf", export_hf)] if v]


def check_urls(cfg, hf: str = "", export_hf: str = "") -> None:
    """`check_url` for every path of `url_settings`, before any work."""
    for what, url in url_settings(cfg, hf, export_hf):
        check_url(url, what)


def check_url(url: str, what: str) -> None:
    """A path of setting `what`: local, or a valid gs:// URL (`storage.check_scheme`) whose
    bucket exists, asked within storage_gcs.REACH_BOUND_S (ConnectionError: no answer)."""
    storage.check_scheme(url, what)
    if storage.is_remote(url) and not storage_gcs.bucket_exists(url, what):
        bucket = "/".join(url.split("/")[:3])
        raise ValueError(f"{what} {url!r}: the bucket {bucket} does not exist or this "
                         "account may not see it; create it or fix the name")


def check_history(cfg, workdir: str, replace: bool = False, export_hf: str = "") -> None:
    """Refuse starting over another run's history; `replace` moves it aside (rl/history.py)."""
    history.check(cfg, workdir, replace, export_hf)


def check_run(cfg, workdir: str, devices=None, *, hf: str = "", export_hf: str = "") -> None:
    """An entry point's checks before any work, cold start included: the workdir and every other
    URL (`check_urls`), the mesh against the visible devices, the batches over the processes."""
    check_workdir(workdir)
    check_urls(cfg, hf, export_hf)
    check_processes(cfg)
    # The arithmetic test split holds exactly task.num_test problems (a JSONL split's size
    # is known once it is read: check_eval_problems). Not a config invariant: the steps'
    # program config sets the loop-only rl.eval_problems to its default.
    if cfg.task.kind == "arithmetic" and not cfg.rl.eval_sets:
        if cfg.rl.eval_problems > cfg.task.num_test:
            raise ConfigError(f"rl.eval_problems: must be <= task.num_test={cfg.task.num_test}"
                              f" (the test problems there are), got {cfg.rl.eval_problems}")
    sharding.config_mesh(cfg.mesh, devices, cfg.mesh_dcn)  # raises when it does not fit
    check_kernels(cfg, devices)


def check_kernels(cfg, devices=None) -> None:
    """Every kernel the config names compiles for the platform (the `paper` preset's TPU Pallas
    'megablox' and 'pallas_tpu' not on CPU or GPU); the decode attention only if used."""
    platform = (devices or jax.devices())[0].platform
    for section, field, table in presets.KERNEL_FIELDS:
        name = getattr(getattr(cfg, section), field)
        if field == "decode_attention_impl" and not cfg.model.decode_block:
            continue
        backends = table[name].backends
        if platform not in backends:
            default = getattr(getattr(type(cfg)(), section), field)
            raise ConfigError(f"{section}.{field}={name!r} compiles for "
                              f"{'/'.join(backends)} only, not {platform}: set "
                              f"{section}.{field}={default}, or --layout single-host")


def layout_problem(cfg, devices=None) -> str:
    """Why the layout (mesh, kernels) fails on `devices` (default: the backend's), or ''."""
    try:
        sharding.config_mesh(cfg.mesh, devices, cfg.mesh_dcn)
        check_kernels(cfg, devices)
    except (ConfigError, ValueError) as e:
        return str(e)
    return ""


def choose_layout(name: str, preset: str, overrides, devices=None):
    """(config, line to print or '') of `--preset preset --layout name`: 'auto' keeps the
    preset's layout where it runs on these devices, else lays it out single-host (a multi-process
    pod job keeps its layout); 'preset', 'single-host' as LAYOUTS say; overrides last."""
    devices = list(devices or jax.local_devices())
    host = {"platform": devices[0].platform, "devices": len(devices)}
    if name == "single-host":
        return _single_host(preset, overrides, host), ""
    if name != "auto":
        return presets.preset(preset, overrides, layout=name), ""
    try:
        cfg = presets.preset(preset, overrides)
        why = layout_problem(cfg, devices)
    except ConfigError as e:  # e.g. a batch cut to this host no longer fills the pod mesh
        cfg, why = None, str(e)
    if not why or jax.process_count() > 1:
        if cfg is None:
            raise ConfigError(why)
        return cfg, ""
    single = _single_host(preset, overrides, host)
    host["devices"] = single.mesh[1]
    show = lambda v: ",".join(map(str, v)) if isinstance(v, list) else v
    own, moved = (flat_dict(c) for c in (presets.preset(preset), presets.preset(
        preset, layout="single-host", **host)))
    changed = [f"{k}={show(v)}" for k, v in moved.items() if own[k] != v]
    return single, (f"layout: the {preset} preset's own does not run here "
                    f"({why.split('; ')[0]}); running it single-host on {host['devices']} "
                    f"{host['platform']} device(s): {' '.join(changed)} (--layout preset "
                    "refuses instead)")


def _single_host(preset: str, overrides, host: dict):
    """The preset single-host on the most devices d (a divisor of the host's) it validates on."""
    n = host["devices"]
    for d in [d for d in range(n, 0, -1) if n % d == 0]:
        try:
            return presets.preset(preset, overrides, layout="single-host",
                                  platform=host["platform"], devices=d)
        except ConfigError:
            if d == 1:
                raise


def check_resumed_config(saved: dict | None, cfg, allow, where: str) -> None:
    if saved is None:
        return  # written before configs were stored
    if not isinstance(saved, dict):
        raise ValueError(f"{where}: the stored config is a JSON {type(saved).__name__}, "
                         "not an object: the checkpoint's metadata is damaged; move that "
                         "step directory aside, or use a new workdir")
    changed = [k for k in changed_fields(saved, cfg)
               if k not in RUN_CONTROL and not k.startswith("sft.") and k not in allow]
    if changed:
        now = flat_dict(cfg)
        diffs = "; ".join(f"{k}: {saved.get(k)!r} -> {now.get(k)!r}" for k in changed[:8])
        raise ValueError(
            f"{where}: the run being resumed was trained with another config ({diffs}). "
            f"Resume with the same settings, pass --allow-config-change {','.join(changed)} "
            "to continue with the new ones, or use a new workdir.")


def allowed_changes(arg: str, cfg) -> list[str]:
    """The fields of `--allow-config-change a.b,c.d`; each must be a field of the config."""
    allow = [f for f in arg.split(",") if f]
    known = flat_dict(cfg)
    unknown = [f for f in allow if f not in known]
    if unknown:
        raise ConfigError(
            f"--allow-config-change: unknown field(s) {unknown}; name section.field paths "
            f"of the config, e.g. {', '.join(sorted(known)[:3])}")
    return allow


def check_data(cfg, data) -> None:
    """What the run asks of its data once read: check_eval_problems, check_sampling_rounds."""
    check_eval_problems(cfg, data)
    check_sampling_rounds(cfg, data)


def check_sampling_rounds(cfg, data) -> None:
    """A step's rl.max_sampling_rounds rounds must fit the train split (else prompts repeat)."""
    rl = cfg.rl
    if not rl.dynamic_sampling or rl.offline_rollouts:
        return
    have = len(data.train)
    most = max(1, have // rl.prompts_per_step)
    if rl.max_sampling_rounds > most:
        raise ConfigError(
            f"rl.max_sampling_rounds={rl.max_sampling_rounds}: {rl.max_sampling_rounds} "
            f"rounds of rl.prompts_per_step={rl.prompts_per_step} prompts is more than the "
            f"train split's {have} problems (a step would draw prompts again); set "
            f"rl.max_sampling_rounds={most} or fewer")


def check_eval_problems(cfg, data) -> None:
    """rl.eval_problems caps every eval set (its first n). Without rl.eval_sets the test split
    must hold that many (else the accuracy means something else); named sets are benchmarks of
    their own size (AIME: 30 problems), whole under the cap, counts printed once."""
    sizes = {name: len(records) for name, records in data.evals.items()}
    cap = cfg.rl.eval_problems
    if not cfg.rl.eval_sets:
        have = sizes.get("test", 0)
        if cap > have:
            raise ConfigError(f"rl.eval_problems={cap}: the test split holds {have} "
                              f"problems; set rl.eval_problems={have} or fewer")
        return
    if distributed.is_main():
        print("eval sets: " + ", ".join(f"{name} {min(n, cap)} of {n} problems"
                                        for name, n in sizes.items()))


def check_processes(cfg, export_hf: str = "") -> None:
    """What a multi-process run needs of the batch sizes (distributed.py): every process holds
    whole groups of the RL batch and its block of the eval and SFT batches."""
    if jax.process_count() == 1:
        return
    rl = cfg.rl
    distributed.check_rows(rl.prompts_per_step * rl.group_size, rl.group_size,
                           "rl.prompts_per_step × rl.group_size")
    distributed.check_rows(rl.eval_problems, 1, "rl.eval_problems")
    distributed.check_rows(cfg.sft.batch_size, 1, "sft.batch_size")
    if export_hf:
        raise ValueError("--export-hf writes from one process; export a checkpoint of this "
                         "run from a single process instead")

