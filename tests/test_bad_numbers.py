"""Numbers a run cannot use (issue 34, items 7 and 9): every float is finite and every number
that is not a count lies in its declared range (config/schema.py; config.choices.NUMBER_RANGES), refused before anything is
written, in one sentence naming the key and the valid range, exit status 2."""

import math

import ml_collections
import pytest

from maxtext_rocm import config as config_lib
from maxtext_rocm import train
from maxtext_rocm.config.choices import NUMBER_RANGES


@pytest.mark.parametrize("preset, override, fragment", [
    # Each of these used to be accepted (or to end in a traceback after compiling).
    ("tiny_llama", "train.per_device_batch_size=inf", "use a finite number > 0"),
    ("tiny_llama", "data.seed=-1", "use an integer >= 0 and < 2**63"),
    ("tiny_mixtral", "model.moe_capacity_factor=inf", "use a finite number > 0"),
    ("tiny_llama", "optimizer.lr=inf", "use a finite number >= 0"),
    ("tiny_llama", "model.embed_init_std=nan", "use a finite number > 0"),
    ("tiny_llama", "train.seed=-3", "use an integer >= 0 and < 2**63"),
    ("tiny_llama", "optimizer.min_lr_ratio=2", "use a finite number >= 0 and <= 1"),
    ("tiny_llama", "train.hang_timeout_s=nan", "use a finite number >= 0"),
])
def test_numbers_out_of_range_are_one_sentence_and_nothing_is_written(tmp_path, capsys, preset, override, fragment):
    run = tmp_path / "run"
    status = train.main([f"configs/{preset}.py", f"--config.{override}", f"--config.output_dir={run}"])
    err = capsys.readouterr().err.strip().splitlines()
    key, value = override.split("=")
    assert status == 2 and len(err) == 1, err
    assert err[0].startswith(f"error: {key}=") and fragment in err[0], err[0]
    assert not run.exists()  # no config.json, no lock, no checkpoint


def test_a_nested_float_is_held_finite_too():
    cfg = config_lib.load("configs/tiny_llama.py")
    config_lib.set_key(cfg, "model.rope_scaling", {"factor": math.inf, "low_freq_factor": 1.0,
                                                   "high_freq_factor": 4.0, "original_max_position": 8192})
    with pytest.raises(config_lib.ConfigError, match=r"model.rope_scaling.factor=inf is not valid; use a finite number"):
        config_lib.validate(cfg)


def test_every_float_key_has_a_range():
    """A new float key declares its range in NUMBER_RANGES (and so is checked) or this fails."""
    def leaves(node, prefix=""):
        for key, value in node.items():
            if isinstance(value, ml_collections.ConfigDict):
                yield from leaves(value, f"{prefix}{key}.")
            else:
                yield f"{prefix}{key}", value
    floats = {key for key, value in leaves(config_lib.defaults()) if isinstance(value, float)}
    assert floats <= set(NUMBER_RANGES), sorted(floats - set(NUMBER_RANGES))
    assert set(NUMBER_RANGES) <= {key for key, _ in leaves(config_lib.defaults())}
