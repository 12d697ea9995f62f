"""GRPO across two real processes (jax.distributed over loopback, 2 x 4 fake CPU devices): each
process samples its rows, both gather every completion and score them alike, and the run trains
as one process with the same mesh does, step for step."""
import json
import subprocess
import sys

import pytest

from test_distributed import REPO, SMALL, process_env, read_rows

GRPO = ["--config.model.vocab_size=512", "--config.data.source=files", "--config.data.format=prompt",
        "--config.train.objective=grpo", "--config.grpo.rewards=format", "--config.grpo.format_pattern=[0-9].*",
        "--config.grpo.group_size=4", "--config.grpo.max_new_tokens=4", "--config.train.per_device_batch_size=2",
        "--config.train.steps=4", "--config.optimizer.lr=3e-3"]


@pytest.mark.slow  # a 2-process launch and a one-process run: ~45 s on a shared 2-core machine
def test_two_processes_sample_score_and_train_as_one(tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"Q{i}: a digit. A:"}) + "\n" for i in range(16)))
    common = [*SMALL, *GRPO, f"--config.data.paths={prompts}"]
    two = subprocess.run(
        ["bash", "scripts/launch_local.sh", "2", "configs/tiny_llama.py:fp32", *common, "--config.mesh.dcn.data=2",
         "--config.mesh.ici.fsdp=4", f"--config.output_dir={tmp_path}/two"],
        cwd=REPO, env=process_env(LOG_DIR=str(tmp_path / "logs"), DEVICES="8", PYTHON=sys.executable),
        capture_output=True, text=True, timeout=300)
    assert two.returncode == 0, two.stderr[-3000:] + (tmp_path / "logs" / "process_1.log").read_text()[-3000:]
    one = subprocess.run(
        [sys.executable, "-m", "maxtext_rocm.train", "configs/tiny_llama.py:fp32", *common, "--config.mesh.ici.data=2",
         "--config.mesh.ici.fsdp=4", f"--config.output_dir={tmp_path}/one"],
        cwd=REPO, env=process_env(XLA_FLAGS="--xla_force_host_platform_device_count=8 "
                                            "--xla_backend_optimization_level=0"),
        capture_output=True, text=True, timeout=300)
    assert one.returncode == 0, one.stderr[-3000:]
    keys = ("grpo_reward", "grpo_zero_signal", "grpo_completion_length")
    two_rows, one_rows = read_rows(tmp_path / "two" / "metrics.jsonl"), read_rows(tmp_path / "one" / "metrics.jsonl")
    assert [r["step"] for r in two_rows] == [1, 2, 3, 4]
    for got, want in zip(two_rows, one_rows):
        assert {k: got[k] for k in keys} == {k: want[k] for k in keys}
        assert abs(got["loss"] - want["loss"]) <= 1e-5 and abs(got["grad_norm"] - want["grad_norm"]) <= 1e-4 * (
            1 + want["grad_norm"])
