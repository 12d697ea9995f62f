"""The files source across real processes (issue 34 item 4): a 2-process run stopped and extended
trains on exactly the batches of the uninterrupted run, so its losses agree bit for bit; resuming
its checkpoint with another number of processes mid-epoch is one sentence.

2-process launches (2 x 4 fake CPU devices, gloo over loopback) take ~15 s each on an idle 2-core
machine (~50 s when it is shared); the later ones find the programs in the session's compilation
cache (conftest.py). The default test launches twice; the slow one three times and once in-process.
"""
import json
import subprocess
import sys

import numpy as np
import pytest

from maxtext_rocm.runtime import run_lock

from test_bad_inputs import assert_one_sentence, run_main
from test_distributed import REPO, SMALL, process_env, read_rows

TWO = ["--config.mesh.dcn.data=2", "--config.mesh.ici.fsdp=4"]


def corpus(path):
    """Documents from 3 to ~600 bytes: the two processes' positions drift apart at once."""
    rng = np.random.default_rng(11)
    words = ["alpha", "beta", "gamma", "delta", "eps", "zeta", "eta", "theta"]
    texts = [" ".join(rng.choice(words, int(rng.integers(1, 120) if i % 3 else rng.integers(1, 4))))
             for i in range(80)]
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    return path


def two_processes(tmp_path, logs, *args):
    result = subprocess.run(
        ["bash", "scripts/launch_local.sh", "2", "configs/tiny_llama.py:fp32", *args],
        cwd=REPO, env=process_env(LOG_DIR=str(tmp_path / logs), DEVICES="8", PYTHON=sys.executable),
        capture_output=True, text=True, timeout=240)
    log0 = (tmp_path / logs / "process_0.log").read_text()
    log1 = (tmp_path / logs / "process_1.log").read_text()
    assert result.returncode == 0, f"{result.stderr[-3000:]}\n--- process 1:\n{log1[-3000:]}"
    return log0


FILES = ["--config.model.vocab_size=512", "--config.data.source=files", "--config.optimizer.schedule=constant"]
SAVING = ["--config.checkpoint.enabled=true", "--config.checkpoint.async_save=false"]


def whole_run(tmp_path, data, *extra):
    """6 steps of 2 processes without a break, metrics rows returned. A constant learning rate after
    one warmup step: train.steps does not change a step's update, so shorter legs can match it."""
    two_processes(tmp_path, "logs_whole", *SMALL, *TWO, *FILES, f"--config.data.paths={data}", *extra,
                  "--config.train.steps=6", f"--config.output_dir={tmp_path}/whole")
    whole = read_rows(tmp_path / "whole" / "metrics.jsonl")
    assert [r["step"] for r in whole] == [1, 2, 3, 4, 5, 6]
    return whole


def assert_positions_of_both(checkpoint):
    saved = json.loads((checkpoint / "data" / "metadata").read_text())
    assert saved["shards"] == 2 and len(saved["positions"]) == 2
    assert saved["positions"][0] != saved["positions"][1]  # each process's own, not process 0's twice


def assert_bit_for_bit(rows, whole, steps):
    assert [r["step"] for r in rows] == steps
    want = {r["step"]: r for r in whole}
    for got in rows:
        assert (got["loss"], got["grad_norm"]) == (want[got["step"]]["loss"], want[got["step"]]["grad_norm"]), got
    assert rows[-1]["loss"] != pytest.approx(want[3]["loss"], abs=1e-3)  # the updates did something


def global_padding(data, steps, **data_keys):
    """Each step's share of positions without a token over both processes' rows (the global batch
    of 8 x 128), from the sources read in this process."""
    from test_data_files import source

    local = [[source(data, global_batch=8, seq_len=128, process_index=p, process_count=2, **data_keys).batch(s)
              for s in range(steps)] for p in range(2)]
    return [float(np.mean([local[p][s]["segment_ids"] == 0 for p in range(2)])) for s in range(steps)]


def test_two_processes_resumed_mid_run_train_like_the_uninterrupted_run(tmp_path):
    """The uninterrupted run saves step 3 while its prefetch thread is ahead; a new run resumed from
    that checkpoint trains steps 4-6 on the same batches: the same losses, bit for bit (the
    checkpoint used to keep process 0's position for both, and process 1 read other documents).
    Whole documents (data.packing=best_fit, windows of 4 documents, rows of 128): both processes'
    rows have padding, and every logged step reports the global batch's share of it."""
    data = corpus(tmp_path / "corpus.jsonl")
    best_fit = ["--config.data.packing=best_fit", "--config.data.packing_window=4", "--config.train.seq_len=128"]
    whole = whole_run(tmp_path, data, *SAVING, *best_fit, "--config.checkpoint.every=3")
    checkpoint = tmp_path / "whole" / "checkpoints" / "3"
    assert_positions_of_both(checkpoint)
    padding = global_padding(data, 6, packing="best_fit", packing_window=4)
    assert [r["padding_fraction"] for r in whole] == pytest.approx(padding, abs=1e-6) and min(padding) > 0
    log0 = two_processes(tmp_path, "logs_resumed", *SMALL, *TWO, *FILES, f"--config.data.paths={data}", *SAVING,
                         *best_fit, f"--config.checkpoint.resume={checkpoint}", "--config.train.steps=6",
                         f"--config.output_dir={tmp_path}/resumed")
    assert "resumed from" in log0
    assert_bit_for_bit(read_rows(tmp_path / "resumed" / "metrics.jsonl"), whole, [4, 5, 6])


@pytest.mark.slow  # three 2-process launches and a compilation in this process (~2-3 min on a shared machine)
def test_two_processes_stopped_and_extended_train_like_one_run(tmp_path, capsys):
    """Stop-and-extend in one output_dir: 3 steps, then (refused) one process, then 2 processes to 6."""
    data = corpus(tmp_path / "corpus.jsonl")
    files = [*FILES, f"--config.data.paths={data}"]
    whole = whole_run(tmp_path, data)
    run = tmp_path / "run"
    saving = [*SAVING, "--config.checkpoint.resume=auto", f"--config.output_dir={run}"]
    two_processes(tmp_path, "logs_first", *SMALL, *TWO, *files, *saving, "--config.train.steps=3")
    assert_positions_of_both(run / "checkpoints" / "3")

    # One process on the same 8 devices cannot take over the two positions mid-epoch: one sentence,
    # and the checkpoint stays as it was for the 2-process leg below.
    status, err = run_main(capsys, "configs/tiny_llama.py:fp32", *SMALL, *files, *saving, "--config.mesh.ici.data=2",
                           "--config.mesh.ici.fsdp=4", "--config.train.steps=6")
    assert_one_sentence(status, err, "checkpoint step 3 holds the data positions of 2 data-loading processes",
                        "this run loads data with 1", "data.allow_changed=true")
    # A Trainer that fails in its constructor keeps output_dir's lock while this process lives (a
    # command-line run's ends with it): free it for the next leg.
    run_lock.release(str(run))

    log0 = two_processes(tmp_path, "logs_last", *SMALL, *TWO, *files, *saving, "--config.train.steps=6")
    assert f"resumed from {run / 'checkpoints'}/3" in log0
    assert_bit_for_bit(read_rows(run / "metrics.jsonl"), whole, [1, 2, 3, 4, 5, 6])
