"""What a run says at its end and at its start, through `python -m maxtext_rocm.train`: the summary
(losses, token positions, wall time, the checkpoint and the command that exports it, which is run
here), a finished run relaunched, a warmup the run never finishes, the LoRA + DPO banner."""

import json
import os
import shlex
import subprocess
import sys

import pytest

from maxtext_rocm import config as config_lib
from maxtext_rocm.reporting import run_report, run_summary

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = ["--config.train.steps=3", "--config.train.seq_len=32", "--config.train.per_device_batch_size=1",
        "--config.model.n_layers=2", "--config.model.d_model=64", "--config.model.head_dim=16",
        "--config.model.mlp_dim=128", "--config.log.tensorboard=false", "--config.log.every=1"]


def run(module, *args):
    return subprocess.run([sys.executable, "-m", module, *args], cwd=REPO, capture_output=True, text=True,
                          timeout=300)


def test_a_run_ends_with_its_summary_and_a_relaunch_says_it_is_done(tmp_path):
    out = tmp_path / "run"
    first = run("maxtext_rocm.train", "configs/tiny_llama.py", *TINY, "--config.optimizer.warmup_steps=1",
                "--config.train.eval_every=3", "--config.train.eval_steps=1", f"--config.output_dir={out}")
    assert first.returncode == 0, first.stderr
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    loss = next(r["loss"] for r in reversed(rows) if "loss" in r and r["step"] == 3)
    eval_loss = next(r["eval_loss"] for r in rows if "eval_loss" in r)
    summary = first.stdout[first.stdout.index("run tiny_llama done"):].splitlines()
    assert summary[0].startswith("run tiny_llama done at step 3 of 3, ")
    assert f"loss {loss:.4f} (step 3), eval loss {eval_loss:.4f} (step 3)" in summary[0]
    assert summary[1] == "  this launch: 3 steps, 768 token positions (steps x global batch x train.seq_len)"  # 3 x 8 x 32
    assert summary[2] == f"  checkpoint: {out}/checkpoints/3"
    assert "warning: optimizer.warmup_steps" not in first.stdout  # a warmup of 1 step in 3 is finished

    export = summary[3].removeprefix("  export: ")
    exported = run(*shlex.split(export)[2:])  # the command as printed: python -m maxtext_rocm.convert ...
    assert exported.returncode == 0, exported.stderr
    assert (tmp_path / "run-hf" / "config.json").is_file()

    again = run("maxtext_rocm.train", "configs/tiny_llama.py", *TINY, "--config.optimizer.warmup_steps=1",
                f"--config.output_dir={out}")
    assert again.returncode == 0, again.stderr
    assert again.stdout.strip().splitlines()[-1] == (
        f"{out} is already trained to step 3 (train.steps=3); nothing to train: raise train.steps to continue it, "
        "or give another output_dir for a new run")
    assert "devices:" not in again.stdout and "run tiny_llama done" not in again.stdout  # no header, no summary
    assert len((out / "metrics.jsonl").read_text().splitlines()) == len(rows)  # nothing written


def test_a_warmup_the_run_never_finishes_is_said_at_start(tmp_path):
    result = run("maxtext_rocm.train", "configs/tiny_llama.py", *TINY, "--config.optimizer.warmup_steps=100",
                 "--config.checkpoint.enabled=false", f"--config.output_dir={tmp_path / 'run'}")
    assert result.returncode == 0, result.stderr
    warnings = [line for line in result.stdout.splitlines() if line.startswith("warning: optimizer.warmup_steps")]
    assert warnings == [
        "warning: optimizer.warmup_steps=100 is not below train.steps=3: the warmup is cut to the run's 3 steps, so "
        "the learning rate rises for the whole run to 0.00133 at the last step, never reaching optimizer.lr=0.002, "
        "and the cosine decay never starts; set optimizer.warmup_steps below 3 to reach it"]
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["lr"] == pytest.approx(2e-3 * 2 / 3)  # the warning's figure is the rate the run logs
    assert "  checkpoint: none (checkpoint.enabled=false)" in result.stdout


@pytest.mark.parametrize("warmup, steps, warns", [(2, 3, False), (3, 3, True), (100, 60, True)])
def test_warmup_warning_exactly_where_the_rate_never_reaches_lr(warmup, steps, warns):
    cfg = config_lib.load("tiny_llama", {"optimizer.warmup_steps": warmup, "train.steps": steps})
    assert (run_report.warmup_warning(cfg) is not None) == warns


def test_lora_dpo_banner_names_the_base_as_the_reference():
    full = config_lib.load("tiny_llama", {"train.objective": "dpo"})
    assert "reference: frozen copy of the starting parameters" in run_report.objective_description(full)
    lora = config_lib.load("tiny_llama", {"train.objective": "dpo", "lora.rank": 4})
    described = run_report.objective_description(lora)
    assert "reference: the frozen base without its adapters" in described and "copy" not in described


def test_a_lora_summary_names_both_exports():
    summary = run_summary.RunSummary(
        name="r", output_dir="runs/my run", step=5, total_steps=10, launch_steps=5, token_positions=640,
        wall_s=75.0, loss=0.5, loss_step=5, objective="dpo", eval_loss=None, eval_step=None,
        checkpoint="runs/my run/checkpoints/5", checkpoints_enabled=True, lora=True, stopped_by_signal=15)
    text = run_summary.format_summary(summary)
    assert text.startswith("run r stopped by signal 15 at step 5 of 10, 1 min 15 s wall time: dpo loss 0.5000 (step 5)")
    assert ("export: python -m maxtext_rocm.convert to-hf 'runs/my run' 'runs/my run-hf'   # the merged model; "
            "add --adapter for the PEFT adapter alone") in text
    assert run_summary.export_command("runs/x/", lora=False) == "python -m maxtext_rocm.convert to-hf runs/x runs/x-hf"


def test_a_finished_run_relaunched_compiles_no_step_until_one_runs(devices, tmp_path):
    """The relaunch that only says "already trained" does not pay for compiling the step (minutes
    for an 8B model); a caller that trains on past train.steps (a notebook's run(n)) still can."""
    from conftest import small_config
    from maxtext_rocm.trainer.launch import CompiledOnFirstUse
    from maxtext_rocm.train import Trainer

    cfg = small_config(**{"train.steps": 1, "mesh.ici.fsdp": 1, "output_dir": str(tmp_path / "run"),
                          "checkpoint.async_save": False})
    first = Trainer(cfg, devices=devices[:1], log=lambda *_: None)
    first.run()
    first.close()
    again = Trainer(cfg, devices=devices[:1], log=lambda *_: None)
    try:
        assert again.is_finished() and isinstance(again._compiled_step, CompiledOnFirstUse)
        assert not again._compiled_step.done()
        again.run(1)  # one step past train.steps: compiled now, and it trains
        assert again.step_count == 2 and again._compiled_step is not None
    finally:
        again.close()
