"""Issue 47: goodput. The accounting of hand-made timelines against figures worked out by hand; a run
killed twice accounts for its wall time (measured from outside) within 2%, and its lost work is the
steps it recomputed times their step time; the command line's --json fields and its refusals."""

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from maxtext_rocm.reporting.goodput import CAUSES, account
from test_checkpoint import REPO, finish, logged, start, wait_for_step

TIERS = ["--config.checkpoint.every=10", "--config.checkpoint.local_every=2", "--config.checkpoint.local_keep=2"]


def span(launch, event, t0, t1, **fields):
    return {"launch": launch, "event": event, "t0": t0, "t1": t1, **fields}


def test_accounting_of_two_launches_worked_by_hand():
    spans = [  # launch 0: starts at 0, trains steps 1..6 and is killed after its record at t=19
        span(0, "startup", 0, 3), span(0, "distributed_init", 1, 2), span(0, "build", 3, 4),
        span(0, "launch", 4, 9, restore_s=0.0), span(0, "first_step", 9, 12, first=0, last=1),
        span(0, "steps", 12, 17, first=1, last=6), span(0, "checkpoint", 17, 18, step=6, tier="local"),
        span(0, "steps", 18, 19, first=6, last=7),
        # launch 1: starts at 25, restores step 4 from the local tier in 1 s of a 4 s launch, redoes 5..7
        span(1, "startup", 25, 27), span(1, "build", 27, 28), span(1, "launch", 28, 32, restore_s=1.0),
        span(1, "first_step", 32, 35, first=4, last=5), span(1, "steps", 35, 40, first=5, last=10),
        span(1, "eval", 40, 42, step=10), span(1, "checkpoint", 42, 44, step=10, tier="persistent"),
        span(1, "end", 44.5, 44.5)]
    got = account(spans)
    assert got.step_time_s == 1.0  # the median of 1 s per step (both steps spans)
    assert got.wall_s == 44.5 and got.restarts == 1
    # Productive: launch 0: steps 1 (1 s of its first-step span), 2..7; launch 1: steps 8..10 (3 s).
    # Recomputed: launch 1's steps 5 (its first step's 1 s), 6, 7.
    assert got.recomputed_steps == 3 and got.badput["recomputed"] == 3.0
    assert got.productive_s == 7.0 + 3.0
    want = {"startup": 2 + 1 + 2 + 1, "distributed_init": 1, "compile": 5 + 2 + 3 + 2, "restore": 1,
            "checkpoint_local": 1, "checkpoint_persistent": 2, "eval": 2, "recomputed": 3,
            "between_launches": 25 - 19, "other": 0.5}
    assert {c: got.badput[c] for c in CAUSES} == pytest.approx(want)
    assert got.productive_s + sum(got.badput.values()) == pytest.approx(got.wall_s)
    assert [launch.wall_s for launch in got.launches] == [25, 19.5]


def test_the_command_refuses_a_directory_without_a_timeline_in_one_sentence(tmp_path):
    result = subprocess.run([sys.executable, "-m", "maxtext_rocm.goodput", str(tmp_path)], cwd=REPO,
                            capture_output=True, text=True)
    assert result.returncode == 2 and "holds no timeline" in result.stderr and "Traceback" not in result.stderr
    result = subprocess.run([sys.executable, "-m", "maxtext_rocm.goodput", str(tmp_path / "absent"), "--json"],
                            cwd=REPO, capture_output=True, text=True)
    assert result.returncode == 2 and "is not a directory" in result.stderr


@pytest.mark.slow
def test_a_run_killed_twice_accounts_for_its_wall_time(tmp_path):
    run, local = tmp_path / "run", tmp_path / "local"
    args = [*TIERS, f"--config.checkpoint.local_dir={local}"]
    began = time.time()
    for kill_at in (5, 13):
        process = start(run, *args, steps=16)
        wait_for_step(run, kill_at, process)
        process.send_signal(signal.SIGKILL)
        process.wait()
    final = start(run, *args, steps=16)
    for line in final.stdout:  # the wall time ends at the run's last line: the interpreter's teardown
        if line.startswith("run tiny_llama done"):  # after the last record (0.8 s here) is outside the account
            wall = time.time() - began
            break
    code, _, err = finish(final)
    assert code == 0, err
    result = subprocess.run([sys.executable, "-m", "maxtext_rocm.goodput", str(run), "--json"], cwd=REPO,
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert set(report) >= {"goodput", "wall_s", "productive_s", "badput", "restarts"}
    assert report["restarts"] == 2
    assert abs(report["wall_s"] - wall) <= 0.02 * wall, (report["wall_s"], wall)
    assert report["productive_s"] + sum(report["badput"].values()) == pytest.approx(report["wall_s"])
    assert report["badput"]["other"] <= 0.02 * report["wall_s"], report["badput"]
    assert report["goodput"] == pytest.approx(report["productive_s"] / report["wall_s"])
    # The steps logged twice are the steps recomputed (give or take the one step per kill whose
    # timeline record was appended just before the kill took its metrics row, or the other way
    # round); their time again is the lost work.
    redone = sum(len(losses) - 1 for losses in logged(run).values())
    recomputed = report["recomputed_steps"]
    assert redone > 0 and redone - 2 <= recomputed <= redone + 2, (recomputed, redone)
    assert report["badput"]["recomputed"] == pytest.approx(recomputed * report["step_time_s"], rel=0.5)
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert all(0 <= row["goodput"] <= 1 for row in rows)
    text = subprocess.run([sys.executable, "-m", "maxtext_rocm.goodput", str(run)], cwd=REPO, capture_output=True,
                          text=True).stdout
    assert "3 launches, 2 restarts" in text and f"{recomputed} steps recomputed" in text


def test_a_timeline_that_cannot_be_written_is_one_warning_not_a_stopped_run(tmp_path, capsys):
    from maxtext_rocm.reporting.timeline import Timeline

    blocked = tmp_path / "a_file"
    blocked.write_text("")  # output_dir/goodput cannot be made under a file
    timeline = Timeline(str(blocked), time.time())
    timeline.launched(time.time(), 0.0, 0, "", 0)
    timeline.first_step(1)
    timeline.steps_until(3)
    err = capsys.readouterr().err
    assert err.count("warning: the goodput timeline") == 1 and "is not recorded" in err
