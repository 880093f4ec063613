"""Compile an experiment's steps for a TPU pod from this host and say whether they fit.

    python -m experiments.aot_compile --preset paper --topology v5p-256 [key=value ...]
    python -m experiments.aot_compile --preset moe1b --topology v5e-8 --kernels
    python -m experiments.aot_compile --preset paper --topology v5p-128 --num-slices 2 \
        --steps update mesh=2,8,8 mesh_dcn=2,1,1

Needs libtpu: `pip install -e '.[tpu]'` (no TPU is used: the compiler runs here). Lowers
the Engine's own sample, score and update steps (its mesh, shardings and jitted
functions, built on the topology's abstract devices; stablerl_jax/pod/aot.py) and prints,
per step and per chip: argument / output / temp GiB and their total (argument + output +
temp − aliased), the chip's HBM, whether it fits, compile seconds, XLA's FLOP count of
the program (its cost analysis counts a loop body — the layer scan, the micro-batch scan,
the decode loop — once, so it undercounts looped programs), the step's model FLOPs per
chip (stablerl_jax/model/flops.py, every loop iteration counted), the collective
instructions in the optimized HLO (an instruction inside a loop counts once) and the
collective bytes per chip of one call (every loop at its trip count, the sampler's decode
loop at all max_new_tokens steps) inside a slice (ICI) and between slices (DCN;
stablerl_jax/pod/hlo_loops.py); then the roofline time estimates of the compiled steps
(stablerl_jax/pod/roofline.py; with the sample step, the sampler's too). `--num-slices K`
(or a topology written `Kxv5p-128`) compiles for K slices joined by the data-center
network; the config's `mesh_dcn` says which mesh axes span them (e.g. `mesh=2,8,8
mesh_dcn=2,1,1`: data parallel across two slices), and the roofline estimates price
DCN bytes at the chip's DCN bandwidth (roofline.CHIP_SPECS). `--kernels` also compiles
the Pallas kernels for the topology inside shard_map: the fused log-prob (forward and
backward) and the grouped matmul (forward and backward). Exits 1 if any step does not
fit.
`key=value` overrides apply to the preset (e.g. `mesh=1,16,8 model.num_layers=2`).

    python -m experiments.aot_compile --preset paper --topology v5p-256 \
        --lengths lognormal:mean=8192 --lengths lognormal:mean=16384

`--lengths SPEC` (repeatable; `--eval-lengths` for the evaluation's) adds, per
distribution, the score and update at those lengths (padded rows trimmed to the longest,
or with rl.pack_tokens the packed micro-batches in use: schedule_prices.train_shares),
and (when the sample step is compiled too) the sampler's schedules
(stablerl_jax/pod/sampler_schedules.py: static, continuous, partial rollouts with S = 1
and 2) priced per decode step at its largest write slot
(schedule_prices.schedule_rows): sample, score passes, updates, amortized eval and global step
seconds, slot occupancy, the partial rollouts' drops and token ages, and whether a
separate sampler mesh would beat colocating (schedule_prices.placements). Without it the output
is as above.
"""
from __future__ import annotations

import argparse
import os
import sys

import numpy as np

from experiments.cli_errors import one_line_errors
from stablerl_jax import presets
from stablerl_jax.pod import (
    aot,
    roofline,
    sampler_programs,
    sampler_schedules,
    schedule_prices,
)
from stablerl_jax.rl.engine import Engine


def _row(c: aot.Compiled, hbm: float, cfg) -> str:
    fits = "yes" if c.total_gib <= hbm else "**no**"
    coll = c.collectives
    net = roofline.step_network_bytes(cfg, c.step, c.hlo, c.slices)
    return (f"| {c.step} | {c.argument_gib:.2f} | {c.output_gib:.2f} | {c.temp_gib:.2f} | "
            f"{c.total_gib:.2f} | {hbm:.2f} | {fits} | {c.compile_s:.0f} | "
            f"{c.flops / 1e12:.2f} | "
            f"{'-' if c.model_flops != c.model_flops else f'{c.model_flops / 1e12:.1f}'} | "
            f"{coll['all-gather']} | {coll['all-to-all']} | "
            f"{coll['reduce-scatter']} | {coll['all-reduce']} | "
            f"{net['ici'] / 2**20:,.1f} | {net['dcn'] / 2**20:,.2f} |")


def _seconds(x: float) -> str:
    """Seconds to one decimal, or two significant digits below one second (the small
    presets' steps)."""
    return f"{x:.1f}" if x >= 1 else f"{x:.2g}"


HEADER = ("| step | argument GiB | output GiB | temp GiB | total GiB | HBM GiB | fits? | "
          "compile s | XLA TFLOP / chip | model TFLOP / chip | all-gather | all-to-all | "
          "reduce-scatter | all-reduce | ICI MiB / chip | DCN MiB / chip |\n"
          "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")


def _estimates(engine, topo: aot.Topology, compiled: dict, args) -> None:
    """Rows per pass and the roofline time estimates (stablerl_jax/pod/roofline.py); with
    --lengths, the schedules' tables (_length_tables)."""
    cfg, chip = engine.cfg, roofline.chip_of(topo.name)
    rows = sampler_programs.rows_per_pass(cfg)
    kv = sampler_programs.kv_bytes_per_row(cfg) / aot.GIB
    fit = sampler_programs.rows_that_fit(cfg, compiled["sample"].total_gib, topo.hbm_gib,
                                         topo.chips)
    print(f"\nsampler layout {cfg.sampling.layout!r}: {rows} rows per pass "
          f"({rows / topo.chips:g} per chip); KV cache {kv:.3f} GiB per row "
          f"(+{sampler_programs.row_state_bytes(cfg) / aot.GIB:.3f} GiB of row state); "
          f"≈{fit} rows fit per chip in {topo.hbm_gib} GiB", flush=True)
    ests = roofline.estimate(engine, compiled, chip)
    costs, (step, mean, layer, head) = ests.sampler, ests.decode
    print(f"\nCompiler / roofline estimates, not measurements ({topo.name}: "
          f"{chip.source}):\n\n| per iteration | collective MiB / chip | DCN KiB / chip | "
          f"HBM GiB / chip | GFLOP / chip | XLA optimal_seconds (ms) | estimate (ms) |\n"
          f"|---|---|---|---|---|---|---|")
    rows_ = [("the head of a decode step (embedding, logits, sampling)", head),
             ("one layer of a decode step", layer), ("the first decode step", step),
             ("the mean decode step", mean)]
    for what, c in rows_:
        # XLA's TPU cost model may answer a negative time; such a value says nothing.
        opt = (f"{c.optimal_seconds * 1e3:.3f}" if c.optimal_seconds >= 0
               else f"invalid ({c.optimal_seconds:.1f} s)")
        print(f"| {what} | {c.collective_bytes / 2**20:.2f} | {c.dcn_bytes / 2**10:.1f} | "
              f"{c.hbm_bytes / aot.GIB:.3f} | "
              f"{c.flops / 1e9:.1f} | {opt} | {c.seconds(chip) * 1e3:.3f} |", flush=True)
    est, pass_s = ests.steps, ests.pass_seconds
    print("\n| step | estimated s | how |\n|---|---|---|")
    for e in est.values():
        print(f"| {e.step} | {_seconds(e.seconds)} | {e.detail} |", flush=True)
    if {"score", "update"} <= set(est):
        total, parts = roofline.global_step_estimate(cfg, est, pass_s)
        print(f"\nestimated global step of {cfg.name} on {topo.name}: {total:.0f} s ("
              + ", ".join(f"{k} {v:.0f} s" for k, v in parts.items())
              + "); compiler / roofline estimates, not measurements; score and update at "
              "100 % of the FLOP peak, a lower bound", flush=True)
        mfu, source = _mfu(args, topo)
        if mfu:  # the tables below price score and update at this MFU
            est = roofline.at_mfu(est, compiled, chip, mfu)
            total, parts = roofline.global_step_estimate(cfg, est, pass_s)
            print(f"at {mfu:.1%} MFU for score and update ({source}): {total:.0f} s ("
                  + ", ".join(f"{k} {v:.0f} s" for k, v in parts.items()) + "); the "
                  "tables below use this", flush=True)
        for spec in args.lengths:
            _train_table(engine, est, spec, args)
            _length_tables(engine, topo, compiled, costs, est, fit, spec,
                           args.eval_lengths or spec, args)


def _mfu(args, topo: aot.Topology) -> tuple[float, str]:
    """(the achievable MFU of score and update: --mfu, else the chip family's published
    figure, roofline.PUBLISHED_MFU; 0 without either, and where it comes from)."""
    if args.mfu:
        return args.mfu, "--mfu"
    family = topo.name.split("x", 1)[-1].split("-")[0]
    return roofline.PUBLISHED_MFU.get(family, (0.0, ""))


def _train_table(engine, est, spec, args) -> None:
    """The score and update at a length distribution: the compiled step's estimate times
    the share of it a step runs (schedule_prices.train_shares; prompts at
    task.max_prompt_len, an upper bound): padded rows cut to the step's longest, or with
    rl.pack_tokens the packed micro-batches the fullest shard uses (the updates' rows
    balanced over the shards as the loop orders them)."""
    cfg, rl = engine.cfg, engine.cfg.rl
    b, k = rl.prompts_per_step * rl.group_size, args.schedule_steps
    lengths = sampler_schedules.lengths_from_spec(spec, cfg.sampling.max_new_tokens, k * b,
                                         np.random.default_rng(args.seed)).reshape(k, b)
    sh = schedule_prices.train_shares(cfg, lengths, cfg.task.max_prompt_len)
    score, update = est["score"].seconds, est["update"].seconds * rl.num_minibatches
    print(f"\nscore and update at lengths {spec} ({k} steps drawn, prompts of "
          f"{cfg.task.max_prompt_len:,} tokens):\n\n| rows | width or budget | share of the "
          f"compiled step | score s | updates s |\n|---|---|---|---|---|")
    print(f"| padded, trimmed to the longest | {sh.padded_width:,.0f} slots (mean) | "
          f"{sh.padded_share:.2f} | {score * sh.padded_share:.1f} | "
          f"{update * sh.padded_share:.1f} |" if not rl.pack_tokens else
          f"| packed (rl.pack_tokens={rl.pack_tokens:,}, pack_rows={rl.pack_rows or 'D'}) | "
          f"an update runs {sh.update_used:.2f} of {sh.packed_count} micro-batches (mean) | "
          f"score {sh.score_share:.2f}, updates {sh.update_share:.2f} | "
          f"{score * sh.score_share:.1f} | {update * sh.update_share:.1f} |", flush=True)


def _length_tables(engine, topo, compiled, costs, est, fit, spec, eval_spec, args) -> None:
    """The sampler's schedules (stablerl_jax/pod/sampler_schedules.py) at a length distribution,
    priced per decode step (schedule_prices.schedule_rows), and the sampler / trainer split."""
    cfg, chip, rl = engine.cfg, roofline.chip_of(topo.name), engine.cfg.rl
    cap, b, slots = cfg.sampling.max_new_tokens, rl.prompts_per_step * rl.group_size, \
        sampler_programs.rows_per_pass(cfg)
    rng = np.random.default_rng(args.seed)
    k = args.schedule_steps
    lengths = sampler_schedules.lengths_from_spec(spec, cap, k * b + slots, rng)
    evals = sampler_schedules.lengths_from_spec(eval_spec, cap, rl.eval_problems * rl.eval_k,
                                                rng)
    prices = schedule_prices.sampler_prices(cfg, costs, topo.chips, chip)
    rows = schedule_prices.schedule_rows(cfg, prices, est["score"].seconds, est["update"].seconds,
                                  lengths, evals, steps=k)
    base = rows[0]
    print(f"\nlengths {spec} (drawn: mean {lengths.mean():,.0f}, truncated at {cap:,} "
          f"{np.mean(lengths == cap):.1%}); eval lengths {eval_spec} (mean "
          f"{evals.mean():,.0f}); {slots:,} sampler slots; {k} global steps simulated, "
          f"partial rollouts' means over steps {k // 2}-{k - 1}; seed {args.seed}\n\n"
          "| schedule | decode steps / step | slot occupancy | sample s | × static | "
          "score passes | score s | updates s | eval decode steps | eval occupancy | "
          "eval s (amortized) | global step s | × static | global step s, proximal π_old "
          "|\n|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r.name} | {r.steps:,.0f} | {r.occupancy:.2f} | {r.sample_s:.1f} | "
              f"{r.sample_s / base.sample_s:.2f} | {r.score_passes:.2f} | "
              f"{r.score_passes * r.score_s:.1f} | {r.train_s:.1f} | {r.eval_steps:,} | "
              f"{r.eval_occupancy:.2f} | {r.eval_s:.1f} | {r.global_s:.1f} | "
              f"{r.global_s / base.global_s:.2f} | {r.global_proximal_s:.1f} |")
    print("\n| schedule | dropped responses / step | prefill tokens / step | consumed "
          "token age: mean | max | share by age 0 / 1 / 2 |\n|---|---|---|---|---|---|")
    for r in rows[2:]:
        print(f"| {r.name} | {r.dropped:.1f} | {r.prefill_tokens / 1e6:.2f} M | "
              f"{r.age_mean:.2f} | {r.age_max} | "
              + " / ".join(f"{a:.2f}" for a in r.age_share) + " |")
    what = ("the reference decode attention ('blocks'): every row's key blocks up to the "
            "step's largest write slot" if prices.ragged else "a ragged decode attention "
            "(model.decode_attention_impl=pallas_tpu): each row reads only its own key blocks")
    print(f"\nwhat-if (schedule_prices.SamplerPrices.alt_seconds) with {what}\n\n"
          "| schedule | sample s | × static above | eval s (amortized) | global step s | "
          "× static above |\n|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r.name} | {r.sample_alt_s:.1f} | {r.sample_alt_s / base.sample_s:.2f} | "
              f"{r.eval_alt_s:.1f} | {r.global_alt_s:.1f} | "
              f"{r.global_alt_s / base.global_s:.2f} |")
    upd = compiled["update"]
    best = min(rows, key=lambda r: r.global_s)
    print(f"\nplacement (one-step-lag model, schedule_prices.placements): colocated, the best "
          f"schedule is {best.name} at {best.global_s:.1f} s per global step", flush=True)
    weight_bytes = sampler_programs.sampler_weight_bytes(engine)
    for r in rows[1:]:
        splits = schedule_prices.placements(r, topo.chips, slots, fit, upd.total_gib - upd.temp_gib,
                                     upd.temp_gib, topo.hbm_gib, weight_bytes, chip,
                                     step=max(1, topo.chips // 16))
        if not splits:
            print(f"- {r.name} on a separate sampler mesh: no split fits")
            continue
        sp = min(splits, key=lambda x: x.step_s)
        verdict = ("beats" if sp.step_s < best.global_s else "does not beat")
        print(f"- {r.name} on {sp.sampler_chips} sampler + {topo.chips - sp.sampler_chips} "
              f"trainer chips (the best of {len(splits)} feasible splits): sampler side "
              f"{sp.sampler_s:.1f} s, trainer side {sp.trainer_s:.1f} s, step "
              f"{sp.step_s:.1f} s ({verdict} colocated {best.global_s:.1f} s)", flush=True)


@one_line_errors
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="paper", choices=sorted(presets.EXPERIMENT_PRESETS))
    ap.add_argument("--topology", default="v5p-256",
                    help="e.g. v5p-256, v5e-8, v6e-64; 2xv5p-128 for two slices")
    ap.add_argument("--num-slices", type=int, default=None, metavar="K",
                    help="K slices of --topology joined by the data-center network "
                         "(default 1); set mesh_dcn=... to say which mesh axes span them")
    ap.add_argument("--steps", default="sample,score,update",
                    help="comma-separated, of sample, score, update, sft_update; or none")
    ap.add_argument("--kernels", action="store_true",
                    help="also compile the Pallas kernels inside shard_map")
    ap.add_argument("--traceback", action="store_true",
                    help="on an error, print the full traceback (default: one line, exit 2)")
    ap.add_argument("--save-hlo", default="", metavar="DIR",
                    help="also write each step's optimized HLO to DIR/<step>.hlo.txt")
    ap.add_argument("--lengths", action="append", default=[], metavar="SPEC",
                    help="also estimate the sampler's schedules at this response-length "
                         "distribution (stablerl_jax/pod/sampler_schedules.py: "
                         "lognormal:mean=8192[,sigma=0.75], fixed:N, file:PATH); repeatable")
    ap.add_argument("--eval-lengths", default="", metavar="SPEC",
                    help="the evaluation's length distribution (default: --lengths')")
    ap.add_argument("--schedule-steps", type=int, default=20,
                    help="global steps simulated for partial rollouts (default 20)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the length draws")
    ap.add_argument("--mfu", type=float, default=0.0, metavar="FRACTION",
                    help="also estimate score and update at this model-FLOP utilization "
                         "(default: the chip family's published figure, "
                         "roofline.PUBLISHED_MFU; v5p 0.5256)")
    ap.add_argument("overrides", nargs="*", help="key=value config overrides")
    args = ap.parse_args(argv)
    if not 0 <= args.mfu <= 1:
        ap.error(f"--mfu {args.mfu}: a fraction of the peak in (0, 1], e.g. --mfu 0.4")
    topo = aot.topology(args.topology, args.num_slices)
    cfg = presets.preset(args.preset, args.overrides)
    for spec in args.lengths + [args.eval_lengths] * bool(args.eval_lengths):
        # refused here, before minutes of compiling
        sampler_schedules.lengths_from_spec(spec, cfg.sampling.max_new_tokens, 1,
                                   np.random.default_rng(0))
    where = (f"{topo.slices} slices of {topo.jax_name}" if topo.slices > 1
             else topo.jax_name)
    print(f"{args.preset} on {topo.name} ({where}, {topo.chips} chips, "
          f"{topo.hbm_gib} GiB HBM each), mesh {cfg.mesh}"
          + (f", mesh_dcn {cfg.mesh_dcn}" if topo.slices > 1 else "")
          + f", overrides {args.overrides}", flush=True)
    print(HEADER, flush=True)
    steps = [] if args.steps == "none" else args.steps.split(",")
    engine = Engine.for_topology(cfg, topo) if steps else None
    results = []
    for name in steps:
        results.append(aot.compile_step(engine, name))
        print(_row(results[-1], topo.hbm_gib, cfg), flush=True)
        if args.save_hlo:
            os.makedirs(args.save_hlo, exist_ok=True)
            with open(os.path.join(args.save_hlo, f"{name}.hlo.txt"), "w") as f:
                f.write(results[-1].hlo)
    compiled = {c.step: c for c in results}
    if "sample" in steps:
        _estimates(engine, topo, compiled, args)
    elif {"score", "update"} & set(steps):
        chip = roofline.chip_of(topo.name)
        est = roofline.estimate(engine, compiled, chip).steps
        print(f"\nCompiler / roofline estimates, not measurements ({topo.name}: "
              f"{chip.source}):\n\n| step | estimated s | how |\n|---|---|---|")
        for e in est.values():
            print(f"| {e.step} | {_seconds(e.seconds)} | {e.detail} |", flush=True)
        if len(est) == 2:
            for spec in args.lengths:
                _train_table(engine, est, spec, args)
    if args.kernels:
        for c in aot.compile_kernels(cfg, topo):
            results.append(c)
            print(_row(c, topo.hbm_gib, cfg), flush=True)
    return 0 if all(c.total_gib <= topo.hbm_gib for c in results) else 1


if __name__ == "__main__":
    sys.exit(main())
