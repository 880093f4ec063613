"""Experiment presets, and key=value overrides applied together then validated once."""
import pytest

from stablerl_jax import presets
from stablerl_jax.config import ConfigError


def test_presets_validate():
    tiny = presets.preset("tiny")
    paper = presets.preset("paper")
    assert paper.model.num_experts == 128 and paper.model.top_k == 8
    assert paper.rl.group_size == 16 and paper.sampling.numerics == "fp8"
    assert paper.rl.prompts_per_step * paper.rl.group_size == 1024
    assert tiny.loss.name == "minirl" and tiny.loss.tis_cap == 5.0
    assert tiny.sft.optim.schedule == "cosine" and tiny.rl.optim.schedule == "constant"


def test_overrides_parse_by_field_type():
    cfg = presets.preset("tiny", ["rl.num_minibatches=4", "loss.clip=false", "rl.replay=r3",
                                  "rl.optim.learning_rate=2e-5", "mesh=2,2,2", "name=x",
                                  "loss.aggregation=seq_mean_token_mean",
                                  "sampling.router_noise_std=0.5"])
    assert cfg.rl.num_minibatches == 4 and cfg.loss.clip is False and cfg.rl.replay == "r3"
    assert cfg.rl.optim.learning_rate == 2e-5 and cfg.mesh == (2, 2, 2) and cfg.name == "x"
    assert cfg.loss.aggregation == "seq_mean_token_mean"
    assert cfg.sampling.router_noise_std == 0.5


def test_overrides_that_only_hold_together_apply_in_any_order():
    # Validated field by field, each of these would be refused halfway.
    for order in ([0, 1], [1, 0]):
        items = [["task.kind=gsm8k", "task.jsonl_dir=/data/gsm8k"][i] for i in order]
        assert presets.preset("tiny", items).task.kind == "gsm8k"
        items = [["model.num_experts=1", "model.top_k=1"][i] for i in order]
        cfg = presets.preset("tiny", items)
        assert (cfg.model.num_experts, cfg.model.top_k) == (1, 1)
    assert presets.preset("tiny", ["model.vocab_size=96"]).model.vocab_size == 96


@pytest.mark.parametrize("override,needle", [
    ("rl.replay=r4", "rl.replay:"),
    ("rl.num_minibatches=3", "rl.num_minibatches:"),
    ("rl.bogus=1", "unknown field 'bogus'"),
    ("nosection=1", "section.field"),
    ("rl.steps=abc", "cannot parse"),
    ("loss.clip=maybe", "true/false"),
    ("sampling.numerics=train", "sampling.numerics:"),
    ("rl.optim.eps=0", "rl.optim.eps:"),
    ("rl.optim=1", "is a section"),
    ("sampling.max_new_tokens=100", "model.max_seq_len"),
    ("rl.steps", "expected section.field=value"),
    ("mesh=a,b", "comma-separated ints"),
])
def test_bad_overrides_are_clear_errors(override, needle):
    with pytest.raises(ConfigError, match=needle):
        presets.preset("tiny", [override])


def test_unknown_preset():
    with pytest.raises(ConfigError, match="unknown 'huge'"):
        presets.preset("huge")


LAYOUT_KEYS = {"mesh", "mesh_dcn", "model.expert_parallel", "model.gmm_impl",
               "model.decode_attention_impl", "rl.logprob_impl", "sampling.max_batch"}


@pytest.mark.parametrize("platform, replaced", [
    ("cpu", {"model.gmm_impl": "loop", "model.decode_attention_impl": "blocks"}),
    ("gpu", {"model.gmm_impl": "loop", "model.decode_attention_impl": "blocks"}),
    ("tpu", {})])
def test_single_host_changes_the_layout_and_nothing_of_the_recipe(platform, replaced):
    from stablerl_jax.config import flat_dict
    own = flat_dict(presets.preset("paper"))
    here = flat_dict(presets.preset("paper", layout="single-host", platform=platform,
                                    devices=4))
    changed = {k for k in own if own[k] != here[k]}
    assert changed <= LAYOUT_KEYS  # bf16 compute, remat, micro-batches stay the preset's
    assert here["mesh"] == [1, 4, 1] and here["model.expert_parallel"] is False
    assert here["sampling.max_batch"] == 0
    kernels = {"model.gmm_impl", "model.decode_attention_impl", "rl.logprob_impl"}
    assert {k: here[k] for k in kernels if own[k] != here[k]} == replaced
    # Overrides apply after the layout.
    assert presets.preset("paper", ["mesh=1,2,2", "model.expert_parallel=true"],
                          layout="single-host").mesh == (1, 2, 2)


def test_an_unknown_layout_is_one_line_naming_the_choices():
    with pytest.raises(ConfigError, match=r"layout: unknown 'v5p'; choose one of"):
        presets.preset("paper", layout="v5p")


def test_auto_keeps_a_layout_that_runs_and_says_when_it_lays_one_out():
    from conftest import cpu_devices
    from stablerl_jax.rl import preflight
    one = cpu_devices(1)
    assert preflight.choose_layout("auto", "tiny", ["rl.steps=3"], one) == (
        presets.preset("tiny", ["rl.steps=3"]), "")
    cfg, said = preflight.choose_layout("auto", "paper", [], one)
    assert cfg == presets.preset("paper", layout="single-host")
    assert said.startswith("layout: the paper preset's own does not run here (mesh=(1, 16, 8) "
                           "needs 128 devices, only 1 are visible")
    assert "model.gmm_impl=loop" in said and "mesh=1,1,1" in said and "\n" not in said
    assert preflight.choose_layout("preset", "paper", [], one)[0] == presets.preset("paper")
    # A layout that cannot run here, named: one line with the field and the fix.
    with pytest.raises(ConfigError, match=r"model.gmm_impl='megablox' compiles for tpu only, "
                       "not cpu: set model.gmm_impl=loop, or --layout single-host"):
        preflight.check_kernels(presets.preset("paper", ["mesh=1,1,1",
                                                         "model.decode_attention_impl=blocks"]),
                                one)


def test_the_layouts_kernel_list_names_every_kernel_table_of_the_config():
    """KERNEL_FIELDS, kept beside the kernels' tables, names each of them once, with the
    config field that chooses a row of it."""
    from stablerl_jax.config import ExperimentConfig, choices
    from stablerl_jax.kernels import Impl
    tables = [v for v in vars(choices).values()
              if isinstance(v, dict) and v and all(isinstance(i, Impl) for i in v.values())]
    assert sorted(map(id, tables)) == sorted(id(t) for _, _, t in presets.KERNEL_FIELDS)
    default = ExperimentConfig()
    for section, field, table in presets.KERNEL_FIELDS:
        assert getattr(getattr(default, section), field) in table, field
