"""docs/logging.md's table of metrics.jsonl fields is what runs write: a language-model run and a DPO
run (each with an evaluation) write exactly the fields the table gives their rows, the z-loss and
MoE rows (from the row builder) theirs, and the table lists no field that nothing writes. The real
tokens per second are the positions per second less the padding of the steps timed."""

import json
import re
from pathlib import Path

import pytest

from chat_helpers import make_chat_tokenizer, write_jsonl
from conftest import small_config
from maxtext_rocm.reporting import metrics, run_report

DOC = Path(__file__).resolve().parents[1] / "docs" / "logging.md"


def documented() -> dict[str, str]:
    """field -> its "written" cell, from the table under "The fields of metrics.jsonl"."""
    section = DOC.read_text().split("## The fields of metrics.jsonl", 1)[1]
    rows = re.findall(r"^\| `(\w+)` \|.*\| ([^|]+) \|$", section, re.M)
    assert rows, "docs/logging.md has no table of metrics.jsonl fields"
    return {field: written.strip() for field, written in rows}


def fields_written_when(*conditions: str) -> set[str]:
    return {field for field, written in documented().items() if written in conditions}


def rows_of(output_dir: Path) -> tuple[list[dict], list[dict]]:
    """(training rows, evaluation rows) of a run's metrics.jsonl."""
    rows = [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if "eval_loss" not in r], [r for r in rows if "eval_loss" in r]


def run(cfg, devices):
    from maxtext_rocm.trainer.trainer import Trainer

    trainer = Trainer(cfg, devices, log=lambda *_: None)
    try:
        trainer.run()
    finally:
        trainer.close()


RUN = {"train.steps": 3, "log.every": 1, "train.eval_every": 3, "train.eval_steps": 1, "checkpoint.enabled": False}


def test_a_language_model_run_writes_the_documented_fields(tmp_path, devices):
    run(small_config(**RUN, output_dir=str(tmp_path)), devices)
    train, evaluation = rows_of(tmp_path)
    assert len(train) == 3 and len(evaluation) == 1
    assert all(set(row) == fields_written_when("every row") for row in train)
    assert set(evaluation[0]) == {"step"} | fields_written_when("evaluation rows", "evaluation rows, objective lm")
    # No padding in synthetic rows: every position is a real token.
    assert all(r["real_tokens_per_s_per_device"] == r["tokens_per_s_per_device"] for r in train[1:])


def test_a_dpo_run_writes_the_documented_fields(tmp_path, devices):
    pytest.importorskip("tokenizers")
    tok = make_chat_tokenizer(tmp_path / "tok")
    pairs = write_jsonl(tmp_path / "pairs.jsonl", [{"prompt": "what is two plus two?", "chosen": "four",
                                                    "rejected": f"the lazy dog {i}"} for i in range(16)])
    cfg = small_config(**RUN, output_dir=str(tmp_path / "run"), **{
        "data.source": "files", "data.format": "preference", "data.paths": str(pairs),
        "data.eval_paths": str(pairs), "data.tokenizer": str(tok / "tokenizer.json"), "model.vocab_size": 320,
        "train.objective": "dpo", "train.per_device_batch_size": 2})
    run(cfg, devices)
    train, evaluation = rows_of(tmp_path / "run")
    assert all(set(row) == fields_written_when("every row", "`train.objective='dpo'`") for row in train)
    assert set(evaluation[0]) == {"step"} | fields_written_when("evaluation rows", "evaluation rows, objective dpo")
    # Every row is one pair's short prompt and response in train.seq_len=32 positions: mostly padding.
    for row in train[1:]:
        assert row["real_tokens_per_s_per_device"] < 0.8 * row["tokens_per_s_per_device"]


def test_a_grpo_run_writes_the_documented_fields(tmp_path, devices):
    prompts = write_jsonl(tmp_path / "prompts.jsonl", [{"prompt": f"Q{i}:", "answer": "7"} for i in range(8)])
    cfg = small_config(**{**RUN, "train.eval_every": 0}, output_dir=str(tmp_path / "run"), **{
        "data.source": "files", "data.format": "prompt", "data.paths": str(prompts), "model.vocab_size": 320,
        "train.objective": "grpo", "grpo.group_size": 4, "grpo.max_new_tokens": 4, "grpo.rewards": ("answer", "length")})
    run(cfg, devices)
    train, _ = rows_of(tmp_path / "run")
    per_reward = {f"grpo_reward{kind}/{name}" for kind in ("", "_std") for name in ("answer", "length")}
    assert all(set(row) == fields_written_when("every row", "`train.objective='grpo'`") | per_reward for row in train)
    assert "| `grpo_reward/NAME`, `grpo_reward_std/NAME` |" in DOC.read_text()


FETCHED = {"loss": 2.0, "lr": 1e-3, "grad_norm": 1.0, "nonfinite_steps": 0, "padding": 0.5, "z_loss": 3.0,
           "moe_aux_loss": 1.0, "moe_z_loss": 0.1}


def test_z_loss_and_moe_rows_and_that_the_table_lists_nothing_else():
    cfg = small_config(**{"train.z_loss_weight": 1e-4, "model.n_experts": 4, "model.experts_per_token": 2})
    row = run_report.logged_row(cfg, FETCHED, 0.5, global_batch=8, n_devices=8, flops_per_token=1e6,
                                peak_tflops=None)
    assert set(row) | {"step"} == fields_written_when("every row", "`train.z_loss_weight` > 0",
                                                      "`model.n_experts` > 1")
    conditions = {"every row", "`train.z_loss_weight` > 0", "`model.n_experts` > 1", "`train.objective='dpo'`",
                  "`train.objective='grpo'`",
                  "evaluation rows", "evaluation rows, objective lm", "evaluation rows, objective dpo"}
    assert set(documented().values()) == conditions  # each field is written under one of the cases above


def test_real_tokens_are_the_positions_less_the_padding_of_the_timed_steps():
    """32 positions per row x 8 rows / 0.5 s / 8 devices = 64 positions/s; the timed steps were a
    quarter padding on average (the logged step alone: half), so 48 real tokens/s; MFU and TFLOP/s
    count every position computed."""
    cfg = small_config()
    row = run_report.logged_row(cfg, FETCHED, 0.5, global_batch=8, n_devices=8, flops_per_token=1e9,
                                peak_tflops=1.0, timed_padding=0.25)
    assert row["tokens_per_s_per_device"] == 64.0 and row["real_tokens_per_s_per_device"] == 48.0
    assert row["tflops_per_s_per_device"] == pytest.approx(64e9 / 1e12) and row["mfu"] == pytest.approx(0.064)
    assert row["padding_fraction"] == 0.5
    alone = run_report.logged_row(cfg, FETCHED, 0.5, global_batch=8, n_devices=8, flops_per_token=1e9,
                                  peak_tflops=None)
    assert alone["real_tokens_per_s_per_device"] == 32.0
    assert "64 tok/s/dev (48 real)" in metrics.format_line(3, 10, row)


def test_under_buckets_the_tflops_count_each_steps_rows_at_their_own_length():
    """Timed steps of rows 16, 16 and 32 long (seq_len 32): the FLOPs are each step's positions
    times the FLOPs per token at its own row length (train_flops_per_token), summed, over the time."""
    cfg = small_config()
    assert cfg.train.seq_len == 32
    lengths, step_time, batch, devices = [16, 16, 32], 0.5, 8, 8
    flops = sum(batch * length * metrics.train_flops_per_token(cfg.model, length) for length in lengths)
    want_tflops = flops / (len(lengths) * step_time) / devices / 1e12
    row = run_report.logged_row(cfg, FETCHED, step_time, global_batch=batch, n_devices=devices,
                                flops_per_token=metrics.train_flops_per_token(cfg.model, 32), peak_tflops=None,
                                timed_row_lengths=lengths)
    assert row["tokens_per_s_per_device"] == pytest.approx(batch * sum(lengths) / len(lengths) / step_time / devices)
    assert row["tflops_per_s_per_device"] == pytest.approx(want_tflops, rel=1e-12)
    at_seq_len = metrics.train_flops_per_token(cfg.model, 32) * row["tokens_per_s_per_device"] / 1e12
    assert row["tflops_per_s_per_device"] < at_seq_len  # the short rows' attention did less
