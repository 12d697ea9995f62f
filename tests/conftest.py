"""Eight fake CPU devices for every test, so sharded meshes are real meshes."""

import atexit
import os
import shutil
import tempfile

# Must happen before jax initialises its backends.
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# One persistent compilation cache for the session, inherited by the trainers the tests start as
# subprocesses: a program that several tests (or a test's restarts) compile is compiled once.
# It starts empty, so CI times a cold cache.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="maxtext_rocm_test_xla_cache_")
    atexit.register(shutil.rmtree, os.environ["JAX_COMPILATION_CACHE_DIR"], ignore_errors=True)

import jax  # noqa: E402
import pytest  # noqa: E402

from maxtext_rocm import config as config_lib  # noqa: E402


def small_config(**overrides):
    """A model small enough to compile and step in a second or two, in fp32."""
    cfg = config_lib.load_preset("tiny_llama")
    cfg.model.update(vocab_size=128, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16,
                     mlp_dim=128, scan_layers=True)
    cfg.precision.policy = "fp32"
    cfg.data.source = "synthetic"
    cfg.train.update(steps=4, per_device_batch_size=1, seq_len=32)
    cfg.log.tensorboard = False
    for key, value in overrides.items():
        config_lib.set_key(cfg, key, value)
    return cfg


@pytest.fixture
def devices():
    assert jax.device_count() == 8, "tests expect 8 fake CPU devices"
    return jax.devices()
