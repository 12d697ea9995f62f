"""Signals during start-up and the hang watchdog (issue 24, finding 10 and "a hang watchdog").

The process tests start real trainers; a wrapper (`python -c`) patches one Trainer method to
print a marker or to stall, so each test knows where the process is instead of guessing by time.
"""

import os
import signal
import subprocess
import sys
import time

import pytest

from maxtext_rocm.runtime.watchdog import HANG_EXIT_STATUS, HangWatchdog

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMALL = ["--config.model.d_model=64", "--config.model.n_layers=2", "--config.model.n_heads=4",
         "--config.model.n_kv_heads=2", "--config.model.head_dim=16", "--config.model.mlp_dim=128",
         "--config.precision.policy=fp32", "--config.train.seq_len=32", "--config.train.per_device_batch_size=1",
         "--config.log.every=1", "--config.log.tensorboard=false"]


def wrapped(patch: str, args: list[str]) -> subprocess.Popen:
    """`train.main(args)` in a fresh interpreter after `patch` (Python run with `train` imported)."""
    code = f"import sys, time\nfrom maxtext_rocm import train\n{patch}\nsys.exit(train.main({args!r}))\n"
    return subprocess.Popen([sys.executable, "-c", code], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def wrap(target: str, before: str = "", after: str = "") -> str:
    """A patch for `wrapped`: `target` (a function reached from `train` or `launch`) replaced by one
    that runs the statement `before`, calls the original with the same `args`, then runs `after`."""
    return (f"from maxtext_rocm.trainer import launch\noriginal = {target}\n"
            f"def wrapper(*args):\n    {before or 'pass'}\n    out = original(*args)\n"
            f"    {after or 'pass'}\n    return out\n{target} = wrapper\n")


def wait_for_line(process: subprocess.Popen, marker: str, timeout: float = 240) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = process.stdout.readline()
        if marker in line:
            return
        if not line and process.poll() is not None:
            raise AssertionError(f"exited {process.returncode} before {marker!r}: {process.stderr.read()}")
    raise AssertionError(f"no {marker!r} within {timeout} s")


def wait_until_armed(pid: int, timeout: float = 30) -> None:
    """Until the process catches SIGTERM (the start-up handlers are armed, jax not yet imported):
    Python catches SIGINT from the start, SIGTERM only once armed. A fixed sleep instead raced a
    warm machine's imports, and the run directory existed when the signal came (a local CI run,
    2026-12-02)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with open(f"/proc/{pid}/status") as status:
            caught = int(next(line for line in status if line.startswith("SigCgt:")).split()[1], 16)
        if caught >> (signal.SIGTERM - 1) & 1:
            # startup_signals.arm sets SIGTERM's handler, then SIGINT's, then starts its thread:
            # microseconds, against the imports' hundreds of milliseconds that follow
            time.sleep(0.05)
            return
        time.sleep(0.002)
    raise AssertionError(f"the start-up signal handlers were not armed within {timeout} s")


# ----------------------------------------------------------------------------------------------
# Signals before the training loop


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_during_the_imports_exits_with_one_line(tmp_path, sig):
    process = subprocess.Popen([sys.executable, "-m", "maxtext_rocm.train", "configs/tiny_llama.py", *SMALL,
                                f"--config.output_dir={tmp_path / 'run'}"], cwd=REPO,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    wait_until_armed(process.pid)  # maxtext_rocm/__init__.py arms the start-up handlers before jax loads
    process.send_signal(sig)
    out, err = process.communicate(timeout=30)
    assert process.returncode == 128 + sig, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and f"stopped by {sig.name} during start-up" in lines[0], err
    assert not (tmp_path / "run").exists()


def test_sigterm_while_the_step_compiles_exits_promptly_with_one_line(tmp_path):
    # The marker comes right after the step is lowered: the main thread then compiles it in C++
    # (or waits for the thread that does), where no Python signal handler runs.
    patch = wrap("launch.lower_step", after="print('LOWERED', flush=True)")
    run = tmp_path / "run"
    process = wrapped(patch, ["configs/tiny_llama.py", *SMALL, "--config.train.steps=3",
                              f"--config.output_dir={run}", "--config.train.compilation_cache=off"])
    wait_for_line(process, "LOWERED")
    sent = time.monotonic()
    process.send_signal(signal.SIGTERM)
    out, err = process.communicate(timeout=60)
    elapsed = time.monotonic() - sent
    assert process.returncode == 128 + signal.SIGTERM, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "stopped by SIGTERM during start-up" in lines[0], err
    assert elapsed < 5, f"took {elapsed:.1f} s to exit"
    assert not (run / "checkpoints").exists() or not os.listdir(run / "checkpoints")
    assert not (run / "metrics.jsonl").exists() or (run / "metrics.jsonl").read_text() == ""


# ----------------------------------------------------------------------------------------------
# The hang watchdog, as a unit: a fake clock and arrays that say whether they are ready


class FakeArray:
    def __init__(self):
        self.ready = False

    def is_ready(self):
        return self.ready


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def make_watchdog(tmp_path, clock, hang=10.0, startup=0.0, last_step=100):
    exits = []
    dog = HangWatchdog(hang, startup, str(tmp_path), last_step, exit=exits.append, clock=clock,
                       stream=open(tmp_path / "stderr.txt", "w"))
    return dog, exits


def test_watchdog_gives_start_up_its_own_limit_then_the_step_limit(tmp_path):
    clock = Clock()
    dog, exits = make_watchdog(tmp_path, clock, hang=10.0)  # start-up: 10 x 10 s
    clock.now = 99.0
    assert dog.check() and not exits  # compiling for 99 s is within the start-up limit
    first = FakeArray()
    dog.dispatched(1, {"loss": first})
    first.ready = True
    clock.now = 100.0
    assert dog.check() and dog.finished_step == 1
    # From here a step must finish every 10 s; steps dispatched but not finished do not count.
    pending = FakeArray()
    dog.dispatched(2, {"loss": pending})
    clock.now = 109.0
    assert dog.check() and not exits
    clock.now = 110.5
    assert not dog.check()
    assert exits == [HANG_EXIT_STATUS]
    stderr = (tmp_path / "stderr.txt").read_text()
    assert stderr.startswith("error: no training step finished for 10 s since step 1 finished")
    dumps = list(tmp_path.glob("hang-p0-*.txt"))
    assert len(dumps) == 1 and "most recent call first" in dumps[0].read_text()


def test_watchdog_fires_in_start_up_after_its_limit(tmp_path):
    clock = Clock()
    dog, exits = make_watchdog(tmp_path, clock, hang=10.0, startup=30.0)
    clock.now = 30.5
    assert not dog.check() and exits == [HANG_EXIT_STATUS]
    assert "since start-up began" in (tmp_path / "stderr.txt").read_text()


def test_watchdog_stands_down_after_the_last_step(tmp_path):
    clock = Clock()
    dog, exits = make_watchdog(tmp_path, clock, hang=10.0, last_step=2)
    for step in (1, 2):
        array = FakeArray()
        array.ready = True
        dog.dispatched(step, {"loss": array})
    assert not dog.check()  # done: the final save is not a step
    clock.now = 1000.0
    assert exits == []


# ----------------------------------------------------------------------------------------------
# The hang watchdog in a real run


def test_a_stalled_run_dumps_every_stack_and_exits_4(tmp_path):
    # The loader stalls at step 2 (the main thread sleeps where the batch should come from).
    patch = wrap("train.Trainer.device_batch", before="if args[1] == 2: time.sleep(3600)")
    run = tmp_path / "run"
    process = wrapped(patch, ["configs/tiny_llama.py", *SMALL, "--config.train.steps=5",
                              f"--config.output_dir={run}", "--config.train.hang_timeout_s=3",
                              "--config.train.startup_timeout_s=240", "--config.checkpoint.enabled=false"])
    out, err = process.communicate(timeout=300)
    assert process.returncode == HANG_EXIT_STATUS, err
    first = err.splitlines()[0]
    assert first.startswith("error: no training step finished for 3 s since step 2 finished"), err
    assert "train.hang_timeout_s" in first and "exiting with status 4" in first
    assert "in wrapper" in err  # the stack of the main thread, where it hangs
    dumps = list(run.glob("hang-p0-*.txt"))
    assert len(dumps) == 1 and "in wrapper" in dumps[0].read_text()
    assert "step 2/5" in out
