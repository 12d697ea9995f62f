"""Issue 34, items 1-3 in one process: the agreement on a stop step (with a fake key-value store
standing in for JAX's coordination service), a signal while the final checkpoint commits, and a
checkpoint directory that cannot be written with asynchronous saves. The two-process runs are in
tests/test_multihost_stop.py."""

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from maxtext_rocm.runtime.peers import PEER_LOST_EXIT_STATUS, PeerWatch
from maxtext_rocm.runtime.preemption import PreemptionGuard, StopAgreement, StopNotAgreed, exit_status

from helpers import KeyValueStore

REPO = Path(__file__).resolve().parent.parent
SMALL = ["--config.model.vocab_size=128", "--config.model.d_model=64", "--config.model.n_layers=2",
         "--config.model.n_heads=4", "--config.model.n_kv_heads=2", "--config.model.head_dim=16",
         "--config.model.mlp_dim=128", "--config.data.source=synthetic", "--config.train.seq_len=32",
         "--config.train.per_device_batch_size=2", "--config.log.every=1", "--config.log.tensorboard=false",
         "--config.train.compilation_cache=off"]
ENV = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2", PYTHONPATH=str(REPO))


def agreements(n, start=0, timeout_s=10.0, generation=0):
    client = KeyValueStore()
    return client, [StopAgreement(start, i, n, client, timeout_s=timeout_s, generation=generation) for i in range(n)]


def run_loop(agreement, end, reached, stopped_at):
    """A training loop's use of the agreement: proceed before each step, stopping_at after it."""
    step = 0
    while step < end and agreement.proceed(step):
        step += 1
        reached.wait() if step == 3 else time.sleep(0.001)
        if agreement.stopping_at(step):
            break
    stopped_at.append(step)
    agreement.close()


def test_processes_at_different_steps_stop_at_the_same_step():
    _, group = agreements(3)
    # Process 2 is ahead (the others are slower to dispatch), process 0 is at step 0.
    assert group[2].proceed(0) and group[2].proceed(1) and group[2].proceed(2) and group[2].proceed(3)
    assert group[0].proceed(0)
    group[1].request(signal.SIGTERM)  # process 1 alone got the signal
    for a in group:
        assert a._decided.wait(5)
    assert [a.stop_step for a in group] == [4, 4, 4]  # the furthest any process was cleared to reach
    assert [a.signal for a in group] == [signal.SIGTERM] * 3
    # Each loop runs up to the agreed step and no further.
    steps = [0, 0, 4]
    for i, a in enumerate(group):
        while a.proceed(steps[i]):
            steps[i] += 1
    assert steps == [4, 4, 4] and all(a.stopping_at(4) for a in group)


def test_threaded_loops_and_a_signal_at_any_moment_agree():
    _, group = agreements(2)
    reached, stopped_at = threading.Event(), []
    loops = [threading.Thread(target=run_loop, args=(a, 1000, reached, stopped_at)) for a in group]
    for t in loops:
        t.start()
    group[1].request(signal.SIGINT)
    reached.set()
    for t in loops:
        t.join(10)
    assert len(stopped_at) == 2 and stopped_at[0] == stopped_at[1] < 1000, stopped_at


def test_a_process_whose_loop_ended_still_answers_a_late_request():
    _, group = agreements(2)
    for step in range(10):
        group[0].proceed(step), group[1].proceed(step)
    group[0].close()  # train.steps reached: its loop is over, its guard closed
    group[1].request(signal.SIGTERM)  # a signal during process 1's final save
    assert group[1]._decided.wait(5) and group[1].stop_step == 10
    assert not group[1].proceed(10)


def test_a_peer_that_never_answers_is_one_sentence_not_a_hang():
    client = KeyValueStore()
    alone = StopAgreement(0, 0, 2, client, timeout_s=0.5, generation=1)  # process 1 never joins
    alone.proceed(0)
    alone.request(signal.SIGTERM)
    started = time.monotonic()
    # The watcher's own sentence, or the loop's when its wait (as long) ends first on a loaded machine
    with pytest.raises(StopNotAgreed, match=r"did not (hear every process's step|agree on a step) within 0.5 s"):
        step = 1
        while alone.proceed(step):  # until the watcher freezes the loop, then no further
            step += 1
            time.sleep(0.001)  # a step's time, in which the watcher runs
            assert step < 5000  # ~5 s: the watcher thread gets the CPU by then, even on a loaded machine
    assert time.monotonic() - started < 10


def test_one_process_stops_at_the_step_it_was_cleared_to_reach():
    alone = StopAgreement(5)
    assert alone.proceed(5) and alone.proceed(6)
    alone.request(signal.SIGTERM)
    assert alone.stop_step == 7 and alone.proceed(6) and not alone.proceed(7) and alone.stopping_at(7)


def test_repeated_signals_say_so_and_a_third_sigint_abandons(capsys):
    exits = []
    guard = PreemptionGuard(describe_saved=lambda: "/run/checkpoints/4", exit=exits.append)
    guard.agreement = StopAgreement(6)
    guard.agreement.proceed(6)
    guard.received(signal.SIGTERM)
    guard.received(signal.SIGTERM)
    guard.received(signal.SIGINT)
    assert not exits
    guard.received(signal.SIGINT)
    assert exits == [130]
    lines = capsys.readouterr().err.splitlines()
    assert lines == [
        "SIGTERM again: already stopping at step 7; its checkpoint is being committed (SIGINT 2 more times "
        "abandons it)",
        "SIGINT again: already stopping at step 7; its checkpoint is being committed (SIGINT 1 more time "
        "abandons it)",
        "error: abandoned by a repeated SIGINT before the checkpoint was committed; the newest committed "
        "checkpoint is /run/checkpoints/4"]


# ----------------------------------------------------------------------------------------------
# Real trainers


def wrapped(patch: str, args: list[str]) -> subprocess.Popen:
    code = f"import sys, time\n{patch}\nfrom maxtext_rocm import train\nsys.exit(train.main({args!r}))\n"
    return subprocess.Popen([sys.executable, "-c", code], cwd=REPO, env=ENV, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def committed(run: Path) -> list[int]:
    return sorted(int(p.name) for p in (run / "checkpoints").iterdir() if p.name.isdigit())


SLOW_WAIT = """
from maxtext_rocm import checkpoint
original = checkpoint.Checkpointer.wait
def wait(self):
    print("WAITING", flush=True)
    time.sleep(2.0)  # the final save is still committing when the signals come
    original(self)
checkpoint.Checkpointer.wait = wait
"""


def test_signals_while_the_final_checkpoint_commits_keep_it(tmp_path):
    run = tmp_path / "run"
    process = wrapped(SLOW_WAIT, ["configs/tiny_llama.py", *SMALL, "--config.train.steps=4",
                                  f"--config.output_dir={run}"])
    deadline = time.monotonic() + 240
    while "WAITING" not in process.stdout.readline():
        assert time.monotonic() < deadline and process.poll() is None, process.communicate()
    process.send_signal(signal.SIGTERM)
    time.sleep(0.02)
    process.send_signal(signal.SIGTERM)
    out, err = process.communicate(timeout=60)
    assert process.returncode == 0, err
    assert err.strip().splitlines() == [
        "SIGTERM again: already stopping at step 4; its checkpoint is being committed (SIGINT 2 more times "
        "abandons it)",
        "stopped by signal 15 at step 4; checkpoint committed"], err
    assert committed(run) == [4]
    assert not [p for p in (run / "checkpoints").iterdir() if "tmp" in p.name]


READ_ONLY_CHECKPOINTS = """
import errno, os
real_mkdir = os.mkdir
def mkdir(path, *args, **kwargs):  # what a read-only mount or an immutable checkpoints/ does to orbax
    if "orbax-checkpoint-tmp" in str(path):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(path))
    return real_mkdir(path, *args, **kwargs)
os.mkdir = mkdir
"""


def test_an_unwritable_checkpoint_directory_exits_2_in_seconds_with_async_saves(tmp_path):
    run = tmp_path / "run"
    process = wrapped(READ_ONLY_CHECKPOINTS, ["configs/tiny_llama.py", *SMALL, "--config.train.steps=8",
                                              "--config.checkpoint.every=2", "--config.checkpoint.async_save=true",
                                              f"--config.output_dir={run}"])
    deadline = time.monotonic() + 240
    while "step 2/8" not in process.stdout.readline():
        assert time.monotonic() < deadline and process.poll() is None, process.communicate()
    failed_at = time.monotonic()
    try:
        out, err = process.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        process.kill()
        raise AssertionError("the run hung after its save failed") from None
    assert process.returncode == 2, err
    assert time.monotonic() - failed_at < 20
    assert err.strip().splitlines() == [
        f"error: saving checkpoint 2 in {run / 'checkpoints'} failed ({os.strerror(30)}); its partial directory "
        "was removed, there is no earlier checkpoint, so a restart begins at step 0"], err


def test_every_process_learns_the_agreed_signal_before_its_loop_can_stop():
    """on_decided runs before the stop step is visible: a peer that ends first (its goodbye carries
    the agreed exit status) cannot reach a process that does not expect it yet."""
    client = KeyValueStore()
    seen = []
    group = [StopAgreement(0, i, 2, client, timeout_s=10.0, generation=7,
                           on_decided=lambda signum, i=i: seen.append((i, signum, group[i].stop_step)))
             for i in range(2)]
    group[1].request(signal.SIGINT)
    for a in group:
        assert a._decided.wait(5)
    assert sorted(seen) == [(0, signal.SIGINT, None), (1, signal.SIGINT, None)]
    assert exit_status(signal.SIGINT) == 130 and exit_status(signal.SIGTERM) == 0


@pytest.mark.parametrize("expected, status, stops", [(0, 0, False), (0, 130, True), (130, 130, False),
                                                    (130, 3, True), (0, 134, True)])
def test_a_peers_goodbye_with_the_agreed_status_is_an_end_not_a_failure(expected, status, stops):
    """Two PeerWatches over loopback in one process: process 1 says goodbye with `status`; process
    0, told to expect `expected` (the agreed stop's status), stops with exit status 5 only for
    another one. (The race this closes: after an agreed stop by SIGINT, the process that finished
    first said goodbye with 130 and its peer, still committing, exited 5.)"""
    made, exits, lines = _peer_pair()
    made[0].expect_exit(expected)
    made[1].say_goodbye(status)
    deadline = time.monotonic() + 5
    while stops and not exits and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.2)  # long enough for a wrong stop to show
    assert exits == ([PEER_LOST_EXIT_STATUS] if stops else []), lines
    if stops:
        assert f"process 1 of 2 (pid {os.getpid()}" in "".join(lines)
        assert f"stopped with exit status {status}" in "".join(lines)


@pytest.mark.parametrize("own_end", [True, False])
def test_a_peers_user_error_waits_for_this_process_to_say_its_own(own_end, monkeypatch):
    """Bad input is found by every process, milliseconds apart: process 1's goodbye with exit
    status 2 leaves process 0 the grace to reach its own end (and print its own sentence); a
    process that does not gets there stops with 2 too (a restart would meet the same input), not 5."""
    import maxtext_rocm.runtime.peers as peers

    monkeypatch.setattr(peers, "USER_ERROR_GRACE_S", 0.5)
    watches, exits, lines = _peer_pair()
    watches[1].say_goodbye(2)
    if own_end:
        time.sleep(0.1)
        watches[0].say_goodbye(2)
    time.sleep(1.0)
    assert exits == ([] if own_end else [2]), lines
    if not own_end:
        assert "stopped with exit status 2 (bad input; its own log says which); process 0 stops too (exit " \
               "status 2) (a restart would meet the same input)" in "".join(lines)


def _peer_pair():
    """Two PeerWatches over loopback in this process, exits and printed lines recorded."""
    client, exits, lines, made = KeyValueStore(), [], [], {}

    class Stream:
        def write(self, text):
            lines.append(text)

        def flush(self):
            pass

    def make(i):
        made[i] = PeerWatch(client, i, 2, "127.0.0.1", timeout_s=10.0, heartbeat_s=10.0, exit=exits.append,
                            stream=Stream())

    first = threading.Thread(target=make, args=(0,))
    first.start()
    make(1)
    first.join(10)
    return made, exits, lines
