"""A dead peer is named by the survivor in one sentence, before JAX's own abort (issue 24, finding 10).

Two real processes (2 x 4 fake CPU devices, gloo over 127.0.0.1, ~30 s on 2 cores); process 1 is
killed with SIGKILL mid-training, so it says no goodbye.
"""

import os
import signal
import subprocess
import sys
import time

import pytest

from maxtext_rocm.peers import PEER_LOST_EXIT_STATUS
from test_distributed import REPO, SMALL, free_port, process_env


@pytest.mark.parametrize("victim", [1, 0])  # a worker, and the coordinator itself
def test_the_survivor_names_the_dead_process_and_exits_5(tmp_path, victim):
    heartbeat = 60  # far longer than the test waits: the coordination service is not what speaks
    port, procs, logs = free_port(), [], []
    args = [sys.executable, "-m", "maxtext_rocm.train", "configs/tiny_llama.py:fp32", *SMALL,
            "--config.train.steps=100000", "--config.mesh.dcn.data=2", "--config.mesh.ici.fsdp=4",
            f"--config.distributed.heartbeat_timeout_s={heartbeat}", f"--config.output_dir={tmp_path}/run"]
    try:
        for i in range(2):
            logs.append(open(tmp_path / f"process_{i}.log", "w+"))
            env = process_env(JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}", JAX_NUM_PROCESSES="2",
                              JAX_PROCESS_ID=str(i))
            env["XLA_FLAGS"] += " --xla_force_host_platform_device_count=4"
            procs.append(subprocess.Popen(args, cwd=REPO, env=env, stdout=logs[i], stderr=subprocess.STDOUT))
        deadline = time.monotonic() + 180
        while "step      2/100000" not in (tmp_path / "process_0.log").read_text():
            assert time.monotonic() < deadline, "the 2-process run never reached step 2"
            assert procs[0].poll() is None and procs[1].poll() is None, (tmp_path / "process_0.log").read_text()
            time.sleep(0.2)
        survivor = 1 - victim
        victim_pid = procs[victim].pid
        procs[victim].send_signal(signal.SIGKILL)
        killed = time.monotonic()
        rc = procs[survivor].wait(timeout=30)
        took = time.monotonic() - killed
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        for f in logs:
            f.close()
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
