"""Meshes over several TPU slices (config `mesh_dcn`, sharding.make_mesh) and the bytes a
program sends between slices over the data-center network (hlo_loops.Module.network_bytes):
the setting's checks and one-line errors, the DCN / ICI split of hand-written HLO modules
(one slice's program with XLA's cross-slice transfers; a whole-mesh program classified by
its replica groups), and — with libtpu (the `tpu` extra; `pytest -m tpu`) — the hybrid
mesh of two abstract v5p-8 slices and the tiny preset's update compiled for it."""
import math

import pytest
from conftest import cpu_devices

from stablerl_jax import presets, sharding
from stablerl_jax.config import ConfigError
from stablerl_jax.pod import aot, hlo_loops, roofline
from stablerl_jax.rl.engine import Engine


def test_a_mesh_dcn_that_does_not_divide_the_mesh_is_refused_in_one_line():
    with pytest.raises(ConfigError) as e:
        presets.preset("tiny", ["mesh=1,2,2", "mesh_dcn=2,1,1"])
    msg = str(e.value)
    assert msg.startswith("mesh_dcn: (2, 1, 1) must divide mesh=(1, 2, 2)") and "\n" not in msg
    with pytest.raises(ConfigError, match="mesh_dcn: must be three positive ints"):
        presets.preset("tiny", ["mesh=2,2,2", "mesh_dcn=2,1"])
    assert presets.preset("tiny", ["mesh=2,2,2", "mesh_dcn=2,1,1"]).mesh_dcn == (2, 1, 1)


@pytest.mark.parametrize("argv,needle", [
    (["mesh=1,2,2", "mesh_dcn=2,1,1"], "mesh_dcn: (2, 1, 1) must divide mesh=(1, 2, 2)"),
    # Two slices asked for, the config's mesh_dcn spans one: refused before any compile.
    (["--num-slices", "2", "mesh=2,2,2"], "mesh_dcn=(1, 1, 1) spans 1 slice(s) but "
                                          "2xv5p-8 has 2"),
    (["--topology", "2xv5p-8", "--num-slices", "4"], "names 2 slices but --num-slices is 4"),
])
def test_aot_compile_refuses_a_slice_layout_in_one_line(argv, needle, capsys):
    from experiments import aot_compile
    argv = ["--preset", "tiny", *(["--topology", "v5p-8"] if "--topology" not in argv
                                   else []), *argv]
    with pytest.raises(SystemExit) as e:
        aot_compile.main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert needle in err and "\n" not in err


def test_cpu_devices_are_one_slice_so_a_hybrid_mesh_is_refused_in_one_line():
    """CPU devices have no slice_index: they count as one slice, mesh_dcn=(1, 1, 1) gives
    the usual mesh and more slices are refused (no fallback guesses slices from the
    device order or the processes)."""
    devices = cpu_devices()
    assert sharding.slice_count(devices) == 1
    mesh = sharding.make_mesh(2, 2, 2, devices=devices, dcn=(1, 1, 1))
    assert sharding.slice_indices(mesh) == (0,) * 8
    with pytest.raises(ValueError) as e:
        sharding.make_mesh(2, 2, 2, devices=devices, dcn=(2, 1, 1))
    msg = str(e.value)
    assert "mesh_dcn=(2, 1, 1) spans 2 slice(s)" in msg and "no slice_index" in msg
    assert "set mesh_dcn=1,1,1" in msg and "\n" not in msg
    with pytest.raises(ValueError, match=r"mesh_dcn=\(1, 2, 1\) must divide mesh=\(2, 1, 4\)"):
        sharding.make_mesh(2, 1, 4, devices=devices, dcn=(1, 2, 1))


# One slice's program (num_partitions = the 4 devices of a slice) of an all-reduce
# across slices as XLA's TPU compiler writes it: a reduce-scatter in the slice (its
# operand f32[8], 32 bytes), the megascale send / recv of each chip's f32[2] shard
# (8 bytes) between slices, an all-gather in the slice (its result f32[8], 32 bytes);
# the send sits in a loop of 3 known trips, whose condition all-reduces 4 flags (4 bytes)
# across slices with every trip.
_SLICE_HLO = """HloModule slice, num_partitions=4

%body (p: (s32[], f32[2])) -> (s32[], f32[2]) {
  %s = f32[2]{0} parameter(0)
  %tok = token[] after-all()
  %send = (f32[2]{0}, u32[], token[]) send(f32[2]{0} %s, token[] %tok), channel_id=1, \
is_host_transfer=true, frontend_attributes={_xla_host_transfer_handler_name=\
"xla_megascale_runtime",_xla_megascale_reduce_operation="SUM",\
_xla_megascale_transfer_type="ALL_REDUCE"}
  %recv = (f32[2]{0}, u32[], token[]) recv(token[] %tok), channel_id=2, \
is_host_transfer=true, frontend_attributes={_xla_megascale_transfer_type="ALL_REDUCE"}
  ROOT %done = f32[2]{0} recv-done((f32[2]{0}, u32[], token[]) %recv), channel_id=2
}

%cond (p: (s32[], f32[2])) -> pred[] {
  %flags = pred[4]{0} parameter(0)
  %t = token[] after-all()
  %any = (pred[4]{0}, u32[], token[]) send(pred[4]{0} %flags, token[] %t), channel_id=5, \
is_host_transfer=true, frontend_attributes={_xla_megascale_reduce_operation="MIN",\
_xla_megascale_transfer_type="ALL_REDUCE"}
  ROOT %c = pred[] constant(true)
}

ENTRY %main (a: f32[8]) -> f32[8] {
  %a = f32[8]{0} parameter(0)
  %rs = f32[2]{0} reduce-scatter(f32[8]{0} %a), channel_id=3, \
replica_groups={{0,1,2,3}}, use_global_device_ids=true, dimensions={0}, to_apply=%add
  %l = (s32[], f32[2]) while((s32[], f32[2]) %t), condition=%cond, body=%body, \
backend_config={"known_trip_count":{"n":"3"}}
  ROOT %ag = f32[8]{0} all-gather(f32[2]{0} %rs), channel_id=4, replica_groups=[1,4]<=[4], \
dimensions={0}, use_global_device_ids=true
}
"""


def test_one_slices_program_sends_its_cross_slice_bytes_over_dcn():
    m = hlo_loops.Module(_SLICE_HLO)
    assert m.num_devices == 4
    two = m.network_bytes(m.entry, slices=(0,) * 4 + (1,) * 4)
    # DCN: 3 trips × (the 8-byte shard + the 4 flags), all-reduces over k = 2 slices
    # moving 2 (k − 1) / k = 1 times their buffer; a recv is the same transfer as its
    # send, not counted again.
    assert two == {"ici": 32 + 32, "dcn": 3 * (8 + 4.0)}
    four = m.network_bytes(m.entry, slices=tuple(i // 2 for i in range(8)))
    assert four["dcn"] == 3 * (8 + 4) * 2 * 3 / 4
    # The same module's bytes by kind leave the transfers out: they are not collectives.
    assert sum(m.collective_bytes(m.entry).values()) == 64


# A loop as XLA leaves the layer scan of a multi-slice program: one iteration peeled, so
# the counter starts at 1, with no known_trip_count and no metadata of its own; its
# condition `counter < 16` still gives the count, 15. Its body all-gathers f32[16]
# (64 bytes).
_PEELED_HLO = """HloModule peeled, num_partitions=4

%body (p: (s32[], f32[4])) -> (s32[], f32[4]) {
  %bp = (s32[], f32[4]) parameter(0)
  %x = f32[4]{0} get-tuple-element((s32[], f32[4]) %bp), index=1
  %ag = f32[16]{0} all-gather(f32[4]{0} %x), replica_groups={{0,1,2,3}}, dimensions={0}
  ROOT %out = (s32[], f32[4]) tuple(s32[] %i2, f32[4]{0} %x)
}

%cond (p: (s32[], f32[4])) -> pred[] {
  %cp = (s32[], f32[4]) parameter(0)
  %i = s32[] get-tuple-element((s32[], f32[4]) %cp), index=0
  %n = s32[] constant(16)
  ROOT %lt = pred[] compare(s32[] %i, s32[] %n), direction=LT
}

ENTRY %main (a: f32[4]) -> (s32[], f32[4]) {
  %a = f32[4]{0} parameter(0)
  %one = s32[] constant(1)
  %start = s32[] copy(s32[] %one)
  %t = (s32[], f32[4]) tuple(s32[] %start, f32[4]{0} %a)
  ROOT %l = (s32[], f32[4]) while((s32[], f32[4]) %t), condition=%cond, body=%body
}
"""


def test_a_peeled_loop_without_a_known_trip_count_is_counted_by_its_condition():
    m = hlo_loops.Module(_PEELED_HLO)
    (loop,) = m.loops()
    assert (loop.trip, loop.condition) == (15, "cond")
    assert m.network_bytes(m.entry) == {"ici": 15 * 64, "dcn": 0}


# A whole-mesh program (num_partitions = all 8 devices, slices 0 0 0 0 1 1 1 1): an
# all-reduce over groups [[0, 2, 4, 6], [1, 3, 5, 7]] (the iota form) crosses slices,
# an all-gather over {0..3} {4..7} does not, a collective-permute 0 <-> 4 does.
_MESH_HLO = """HloModule mesh, num_partitions=8

ENTRY %main (a: f32[4]) -> f32[4] {
  %a = f32[4]{0} parameter(0)
  %ar = f32[4]{0} all-reduce(f32[4]{0} %a), replica_groups=[2,4]<=[4,2]T(1,0), \
use_global_device_ids=true, to_apply=%add
  %ag = f32[16]{0} all-gather(f32[4]{0} %ar), replica_groups={{0,1,2,3},{4,5,6,7}}, \
dimensions={0}
  ROOT %cp = f32[4]{0} collective-permute(f32[4]{0} %ar), source_target_pairs={{0,4},{4,0}}
}
"""


def test_a_whole_mesh_program_is_split_by_its_replica_groups():
    m = hlo_loops.Module(_MESH_HLO)
    ar, ag, cp = m.computations["main"][1:]
    assert ar.device_groups(8) == [(0, 2, 4, 6), (1, 3, 5, 7)]
    assert cp.device_groups(8) == [(0, 4), (4, 0)]
    slices = (0,) * 4 + (1,) * 4
    # all-reduce 2 × 16 bytes and collective-permute 16 over DCN; all-gather 64 on ICI.
    assert m.network_bytes(m.entry, slices=slices) == {"ici": 64, "dcn": 32 + 16}
    # One slice (or slices unknown): everything is ICI.
    assert m.network_bytes(m.entry) == {"ici": 64 + 32 + 16, "dcn": 0}


def test_dcn_bytes_are_priced_at_the_chips_dcn_bandwidth():
    v5p = roofline.chip_of("2xv5p-128")
    assert v5p is roofline.chip_of("v5p-256") and v5p.dcn_bw == 50e9 / 8  # 50 Gbps a chip
    assert roofline.chip_of("v5e-8").dcn_bw == 2 * 100e9 / 8 / 8  # 2 × 100 Gbps per 8 chips
    chip = roofline.ChipSpec(peak_flops=100.0, hbm_bw=10.0, ici_bw=4.0, source="t", dcn_bw=2.0)
    cost = roofline.Cost(flops=300, hbm_bytes=20, collective_bytes=8, dcn_bytes=6)
    assert cost.seconds(chip) == 3.0 + 2.0 + 3.0
    # A chip whose DCN bandwidth no page states: no DCN bytes cost 0 s, some cost nan.
    v6e = roofline.chip_of("v6e-64")
    assert roofline.Cost(0, 0, 0).seconds(v6e) == 0.0
    assert math.isnan(roofline.Cost(0, 0, 0, dcn_bytes=1).seconds(v6e))


@pytest.mark.tpu
def test_the_hybrid_mesh_of_two_v5p_8_slices_puts_the_dcn_axes_across_slices():
    import libtpu  # noqa: F401  (the tpu extra; CI installs it: fail, never skip)
    devices = aot.devices(aot.topology("v5p-8", 2))
    assert len(devices) == 8 and sharding.slice_count(devices) == 2
    for dcn, axis in [((2, 1, 1), 0), ((1, 2, 1), 1)]:
        mesh = sharding.make_mesh(2, 2, 2, devices=devices, dcn=dcn)
        grid = mesh.devices
        for idx in [(d, f, e) for d in range(2) for f in range(2) for e in range(2)]:
            # The DCN axis's index is the slice; the other two axes stay in the slice.
            assert grid[idx].slice_index == idx[axis], (dcn, idx)
        assert len(set(grid.flat)) == 8
    with pytest.raises(ValueError, match=r"spans 1 slice\(s\) but the 8 tpu devices are in 2"):
        sharding.make_mesh(2, 2, 2, devices=devices)


@pytest.mark.tpu
def test_a_mesh_that_splits_a_torus_axis_is_laid_out_and_others_are_jaxs():
    """(2, 8, 8) on a 4x4x8 v5p-256 needs a physical axis split between two mesh axes
    (the layout of 2 × v5p-128 compared with one slice); a mesh that fits the torus axis
    by axis, the paper's (1, 16, 8), is laid out as jax.make_mesh lays it out."""
    import jax
    import libtpu  # noqa: F401  (the tpu extra; CI installs it: fail, never skip)
    devices = aot.devices(aot.topology("v5p-256"))
    split = sharding.make_mesh(2, 8, 8, devices=devices)
    assert split.devices.shape == (2, 8, 8) and len(set(split.devices.flat)) == 128
    ours = sharding.make_mesh(1, 16, 8, devices=devices)
    assert (ours.devices == jax.make_mesh((1, 16, 8), sharding.MESH_AXES,
                                          devices=devices).devices).all()


@pytest.mark.tpu
def test_tiny_update_on_two_v5p_8_slices_all_reduces_its_gradient_over_dcn():
    """The tiny preset's update on 2 × v5p-8 (mesh 2,2,2, the data axis across the two
    slices; 45 s on 2 cores): the compiled program is one slice's (4 devices), its
    collectives stay in the slice (ICI), and what crosses slices is the data-parallel
    gradient sum (and the step's metrics): only all-reduce transfers — no weight is
    gathered over DCN — carrying at least each chip's share of the float32 gradient."""
    import jax
    import libtpu  # noqa: F401  (the tpu extra; CI installs it: fail, never skip)

    from stablerl_jax.model import transformer as tf
    topo = aot.topology("v5p-8", 2)
    cfg = presets.preset("tiny", ["mesh=2,2,2", "mesh_dcn=2,1,1"])
    engine = Engine.for_topology(cfg, topo)
    assert [d.slice_index for d in engine.mesh.devices[:, 0, 0]] == [0, 1]
    c = aot.compile_step(engine, "update")
    assert c.slices == (0,) * 4 + (1,) * 4
    module = hlo_loops.Module(c.hlo)
    assert module.num_devices == 4
    instrs = module.instructions_under(module.entry)
    kinds = {i.dcn_transfer for i in instrs if i.dcn_transfer}
    assert kinds == {"ALL_REDUCE"}, kinds
    net = roofline.step_network_bytes(cfg, "update", c.hlo, c.slices)
    params = jax.eval_shape(lambda: tf.init_params(jax.random.key(0), cfg.model))
    grad_bytes = sum(4 * math.prod(p.shape) for p in jax.tree.leaves(params))
    assert net["dcn"] >= grad_bytes / 4, (net, grad_bytes)
    assert net["ici"] > 0
    est = roofline.train_step_estimate(cfg, "update", c.hlo, c.model_flops,
                                       roofline.chip_of(topo.name), c.slices)
    assert "DCN" in est.detail and est.seconds >= net["dcn"] / (50e9 / 8)
