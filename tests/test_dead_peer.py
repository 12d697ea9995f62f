"""A dead peer is named by the survivor in one sentence, before JAX's own abort (issue 24, finding 10).

Two real processes (2 x 4 fake CPU devices, gloo over 127.0.0.1, ~30 s on 2 cores); process 1 is
killed with SIGKILL mid-training, so it says no goodbye.
"""

import os
import signal
import time

import pytest

from maxtext_rocm.runtime.peers import PEER_LOST_EXIT_STATUS
from test_distributed import start_pair_past_step_2, stop_pair


@pytest.mark.parametrize("victim", [1, pytest.param(0, marks=pytest.mark.slow)])  # a worker; the coordinator
def test_the_survivor_names_the_dead_process_and_exits_5(tmp_path, victim):
    heartbeat = 60  # far longer than the test waits: the coordination service is not what speaks
    procs, logs = [], []
    try:
        start_pair_past_step_2(tmp_path, heartbeat, procs, logs)
        survivor = 1 - victim
        victim_pid = procs[victim].pid
        procs[victim].send_signal(signal.SIGKILL)
        killed = time.monotonic()
        rc = procs[survivor].wait(timeout=30)
        took = time.monotonic() - killed
    finally:
        stop_pair(procs, logs)
    log = (tmp_path / f"process_{survivor}.log").read_text()
    assert rc == PEER_LOST_EXIT_STATUS, log[-3000:]
    errors = [line for line in log.splitlines() if line.startswith("error:")]
    assert errors == [f"error: process {victim} of 2 (pid {victim_pid} on {os.uname().nodename}) went silent: its "
                      "connection closed without a goodbye (the process died or its host went down); process "
                      f"{survivor} stops too (exit status 5) so the scheduler can restart the run from its last "
                      "checkpoint"], log[-3000:]
    assert "Traceback" not in log and "Check failure" not in log and "gloo::" not in log, log[-3000:]
    assert took < 10, f"process {survivor} took {took:.1f} s to stop"
    print(f"process {survivor} stopped {took:.2f} s after process {victim} was killed")
