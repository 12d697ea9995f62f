"""Checkpoints: bit-exact resume after SIGKILL, SIGTERM/SIGINT, cross-mesh restore, bad
checkpoints, non-finite steps, and starting from another run's parameters."""

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest

from maxtext_rocm.checkpoint import restore_params
from maxtext_rocm.config import CheckpointError
from maxtext_rocm.train import Trainer, TrainingDiverged

from conftest import small_config

REPO = Path(__file__).resolve().parent.parent
# A small model on 2 of the 8 fake devices keeps each run to a few seconds.
SMALL = ["--config.model.vocab_size=128", "--config.model.d_model=64", "--config.model.n_layers=2",
         "--config.model.n_heads=4", "--config.model.n_kv_heads=2", "--config.model.head_dim=16",
         "--config.model.mlp_dim=128", "--config.model.scan_layers=true", "--config.data.source=synthetic",
         "--config.train.seq_len=32", "--config.train.per_device_batch_size=2", "--config.log.every=1",
         "--config.log.tensorboard=false", "--config.checkpoint.every=4", "--config.checkpoint.keep=2"]
ENV = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2")


def start(out, *extra, steps=12):
    return subprocess.Popen([sys.executable, "-m", "maxtext_rocm.train", "configs/tiny_llama.py", *SMALL,
                             f"--config.train.steps={steps}", f"--config.output_dir={out}", *extra],
                            cwd=REPO, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def finish(process, timeout=240):
    out, err = process.communicate(timeout=timeout)
    return process.returncode, out, err


def logged(out) -> dict[int, list[float]]:
    """step -> every loss logged for it (a resumed run logs some steps twice)."""
    rows = {}
    path = Path(out) / "metrics.jsonl"
    for line in path.read_text().splitlines() if path.exists() else []:
        row = json.loads(line)
        rows.setdefault(row["step"], []).append(row["loss"])
    return rows


def wait_for_step(out, step, process, timeout=120):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if max(logged(out), default=0) >= step:
            return
        assert process.poll() is None, process.communicate()
        time.sleep(0.05)
    raise AssertionError(f"step {step} never logged")


def final_params(out):
    cfg = small_config()
    from flax import linen as nn

    from maxtext_rocm.api import abstract_params
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    abstract = jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=device),
                                      nn.meta.unbox(abstract_params(cfg)))
    return jax.tree_util.tree_map(np.asarray, restore_params(out, abstract))


@pytest.mark.parametrize("policy, kill_at", [
    ("fp32", [6, 9]),
    # CI budget: a kill before the first save (a restart from scratch) and bf16 run with -m slow.
    pytest.param("fp32", [2, 6, 9], marks=pytest.mark.slow),
    pytest.param("bf16", [5], marks=pytest.mark.slow),
])
def test_resume_after_sigkill_is_bit_exact(policy, kill_at, tmp_path):
    """Killed at each step of `kill_at` in turn (before the first save, just after one, between
    two), restarted each time, the run logs the same losses and ends with the same parameters."""
    reference = tmp_path / "reference"
    code, _, err = finish(start(reference, f"--config.precision.policy={policy}"))
    assert code == 0, err
    want = logged(reference)

    run = tmp_path / "killed"
    for kill in kill_at:
        process = start(run, f"--config.precision.policy={policy}")
        wait_for_step(run, kill, process)
        process.send_signal(signal.SIGKILL)
        process.wait()
    code, out, err = finish(start(run, f"--config.precision.policy={policy}"))
    assert code == 0, err
    got = logged(run)
    assert sorted(got) == sorted(want)
    for step, losses in got.items():  # steps redone after a resume are logged again: all must agree
        assert all(loss == want[step][0] for loss in losses), (step, losses, want[step])
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(final_params(run)),
                            jax.tree_util.tree_leaves(final_params(reference))):
        assert np.array_equal(a, b), jax.tree_util.keystr(path)


def test_half_written_checkpoint_is_never_picked(tmp_path):
    run = tmp_path / "run"
    code, _, err = finish(start(run, steps=8))
    assert code == 0, err
    # What a process killed in the middle of writing step 12 leaves: orbax's temporary directory.
    partial = run / "checkpoints" / "12.orbax-checkpoint-tmp-1234567890"
    partial.mkdir()
    (partial / "state").mkdir()
    code, out, err = finish(start(run, steps=12))
    assert code == 0, err
    assert "resumed from" in out and out.split("resumed from")[1].split()[0].endswith("/8")


@pytest.mark.parametrize("sig, code", [(signal.SIGTERM, 0), (signal.SIGINT, 130)])
def test_signal_checkpoints_the_current_step_and_exits(sig, code, tmp_path):
    run = tmp_path / "run"
    process = start(run, steps=10_000)
    wait_for_step(run, 6, process)
    process.send_signal(sig)
    returncode, _, err = finish(process)
    assert returncode == code, err
    last_logged = max(logged(run))
    saved = sorted(int(p.name) for p in (run / "checkpoints").iterdir() if p.name.isdigit())
    assert saved[-1] == last_logged, (saved, last_logged)
    assert f"stopped by signal {int(sig)}" in err


def test_restore_onto_a_different_mesh(devices, tmp_path):
    eight = small_config(**{"mesh.ici.fsdp": 8, "output_dir": str(tmp_path), "checkpoint.every": 2,
                            "train.per_device_batch_size": 1})
    trainer = Trainer(eight, devices=devices, log=lambda *_: None)
    trainer.run(2)
    saved = jax.tree_util.tree_map(np.asarray, trainer.state.params)
    next_loss_8 = float(trainer.step()["loss"])

    four = small_config(**{"mesh.ici.fsdp": 2, "mesh.ici.tensor": 2, "output_dir": str(tmp_path),
                           "train.per_device_batch_size": 2})
    resumed = Trainer(four, devices=devices[:4], log=lambda *_: None)
    assert resumed.step_count == 2 and resumed.global_batch == trainer.global_batch
    assert resumed.state.params["lm_head"]["kernel"].sharding.mesh.shape["tensor"] == 2
    for a, b in zip(jax.tree_util.tree_leaves(resumed.state.params), jax.tree_util.tree_leaves(saved)):
        assert np.array_equal(np.asarray(a), b)
    assert float(resumed.step()["loss"]) == pytest.approx(next_loss_8, rel=1e-5)


def snapshot(folder):
    """Every file's size and mtime, except run.lock, whose text names the last process that held
    the directory's lock (maxtext_rocm/runtime/run_lock.py) and so changes with every launch."""
    return {str(p): (p.stat().st_size, p.stat().st_mtime_ns) for p in Path(folder).rglob("*")
            if p.name != "run.lock"}


def test_mismatched_and_corrupt_checkpoints_exit_2_and_touch_nothing(tmp_path):
    run = tmp_path / "run"
    code, _, err = finish(start(run, steps=4))
    assert code == 0, err
    before = snapshot(run)

    code, _, err = finish(start(run, "--config.model.mlp_dim=96", steps=8))
    assert code == 2
    assert "does not fit this model: params.layers.mlp.down.kernel has shape (2, 128, 64) there but (2, 96, 64)" in err
    assert "Traceback" not in err and snapshot(run) == before

    # Truncate the array data of the newest checkpoint.
    data_files = [p for p in (run / "checkpoints" / "4" / "state").rglob("*") if p.is_file() and "/d/" in str(p)]
    assert data_files
    for path in data_files:
        path.write_bytes(path.read_bytes()[:7])
    before = snapshot(run)
    code, _, err = finish(start(run, steps=8))
    assert code == 2
    assert f"no checkpoint in {run / 'checkpoints'} is intact (4: cannot be read" in err
    assert "Traceback" not in err and snapshot(run) == before


def inject_nan_at(trainer, bad_step):
    batch = trainer.data.batch

    def poisoned(step):
        host = batch(step)
        if step == bad_step:
            host["weights"] = np.full_like(host["weights"], np.nan)
        return host
    trainer.data.batch = poisoned


def test_nonfinite_skip_drops_only_the_bad_update(devices, tmp_path):
    cfg = small_config(**{"output_dir": str(tmp_path), "train.steps": 5, "log.every": 1})
    trainer = Trainer(cfg, devices=devices[:2], log=lambda *_: None)
    inject_nan_at(trainer, 2)
    trainer.run()
    assert int(trainer.state.step) == 5 and int(trainer.state.nonfinite_steps) == 1
    assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree_util.tree_leaves(trainer.state))
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["nonfinite_steps"] for r in rows] == [0, 0, 1, 1, 1]


def test_nonfinite_stop_keeps_and_saves_the_last_good_state(devices, tmp_path):
    cfg = small_config(**{"output_dir": str(tmp_path), "train.steps": 6, "log.every": 1,
                          "train.on_nonfinite": "stop", "checkpoint.every": 0})
    trainer = Trainer(cfg, devices=devices[:2], log=lambda *_: None)
    trainer.run(2)
    good = jax.tree_util.tree_map(np.asarray, trainer.state.params)
    inject_nan_at(trainer, 2)
    with pytest.raises(TrainingDiverged, match="after step 2; checkpoint 2 holds the last good state"):
        trainer.run()
    assert int(trainer.state.step) == 2
    for a, b in zip(jax.tree_util.tree_leaves(trainer.state.params), jax.tree_util.tree_leaves(good)):
        assert np.array_equal(np.asarray(a), b)
    assert (tmp_path / "checkpoints" / "2").is_dir()


def test_start_from_another_runs_params_and_from_an_export(devices, tmp_path):
    first = small_config(**{"output_dir": str(tmp_path / "first"), "train.steps": 3})
    trainer = Trainer(first, devices=devices[:2], log=lambda *_: None)
    trainer.run()
    trained = jax.tree_util.tree_map(np.asarray, trainer.state.params)

    export = tmp_path / "export"
    result = subprocess.run([sys.executable, "-m", "maxtext_rocm.checkpoint", "export", str(tmp_path / "first"),
                             str(export)], cwd=REPO, env=ENV, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert (export / "params").is_dir() and (export / "config.json").is_file()

    for source in (tmp_path / "first", export):
        second = small_config(**{"output_dir": str(tmp_path / f"from_{source.name}"),
                                 "checkpoint.load_params_from": str(source)})
        fine_tune = Trainer(second, devices=devices[:2], log=lambda *_: None)
        assert fine_tune.step_count == 0 and int(fine_tune.state.step) == 0
        for a, b in zip(jax.tree_util.tree_leaves(fine_tune.state.params), jax.tree_util.tree_leaves(trained)):
            assert np.array_equal(np.asarray(a), b)
        mu = fine_tune.state.opt_state[1][0].mu
        assert all(not np.asarray(x).any() for x in jax.tree_util.tree_leaves(mu)), "optimizer must start fresh"

    with pytest.raises(CheckpointError, match="holds no params export or checkpoint"):
        restore_params(tmp_path, trainer.state.params)


def test_resume_never_refuses_to_write_over_existing_checkpoints(devices, tmp_path):
    cfg = small_config(**{"output_dir": str(tmp_path), "train.steps": 2, "checkpoint.every": 2})
    Trainer(cfg, devices=devices[:2], log=lambda *_: None).run()
    before = snapshot(tmp_path)
    again = small_config(**{"output_dir": str(tmp_path), "train.steps": 2, "checkpoint.resume": "never"})
    with pytest.raises(CheckpointError, match="checkpoint.resume=never but .* already holds checkpoints \\(steps 2\\)") as raised:
        Trainer(again, devices=devices[:2], log=lambda *_: None)
    assert not re.search("delete|remove", str(raised.value)), raised.value  # they are intact (issue 34)
    assert snapshot(tmp_path) == before
