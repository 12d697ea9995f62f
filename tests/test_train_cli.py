"""The command line end to end: a real run on 8 fake devices, and user errors exiting 2."""

import json
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMALL = ["--config.train.steps=6", "--config.log.every=3", "--config.train.seq_len=64",
         "--config.train.per_device_batch_size=1"]


def train(*args, cwd=REPO):
    return subprocess.run([sys.executable, "-m", "maxtext_rocm.train", *args], cwd=cwd,
                          capture_output=True, text=True, timeout=300)


def test_tiny_llama_trains_and_writes_its_run_directory(tmp_path):
    out = tmp_path / "run"
    result = train("configs/tiny_llama.py", *SMALL, f"--config.output_dir={out}")
    assert result.returncode == 0, result.stderr
    assert "mesh fsdp=8" in result.stdout
    assert "step 6/6 100%" in result.stdout

    record = json.loads((out / "config.json").read_text())
    assert record["config"]["train"]["steps"] == 6
    assert record["config"]["model"]["d_model"] == 256
    env = record["environment"]
    assert {"jax", "flax", "optax", "orbax-checkpoint"} <= set(env["versions"])
    assert env["device_count"] == 8 and env["device_kind"] == "cpu"
    assert env["mesh"]["fsdp"] == 8 and "git_commit" in env

    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [3, 6]
    assert set(rows[0]) == {"step", "loss", "lr", "grad_norm", "step_time_s", "tokens_per_s_per_device",
                            "real_tokens_per_s_per_device", "tflops_per_s_per_device", "mfu", "nonfinite_steps",
                            "padding_fraction", "goodput"}
    assert rows[0]["padding_fraction"] == 0.0  # the embedded corpus fills every row
    assert rows[0]["mfu"] is None  # no peak is known for a CPU
    assert all(r["loss"] > 0 and r["tokens_per_s_per_device"] > 0 for r in rows)
    assert list((out / "tensorboard").glob("events.out.tfevents*"))


def test_peak_override_gives_an_mfu(tmp_path):
    result = train("configs/tiny_llama.py", *SMALL, "--config.log.peak_tflops=1.0",
                   "--config.log.tensorboard=false", f"--config.output_dir={tmp_path}")
    assert result.returncode == 0, result.stderr
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["mfu"] == pytest.approx(rows[-1]["tflops_per_s_per_device"] / 1.0)


@pytest.mark.parametrize("args, message", [
    (["configs/tiny_llama.py", "--config.train.stpes=3"], "did you mean 'train.steps'"),
    (["configs/tiny_llama.py", "--config.optimizer.learning_rate=1e-3"], "did you mean 'optimizer.lr'?"),
    (["configs/tiny_llama.py", "--config.mesh.ici.fsdp=3"], "mesh.ici sizes (fsdp=3) multiply to 3 but there are 8"),
    (["configs/tiny_llama.py", "--config.mesh.ici.tensor=8", "--config.mesh.ici.fsdp=1"], "does not divide over"),
    (["configs/missing.py"], "does not exist"),
    ([], "usage:"),
])
def test_user_errors_exit_2_with_one_sentence(args, message):
    result = train(*args)
    assert result.returncode == 2
    assert message in result.stderr
    assert "Traceback" not in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


def test_unwritable_output_dir_exits_2_and_leaves_it_alone(tmp_path):
    blocker = tmp_path / "taken"
    blocker.write_text("precious")
    result = train("configs/tiny_llama.py", *SMALL, f"--config.output_dir={blocker}")
    assert result.returncode == 2, result.stderr
    assert "set output_dir to a writable directory" in result.stderr
    assert "Traceback" not in result.stderr
    assert blocker.read_text() == "precious"
