"""Inputs tests/fuzz_test.py found that broke its property (a user error, or it works as
written), each kept as a test of its own. Those whose fix is open are strict xfails,
each also listed in fuzz_test.OPEN, whose inputs the harness passes over: when the fix
lands the test passes, the strict xfail fails, and the mark and the OPEN entry come
off."""
import json
import os

import pytest
from fuzz_helpers import USER_ERRORS, write_tiny_checkpoint

from stablerl_jax import presets
from stablerl_jax.config import ConfigError, apply_overrides
from stablerl_jax.rl import preflight


# Found as AttributeError / TypeError; fixed in rl/preflight.py.
@pytest.mark.parametrize("saved", [False, [], "config", 3])
def test_a_stored_config_that_is_not_an_object_is_refused(saved):
    with pytest.raises(ValueError, match="workdir"):
        preflight.check_resumed_config(saved, presets.tiny(), [], "workdir")


# Found read as (1, 1, 1); fixed in config/experiment.py.
@pytest.mark.parametrize("value", ["1,,1,1", ",1,1,1", "1, ,1,1"])
def test_a_tuple_override_with_an_empty_entry_is_refused(value):
    with pytest.raises(ConfigError, match="mesh"):
        apply_overrides(presets.tiny(), [f"mesh={value}"])


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("hf"))
    _, index = write_tiny_checkpoint(path)
    return path, index


def _read_with_index(path: str, index: bytes):
    from stablerl_jax.interop import hf_checkpoint

    with open(os.path.join(path, "model.safetensors.index.json"), "wb") as f:
        f.write(index)
    return hf_checkpoint.read_config(path)


# Found as AttributeError (.get on whatever the index held); fixed in hf_checkpoint.py.
@pytest.mark.parametrize("index", [b"null", b"[]", b'"weights"'])
def test_a_shard_index_that_is_not_an_object_is_refused(checkpoint, index):
    path, _ = checkpoint
    with pytest.raises(USER_ERRORS, match="model.safetensors.index.json"):
        _read_with_index(path, index)


# Found as safetensors' SafetensorError (neither a ValueError nor an OSError: a traceback
# at the command line); fixed in hf_checkpoint.py.
def test_a_shard_index_naming_the_wrong_shard_is_refused(checkpoint):
    path, index = checkpoint
    name = "model.layers.0.mlp.gate.weight"
    moved = {**index, "weight_map": {**index["weight_map"],
                                     name: "model-00001-of-00002.safetensors"}}
    with pytest.raises(USER_ERRORS, match=name.replace(".", r"\.")):
        _read_with_index(path, json.dumps(moved).encode())
