"""AOT compilation for TPU topologies (stablerl_jax/pod/aot.py): topology names, and — with
libtpu installed (the `tpu` extra; tests marked `tpu`, run by .ci/run) — a 2-layer
paper-preset update step and the Pallas kernels compiled for a v5p-8, the update's
per-chip memory checked against the analytic account of `aot_helpers.update_memory_bound`."""
import base64
import dataclasses
import re

import aot_helpers
import numpy as np
import pytest
from aot_helpers import expert_weight_gathers, update_memory_bound

from stablerl_jax import presets
from stablerl_jax.pod import aot
from stablerl_jax.rl.engine import Engine


@pytest.mark.parametrize("name,jax_name,chips,hbm", [
    ("v5p-8", "v5p:2x2x1", 4, 95.74), ("v5p-256", "v5p:4x4x8", 128, 95.74),
    ("v5p-512", "v5p:4x8x8", 256, 95.74), ("v5e-8", "v5e:2x4", 8, 15.75),
    ("v5e-256", "v5e:16x16", 256, 15.75), ("v6e-64", "v6e:8x8", 64, 32.0),
    ("v4-16", "v4:2x2x2", 8, 32.0)])
def test_topology_names(name, jax_name, chips, hbm):
    topo = aot.topology(name)
    assert (topo.jax_name, topo.chips, topo.hbm_gib, topo.slices) == (jax_name, chips, hbm, 1)


def test_several_slices_are_named_by_a_count_or_a_prefix():
    two = aot.topology("v5p-128", 2)
    assert two == aot.topology("2xv5p-128")
    # Each slice a 4x4x4 torus of 64 chips; 128 chips in all, as one v5p-256.
    assert (two.name, two.jax_name, two.chips, two.slices) == ("2xv5p-128", "v5p:4x4x4",
                                                               128, 2)
    assert aot.topology("1xv5e-8") == aot.topology("v5e-8")


@pytest.mark.parametrize("bad,slices", [("v5p-12", None), ("v7-8", None), ("v5p", None),
                                        ("v5e-0", None), ("0xv5p-8", None), ("v5p-8", 0),
                                        ("2xv5p-8", 3)])
def test_bad_topology_names_are_clear_errors(bad, slices):
    with pytest.raises(ValueError, match="topology"):
        aot.topology(bad, slices)


def test_collectives_are_counted_once_per_instruction():
    hlo = ("  %ag = bf16[8,4]{1,0} all-gather(bf16[2,4]{1,0} %p), dimensions={0}\n"
           "  %s = (f32[4], f32[8]) all-gather-start(f32[4] %q)\n"
           "  %d = f32[8] all-gather-done((f32[4], f32[8]) %s)\n"
           "  %rs = f32[2] reduce-scatter(f32[8] %x), dimensions={0}\n"
           "  %ar = f32[] all-reduce-start(f32[] %y)\n")
    assert aot.collectives(hlo) == {"all-gather": 2, "all-to-all": 0, "reduce-scatter": 1,
                                    "all-reduce": 1, "collective-permute": 0}


# A module in the optimized-HLO text form: ENTRY runs a layer loop (3 known trips) whose
# body all-gathers bf16[8,4] (64 bytes) and runs a data-dependent inner loop that
# reduce-scatters f32[8] → f32[2] (32 bytes of operand) and all-reduces f32[2] (8 bytes,
# counted twice); ENTRY's own all-to-all moves s32[4] (16 bytes).
_HLO = """HloModule m

%inner_body (p: (s32[], f32[2])) -> (s32[], f32[2]) {
  %x = f32[8]{0} parameter(1)
  %rs = f32[2]{0} reduce-scatter(f32[8]{0} %x), dimensions={0}, to_apply=%add
  ROOT %ar = f32[2]{0} all-reduce-start(f32[2]{0} %rs), to_apply=%add
}

%inner_cond (p: (s32[], f32[2])) -> pred[] {
  ROOT %c = pred[] constant(true)
}

%add (a: f32[], b: f32[]) -> f32[] {
  ROOT %s = f32[] add(f32[] %a, f32[] %b)
}

%layer_body (p: (s32[], bf16[8,4])) -> (s32[], bf16[8,4]) {
  %w = bf16[2,4]{1,0} parameter(0)
  %ag = bf16[8,4]{1,0} all-gather(bf16[2,4]{1,0} %w), dimensions={0}
  ROOT %loop = (s32[], f32[2]) while((s32[], f32[2]) %t), condition=%inner_cond, \
body=%inner_body, metadata={op_name="jit(f)/while/body/while"}
}

%layer_cond (p: (s32[], bf16[8,4])) -> pred[] {
  ROOT %c = pred[] constant(true)
}

ENTRY %main (a: s32[4]) -> s32[4] {
  %a = s32[4]{0} parameter(0)
  %l = (s32[], bf16[8,4]) while((s32[], bf16[8,4]) %t0), condition=%layer_cond, \
body=%layer_body, metadata={op_name="jit(f)/while"}, \
backend_config={"known_trip_count":{"n":"3"}}
  ROOT %x = s32[4]{0} all-to-all(s32[4]{0} %a), dimensions={0}
}
"""


def test_collective_bytes_multiply_nested_loops_by_their_trip_counts():
    from stablerl_jax.pod import hlo_loops
    m = hlo_loops.Module(_HLO)
    assert m.entry == "main"
    loops = {lp.body: lp for lp in m.loops()}
    assert loops["layer_body"].trip == 3 and loops["inner_body"].trip is None
    # The data-dependent loop is the caller's to count: 5 iterations per layer.
    inner = loops["inner_body"].name
    assert m.collective_bytes("inner_body") == {
        "all-gather": 0, "all-to-all": 0, "reduce-scatter": 32, "all-reduce": 16,
        "collective-permute": 0}
    total = m.collective_bytes("main", {inner: 5})
    assert total == {"all-gather": 3 * 64, "all-to-all": 16, "reduce-scatter": 3 * 5 * 32,
                     "all-reduce": 3 * 5 * 16, "collective-permute": 0}
    assert hlo_loops.decode_loop(m).body == "inner_body"  # the only data-dependent one
    body = m.instructions_under("layer_body")
    assert aot_helpers.param_gathers(body, [(4, 8), (8, 1, 4)]) != []
    assert aot_helpers.param_gathers(body, [(2, 4)]) == []


def test_roofline_is_the_slower_of_compute_and_memory_plus_communication():
    from stablerl_jax.pod import roofline
    chip = roofline.ChipSpec(peak_flops=100.0, hbm_bw=10.0, ici_bw=4.0, source="test")
    assert roofline.Cost(flops=300, hbm_bytes=20, collective_bytes=8).seconds(chip) == 5.0
    assert roofline.Cost(flops=100, hbm_bytes=50, collective_bytes=0).seconds(chip) == 5.0
    v5p = roofline.chip_of("v5p-256")
    assert (v5p.peak_flops, v5p.hbm_bw, v5p.ici_bw) == (459e12, 2765e9, 600e9)


def test_decode_steps_by_the_key_blocks_they_read():
    from stablerl_jax.pod import roofline
    # Slots 3..8 with blocks of 4: slot 3 reads block 0; 4..7 blocks 0-1; 8 blocks 0-2.
    assert roofline.extra_blocks(3, 6, 4) == {0: 1, 1: 4, 2: 1}
    assert roofline.extra_blocks(3, 6, 0) == {0: 6}
    # The paper preset: 1,024 prompt slots, 32,768 decode steps, blocks of 512.
    counts = roofline.extra_blocks(1024, 32_768, 512)
    assert sum(counts.values()) == 32_768 and max(counts) == 63 and counts[0] == 512


def test_a_bad_length_spec_is_refused_before_any_compile(capsys):
    from experiments import aot_compile
    with pytest.raises(SystemExit) as e:
        aot_compile.main(["--preset", "tiny", "--topology", "v5e-8",
                          "--lengths", "lognormal:mean=0"])
    assert e.value.code == 2
    err = capsys.readouterr()
    assert "mean must be a number > 0" in err.err and "| step |" not in err.out


def test_kv_cache_bytes_per_row_of_the_paper_preset():
    from stablerl_jax.pod import sampler_programs
    cfg = presets.preset("paper")
    # 48 layers × (keys, values) × 33,792 slots × 4 KV heads × 128 × 2 bytes (bf16).
    assert sampler_programs.kv_bytes_per_row(cfg) == 48 * 2 * 33_792 * 4 * 128 * 2
    assert sampler_programs.rows_per_pass(cfg) == 1024


# The paper preset with 2 layers on a v5p-8 (4 chips: fsdp 2 × expert 2), full-size
# model widths and 33k-token sequences; 64 responses per mini-batch in 16 micro-batches
# of one response per chip.
CI_OVERRIDES = ["model.num_layers=2", "mesh=1,2,2", "rl.prompts_per_step=4",
                "rl.microbatches=16", "sampling.max_batch=64"]


@pytest.mark.tpu
def test_paper_update_compiles_for_v5p_8_within_its_analytic_bound():
    import libtpu  # noqa: F401  (the tpu extra; CI installs it: fail, never skip)
    topo = aot.topology("v5p-8")
    cfg = presets.preset("paper", CI_OVERRIDES)
    engine = Engine.for_topology(cfg, topo)
    c = aot.compile_step(engine, "update")
    acct = update_memory_bound(cfg, engine)
    gib = {k: v / aot.GIB for k, v in acct.items()}
    # The arguments are the train state (params + AdamW moments, exact) and the batch.
    assert gib["state"] <= c.argument_gib <= gib["state"] + gib["batch"], (c, gib)
    assert c.total_gib <= gib["bound"], (c, gib)
    assert c.total_gib <= topo.hbm_gib
    # Expert parallelism on the TPU program: tokens are exchanged (all-gather /
    # reduce-scatter), but no all-gather ever yields all 128 experts of a weight.
    assert c.collectives["all-gather"] > 0 and c.collectives["reduce-scatter"] > 0
    assert expert_weight_gathers(c.hlo, cfg.model.num_experts,
                                 cfg.model.expert_ffn_dim) == []


@pytest.mark.tpu
def test_pallas_kernels_compile_for_v5p_8():
    import libtpu  # noqa: F401  (the tpu extra; CI installs it: fail, never skip)
    cfg = presets.preset("paper", CI_OVERRIDES)
    for c in aot.compile_kernels(cfg, aot.topology("v5p-8")):
        assert c.total_gib <= aot.topology("v5p-8").hbm_gib, c


@pytest.mark.tpu
@pytest.mark.parametrize("top_k,numerics", [(8, "fp8"), (2, "fp8"), (2, "bitwise")])
def test_serve_layout_decode_loop_moves_only_activations_on_v5p_8(top_k, numerics):
    """The sample step of the 2-layer paper preset under the serving layout, compiled for
    a v5p-8: no loop body of the decode loop (the decode step, its layer loop) all-gathers
    a weight, and its collectives per decode step stay within the activations' bytes.
    Top-8 over 4 expert shards gathers the shards' tokens; top-2 exchanges them by a
    ragged all-to-all (expert_parallel.exchange_moves_less), as the batch-invariant
    sampler (`bitwise`, model/invariant.py) always does."""
    import libtpu  # noqa: F401  (the tpu extra; CI installs it: fail, never skip)

    from stablerl_jax.pod import hlo_loops
    topo = aot.topology("v5p-8")
    # Short sequences: the layout, not the KV cache's size, is under test.
    cfg = presets.preset("paper", CI_OVERRIDES + [
        "sampling.layout=serve", "task.max_prompt_len=64", "sampling.max_new_tokens=64",
        f"model.top_k={top_k}", f"sampling.numerics={numerics}"])
    c = aot.compile_step(Engine.for_topology(cfg, topo), "sample")
    module = hlo_loops.Module(c.hlo)
    loop = hlo_loops.decode_loop(module)
    body = module.instructions_under(loop.body)
    import jax

    from stablerl_jax.model import transformer as tf
    params_like = jax.eval_shape(lambda: tf.init_params(jax.random.key(0), cfg.model))
    shapes = aot_helpers.weight_shapes(params_like, cfg.model.num_experts, cfg.mesh[2])
    assert aot_helpers.param_gathers(body, shapes) == []
    mc, b, n = cfg.model, cfg.sampling.max_batch, topo.chips
    ragged = any(i.opcode.startswith("ragged-all-to-all") for i in body)
    assert ragged == (top_k == 2), [i.opcode for i in body if i.collective]
    if ragged:
        # Per layer a chip sends its rows' B/n·K assignments' hidden states out and
        # their outputs back, and all-gathers the counts per (chip, expert) (n × E);
        # at most 4 bytes a value.
        per_layer = 2 * (b // n) * mc.top_k * mc.d_model + n * mc.num_experts
    else:
        # Every row's hidden state in (B × D) and the partial outputs back (B × D,
        # float32), the routes and weights (B × K each): B = the pass's rows, all of
        # which the expert shards see.
        per_layer = b * (2 * mc.d_model + 2 * mc.top_k + mc.num_experts)
    bound = mc.num_layers * per_layer * 4
    trips = hlo_loops.trips_by_function(module, {"forward": mc.num_layers})
    per_step = sum(module.collective_bytes(loop.body, trips).values())
    assert 0 < per_step <= bound, (per_step, bound)


def _mosaic_calls(body) -> list[tuple[str, int]]:
    """Each Mosaic call of `body` (instructions of an HLO module) as (its kernel's name,
    read from the serialized kernel the call carries; how many loops hold it, from its
    op_name)."""
    out = []
    for i in body:
        if i.opcode != "custom-call" or "tpu_custom_call" not in i.attrs:
            continue
        kernel = base64.b64decode(re.search(r'body\\?":\\?"([A-Za-z0-9+/=]+)', i.attrs).group(1))
        name = re.search(rb"_[a-z]+_kernel[a-z_]*", kernel).group(0).decode()
        out.append((name, re.search(r'op_name="([^"]*)"', i.attrs).group(1).count("while/body")))
    return out


@pytest.mark.tpu
@pytest.mark.parametrize("gmm_impl,logprob_impl,attention", [
    ("pallas_tpu", "chunked", "blocks"), ("megablox", "chunked", "blocks"),
    ("megablox", "pallas_tpu", "pallas_tpu")])
def test_the_bitwise_decode_step_runs_the_invariant_kernels_on_v5p_8(gmm_impl, logprob_impl,
                                                                    attention):
    """Under `bitwise` the per-token expert FFN runs the model's grouped matmul where its
    row is batch-invariant (the Pallas kernel: the decode loop calls Mosaic) and the
    reference `loop` where it is not (megablox); the sampler draws from the trainer's
    fused log-prob kernel where its row is batch-invariant (pallas_tpu: Mosaic again),
    else from the row tiles; its attention is the per-token kernel of the decode row
    where the row brings one (pallas_tpu), else the per-token path's own blocks. No other
    Mosaic call is in the decode loop; the sample step compiles for a v5p-8 every way."""
    import libtpu  # noqa: F401  (the tpu extra; CI installs it: fail, never skip)

    from stablerl_jax.pod import hlo_loops
    cfg = presets.preset("paper", CI_OVERRIDES + [
        "sampling.layout=serve", "task.max_prompt_len=64", "sampling.max_new_tokens=64",
        "model.top_k=2", "sampling.numerics=bitwise", f"model.gmm_impl={gmm_impl}",
        f"rl.logprob_impl={logprob_impl}", f"model.decode_attention_impl={attention}"])
    c = aot.compile_step(Engine.for_topology(cfg, aot.topology("v5p-8")), "sample")
    module = hlo_loops.Module(c.hlo)
    calls = _mosaic_calls(module.instructions_under(hlo_loops.decode_loop(module).body))
    # The log-prob kernels (statistics, then the distribution) run once per decode step,
    # the grouped matmul and the attention in the layer loop inside it.
    names = {n for n, _ in calls}
    assert sorted(n for n, d in calls if d == 1) == (
        ["_fwd_kernel", "_logp_kernel"] if logprob_impl == "pallas_tpu" else []), calls
    assert all(d > 1 for n, d in calls if n in ("_gmm_kernel", "_token_kernel")), calls
    assert ("_gmm_kernel" in names) == (gmm_impl == "pallas_tpu"), calls
    assert ("_token_kernel" in names) == (attention == "pallas_tpu"), calls
    assert names <= {"_fwd_kernel", "_logp_kernel", "_gmm_kernel", "_token_kernel"}, calls


@pytest.mark.tpu
def test_decode_block_reads_one_block_of_the_cache_on_v5p_8():
    """One layer's blocked decode attention (model.decode_block) against the whole
    33k-slot cache, compiled for a v5p-8 on its own: XLA's HBM bytes (its loop body
    counted once) are those of one block's keys and values of this chip's rows plus
    the small per-row state, not of the whole cache."""
    import libtpu  # noqa: F401  (the tpu extra; CI installs it: fail, never skip)

    from stablerl_jax.pod import roofline, sampler_programs
    topo = aot.topology("v5p-8")
    cfg = presets.preset("paper", CI_OVERRIDES + ["sampling.layout=serve"])
    engine = Engine.for_topology(cfg, topo)
    fn, args = sampler_programs.decode_block_program(engine)
    cost = roofline.of_compiled(fn.lower(*args).compile())
    mc = cfg.model
    rows_per_chip = cfg.sampling.max_batch // topo.chips
    kv_block = rows_per_chip * mc.decode_block * mc.num_kv_heads * mc.head_dim * 2 * 2
    # Besides keys and values: the block's float32 scores [rows, H, block], written and
    # read by each stage of the online softmax (max, exp-sum, PV, at most 4 round trips).
    scores = rows_per_chip * mc.num_heads * mc.decode_block * 4
    assert kv_block <= cost.hbm_bytes <= kv_block + 8 * scores, (cost, kv_block, scores)
    assert cost.collective_bytes == 0


@pytest.mark.tpu
def test_scanned_decode_layer_reads_its_cache_by_blocks_on_v5p_8():
    """The decode step as the sampler runs it (the layer loop a scan over the stacked
    KV cache), compiled for a v5p-8: XLA's bytes for one layer (roofline.decode_step_cost:
    the step less its head) stay below twice the layer's K and V of this chip's rows. A
    layer that sliced its whole cache out of the stack before attending (a copy, as the
    slice feeds the block loop) would count at least that, reading and writing both
    (3.96 GB here; 1.67 GB with the blocks sliced in place; the bound is 2 × 1.11 GB)."""
    import libtpu  # noqa: F401  (the tpu extra; CI installs it: fail, never skip)

    from stablerl_jax.pod import roofline
    topo = aot.topology("v5p-8")
    cfg = presets.preset("paper", CI_OVERRIDES + ["sampling.layout=serve"])
    assert not cfg.model.unroll_layers
    layer, _, head = roofline.decode_step_cost(Engine.for_topology(cfg, topo))
    mc = cfg.model
    rows_per_chip = cfg.sampling.max_batch // topo.chips
    slots = cfg.task.max_prompt_len + cfg.sampling.max_new_tokens
    kv_layer = rows_per_chip * slots * mc.num_kv_heads * mc.head_dim * 2 * 2
    assert 0 < layer.hbm_bytes < 2 * kv_layer, (layer, kv_layer)
    assert head.optimal_seconds > 0  # loop-free: XLA's own estimate is valid there


@pytest.mark.tpu
def test_the_per_token_kernel_declares_its_reads_to_xla_on_v5p_8():
    """XLA's cost analysis of a Mosaic call is what the call declares: the per-token
    attention kernel, compiled for a v5p-8 chip on its own, counts token_cost's FLOPs,
    exponentials and bytes at the key blocks `priced_blocks` names (outside it, every
    block of the cache), plus the mask's padding around the call, which no block count
    changes: one block more is exactly token_cost's difference, in every count."""
    import jax
    import jax.numpy as jnp
    import libtpu  # noqa: F401  (the tpu extra; CI installs it: fail, never skip)
    from jax.sharding import SingleDeviceSharding

    from stablerl_jax.kernels import decode_attention_pallas as dap
    dev = SingleDeviceSharding(aot.devices(aot.topology("v5p-8"))[0])
    n, kv, g, dh, s, block = 8, 4, 8, 128, 2048, 512
    like = lambda shape, dt: jax.ShapeDtypeStruct(shape, dt, sharding=dev)
    args = (like((n, kv, g, dh), jnp.bfloat16), *(like((n,), jnp.int32),) * 3,
            *(like((n, kv, s, dh), jnp.bfloat16),) * 2, like((n, s), bool))

    def counted(blocks):
        def call(*a):
            if blocks is None:
                return dap.tokens(*a, block=block)
            with dap.priced_blocks(blocks):
                return dap.tokens(*a, block=block)
        cost = jax.jit(call).lower(*args).compile().cost_analysis()
        cost = cost[0] if isinstance(cost, (list, tuple)) else cost
        return np.array([cost["flops"], cost["transcendentals"], cost["bytes accessed"]])

    declared = lambda blocks: np.array(dataclasses.astuple(
        dap.token_cost(n, kv, g, dh, 2, block, s, blocks))[:3])
    flops, exps, nbytes = declared(1)
    one, two, whole = counted(1), counted(2), counted(None)
    assert np.array_equal(two - one, declared(2) - declared(1)), (one, two)
    assert np.array_equal(whole - one, declared(s // block) - declared(1)), (one, whole)
    # Around the call, nothing per block: the mask's int32 conversion and padding (per
    # slot of the padded row at most the bool read, the int32 written and read, the
    # padded int32 written: 13 bytes; an op or two each).
    assert one[1] == exps and flops <= one[0] <= flops + 4 * n * s, one
    assert nbytes <= one[2] <= nbytes + 13 * n * dap._mask_width(s, block), one


@pytest.mark.tpu
def test_a_bitwise_decode_step_is_priced_with_the_per_token_kernel_on_v5p_8():
    """Under `bitwise` with the per-token kernel (the paper preset's pallas_tpu), the
    decode step program attends by the kernel at one declared block per query and a key
    block is the kernel's declared difference (roofline.decode_step_costs); with the
    path's own blocks, by the per-query gathers those blocks compile to, which XLA
    counts at more bytes per layer."""
    import libtpu  # noqa: F401  (the tpu extra; CI installs it: fail, never skip)

    from stablerl_jax.pod import roofline, sampler_programs
    topo = aot.topology("v5p-8")
    costs, engines = {}, {}
    for impl in ("pallas_tpu", "blocks"):
        cfg = presets.preset("paper", CI_OVERRIDES + [
            "sampling.layout=serve", "sampling.numerics=bitwise", "model.row_tile=8",
            f"model.decode_attention_impl={impl}"])
        engines[impl] = Engine.for_topology(cfg, topo)
        assert sampler_programs.token_kernel(engines[impl]) == (impl == "pallas_tpu")
        costs[impl] = roofline.decode_step_costs(engines[impl], cfg.task.max_prompt_len)
    kernel_block = sampler_programs.token_block_cost(engines["pallas_tpu"])
    (k_layer, _, k_block, _), (b_layer, _, _, _) = costs["pallas_tpu"], costs["blocks"]
    assert (k_block.flops, k_block.hbm_bytes) == (
        kernel_block["flops"], kernel_block["bytes accessed"]), k_block
    assert k_layer.hbm_bytes < b_layer.hbm_bytes, (k_layer, b_layer)
