"""The persistent compilation cache: a restarted run loads its compiled step instead of compiling
it, trains identically from it, and `train.compilation_cache` says where the cache lives."""

import os

import jax
import numpy as np
import pytest

from maxtext_rocm.trainer import compilation
from maxtext_rocm import config as config_lib
from maxtext_rocm.train import Trainer

from conftest import small_config


@pytest.fixture
def restore_jax_cache_settings():
    """Every compile is written (the small model compiles in under JAX's 1 s threshold on a fast
    machine); JAX's own settings come back afterwards."""
    directory = jax.config.jax_compilation_cache_dir
    min_time = jax.config.jax_persistent_cache_min_compile_time_secs
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    yield
    jax.config.update("jax_persistent_cache_min_compile_time_secs", min_time)
    jax.config.update("jax_compilation_cache_dir", directory)
    from jax.experimental.compilation_cache import compilation_cache

    compilation_cache.reset_cache()


def _params(trainer):
    return [np.asarray(x) for x in jax.tree_util.tree_leaves(trainer.state.params)]


def test_restarted_run_loads_its_step_from_the_cache_and_trains_identically(tmp_path, devices,
                                                                            restore_jax_cache_settings):
    cache = tmp_path / "xla_cache"

    def config(name):
        return small_config(**{"output_dir": str(tmp_path / name), "train.compilation_cache": str(cache),
                               "checkpoint.async_save": False, "mesh.ici.fsdp": 2})

    # The reference: compiled here, straight through 4 steps (writing the cache).
    reference = Trainer(config("reference"), devices=devices[:2], log=lambda *_: None)
    assert reference.compilation_cache == str(cache)
    assert any(name.startswith("jit_train_step") for name in os.listdir(cache))
    reference.run()

    # A run stopped after 2 steps, then restarted by a new Trainer in its output_dir.
    first = Trainer(config("run"), devices=devices[:2], log=lambda *_: None)
    first.run(2)
    first.save_checkpoint()
    first.checkpointer.wait()
    hits = compilation.cache_hits()
    lines = []
    restarted = Trainer(config("run"), devices=devices[:2], log=lines.append)
    assert restarted.step_count == 2
    assert compilation.cache_hits() > hits, "the restarted run compiled its step again"
    restarted.run()
    assert any("loaded from" in line and str(cache) in line for line in lines), lines
    for got, want in zip(_params(restarted), _params(reference)):
        np.testing.assert_array_equal(got, want)


def test_a_run_resumed_with_more_steps_and_another_rate_reuses_the_compiled_step(
        tmp_path, devices, restore_jax_cache_settings):
    """The optimizer's numbers are an argument of the step, not part of the program: extending a
    run (more train.steps, so another cosine) with another learning rate loads the step the first
    run compiled, and trains under the new schedule."""
    cache = tmp_path / "xla_cache"

    def config(**overrides):
        return small_config(**{"output_dir": str(tmp_path / "run"), "train.compilation_cache": str(cache),
                               "checkpoint.async_save": False, **overrides})

    def compiled_steps():
        return {name for name in os.listdir(cache) if name.startswith("jit_train_step") and "atime" not in name}

    first = Trainer(config(), devices=devices[:1], log=lambda *_: None)
    first.run(2)
    first.save_checkpoint()
    first.checkpointer.wait()
    written = compiled_steps()
    assert len(written) == 1, written
    hits = compilation.cache_hits()
    extended = config(**{"train.steps": 40, "optimizer.lr": 1e-3, "optimizer.warmup_steps": 4})
    resumed = Trainer(extended, devices=devices[:1], log=lambda *_: None)
    assert resumed.step_count == 2
    assert compilation.cache_hits() > hits and compiled_steps() == written, "the resumed run compiled its step"
    # Step 2 of the new 4-step warmup to 1e-3 (the first run's schedule gives another rate there).
    assert float(first.step()["lr"]) != pytest.approx(0.5e-3)
    np.testing.assert_allclose(float(resumed.step()["lr"]), 0.5e-3, rtol=1e-6)


def test_off_compiles_without_a_cache(tmp_path, devices, restore_jax_cache_settings):
    cfg = small_config(**{"output_dir": str(tmp_path / "run"), "train.compilation_cache": "off"})
    trainer = Trainer(cfg, devices=devices[:1], log=lambda *_: None)
    assert trainer.compilation_cache is None
    assert jax.config.jax_compilation_cache_dir is None
    assert not (tmp_path / "run" / "compilation_cache").exists()
    assert "compilation cache: off" in trainer.describe()


def test_the_setting_names_the_directory(tmp_path, monkeypatch):
    out = str(tmp_path / "run")
    monkeypatch.delenv("JAX_COMPILATION_CACHE_DIR", raising=False)
    assert compilation.cache_directory("auto", out) == os.path.join(out, "compilation_cache")
    assert compilation.cache_directory("off", out) is None
    assert compilation.cache_directory(str(tmp_path / "shared"), out) == str(tmp_path / "shared")
    monkeypatch.setenv("HOME", str(tmp_path))
    assert compilation.cache_directory("~/jax_cache", out) == str(tmp_path / "jax_cache")
    # The user's own JAX setting wins over the run's directory.
    monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", str(tmp_path / "mine"))
    assert compilation.cache_directory("auto", out) == str(tmp_path / "mine")


def test_an_unusable_directory_is_a_user_error(tmp_path, restore_jax_cache_settings):
    a_file = tmp_path / "file"
    a_file.write_text("not a directory")
    with pytest.raises(config_lib.UserError, match=r"cannot create the compilation cache directory .*file.*'off'"):
        compilation.use_persistent_cache(str(a_file), str(tmp_path / "run"))
    with pytest.raises(config_lib.ConfigError, match="train.compilation_cache must be 'auto', 'off' or a directory"):
        config_lib.validate(small_config(**{"train.compilation_cache": ""}))
