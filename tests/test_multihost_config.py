"""Processes of one run compare their resolved configs at start (issue 34, item 9): one started
with a different override makes every process exit 2 within seconds, naming the key and both
values, before anything is compiled or written; none reports another as gone silent."""

import subprocess
import sys
import time

import pytest

from maxtext_rocm import config as config_lib
from maxtext_rocm.config import agreement as config_agreement
from test_distributed import REPO, SMALL, free_port, process_env


def test_the_first_differing_key_is_named_and_per_process_keys_are_not_compared():
    a = config_lib.load("configs/tiny_llama.py", ["--config.distributed.process_id=0"])
    b = config_lib.load("configs/tiny_llama.py", ["--config.distributed.process_id=1", "--config.optimizer.lr=0.5",
                                                  "--config.train.steps=7"])
    assert config_agreement.first_difference(config_agreement.comparable(a), config_agreement.comparable(a)) is None
    key, mine, theirs = config_agreement.first_difference(config_agreement.comparable(b), config_agreement.comparable(a))
    assert (key, mine, theirs) == ("optimizer.lr", "0.5", "0.002")
    assert "distributed" in config_agreement.comparable(a) and "process_id" not in config_agreement.comparable(a)["distributed"]


def test_processes_started_with_different_configs_all_exit_2_naming_the_key(tmp_path):
    port = free_port()
    procs = []
    started = time.perf_counter()
    for i in range(2):
        env = process_env(JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}", JAX_NUM_PROCESSES="2", JAX_PROCESS_ID=str(i))
        env["XLA_FLAGS"] += " --xla_force_host_platform_device_count=4"
        lr = ["--config.optimizer.lr=0.001"] if i == 1 else []
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "maxtext_rocm.train", "configs/tiny_llama.py:fp32", *SMALL, *lr,
             "--config.mesh.dcn.data=2", "--config.mesh.ici.fsdp=4", f"--config.output_dir={tmp_path}/run"],
            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    try:
        results = [p.communicate(timeout=120) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    took = time.perf_counter() - started
    want = ("error: process 1 was started with a different config than process 0: optimizer.lr=0.001 there, "
            "optimizer.lr=0.002 on process 0; start every process with the same config file and overrides")
    for i, (p, (out, err)) in enumerate(zip(procs, results)):
        assert p.returncode == 2, f"process {i}: {p.returncode}\n{err[-3000:]}"
        lines = err.strip().splitlines()
        assert lines == [want], f"process {i}:\n{err[-3000:]}"
        assert "went silent" not in err and "Traceback" not in err
    assert not (tmp_path / "run" / "config.json").exists()
    print(f"both stopped after {took:.1f} s")
