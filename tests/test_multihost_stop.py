"""Issue 34, item 1: a signal on one process of a two-process run (dcn.data=2 x ici.fsdp=4) stops
both at the same step, with one committed checkpoint there, and the relaunch continues bit for bit
like a run that was never interrupted (maxtext_rocm/runtime/preemption.py)."""

import json
import signal
import subprocess
import sys
import time

import pytest

from test_distributed import REPO, SMALL, free_port, process_env

STEPS = 16
ARGS = [*SMALL, f"--config.train.steps={STEPS}", "--config.mesh.dcn.data=2", "--config.mesh.ici.fsdp=4",
        "--config.checkpoint.enabled=true", "--config.checkpoint.every=1000", "--config.train.compilation_cache=off"]


def start_pair(out, logs, tag, *extra):
    port = free_port()
    procs = []
    for i in range(2):
        env = process_env(JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}", JAX_NUM_PROCESSES="2", JAX_PROCESS_ID=str(i),
                          PYTHONPATH=REPO)
        env["XLA_FLAGS"] += " --xla_force_host_platform_device_count=4"
        log = open(logs / f"{tag}_{i}.log", "w+")
        procs.append((subprocess.Popen([sys.executable, "-m", "maxtext_rocm.train", "configs/tiny_llama.py:fp32",
                                        *ARGS, f"--config.output_dir={out}", *extra], cwd=REPO, env=env, stdout=log,
                                       stderr=subprocess.STDOUT), log))
    return procs


def finish(procs, timeout=240):
    codes = []
    try:
        for p, _ in procs:
            codes.append(p.wait(timeout=timeout))
    finally:
        for p, log in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
            log.close()
    return codes


def losses(out) -> dict[int, list[float]]:
    rows = {}
    for line in (out / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        rows.setdefault(row["step"], []).append(row["loss"])
    return rows


def logged_step(out) -> int:
    path = out / "metrics.jsonl"
    return max((json.loads(line)["step"] for line in path.read_text().splitlines()), default=0) \
        if path.exists() else 0


def stop_one(tmp_path, signals, at_step=6):
    """A run stopped by `signals` [(process, signal, delay_s)] once step `at_step` is logged; returns its
    output_dir, exit codes and logs."""
    out, logs = tmp_path / "stopped", tmp_path / "logs"
    logs.mkdir(exist_ok=True)
    procs = start_pair(out, logs, "stopped")
    deadline = time.monotonic() + 240
    while logged_step(out) < at_step:
        assert time.monotonic() < deadline and all(p.poll() is None for p, _ in procs), \
            (logs / "stopped_0.log").read_text()[-3000:]
        time.sleep(0.05)
    for process, sig, delay in signals:
        time.sleep(delay)
        procs[process][0].send_signal(sig)
    codes = finish(procs)
    texts = [(logs / f"stopped_{i}.log").read_text() for i in range(2)]
    return out, codes, texts


def check_stopped(out, codes, texts, sig):
    want = 130 if sig == signal.SIGINT else 0
    assert codes == [want, want], f"{codes}\n--- 0:\n{texts[0][-3000:]}\n--- 1:\n{texts[1][-3000:]}"
    saved = sorted(int(p.name) for p in (out / "checkpoints").iterdir() if p.name.isdigit())
    assert len(saved) == 1 and 6 <= saved[0] < STEPS, saved
    assert not [p for p in (out / "checkpoints").iterdir() if "tmp" in p.name]
    assert f"stopped by signal {int(sig)} at step {saved[0]}; checkpoint committed" in texts[0]
    assert f"stopped by signal {int(sig)} at step {saved[0]}" in texts[1]
    assert "Traceback" not in texts[0] + texts[1] and "gloo" not in texts[0] + texts[1]
    return saved[0]


def relaunch_matches_uninterrupted(tmp_path, out):
    codes = finish(start_pair(out, tmp_path / "logs", "resumed"))
    assert codes == [0, 0], (tmp_path / "logs" / "resumed_0.log").read_text()[-3000:]
    reference = tmp_path / "reference"
    codes = finish(start_pair(reference, tmp_path / "logs", "reference"))
    assert codes == [0, 0], (tmp_path / "logs" / "reference_0.log").read_text()[-3000:]
    got, want = losses(out), losses(reference)
    assert sorted(got) == list(range(1, STEPS + 1)) == sorted(want)
    for step, values in got.items():
        assert all(v == want[step][0] for v in values), (step, values, want[step])  # bit for bit


def test_sigterm_to_process_1_alone_stops_both_at_one_step_and_the_relaunch_is_bit_exact(tmp_path):
    out, codes, texts = stop_one(tmp_path, [(1, signal.SIGTERM, 0.0)])
    check_stopped(out, codes, texts, signal.SIGTERM)
    relaunch_matches_uninterrupted(tmp_path, out)


@pytest.mark.slow
@pytest.mark.parametrize("signals, sig", [
    ([(0, signal.SIGTERM, 0.0)], signal.SIGTERM),
    ([(0, signal.SIGTERM, 0.0), (1, signal.SIGTERM, 0.5)], signal.SIGTERM),
    ([(1, signal.SIGINT, 0.0)], signal.SIGINT),
    ([(1, signal.SIGTERM, 0.0), (0, signal.SIGTERM, 0.02), (1, signal.SIGTERM, 0.02)], signal.SIGTERM),
], ids=["sigterm_to_0", "sigterm_to_both_0.5s_apart", "sigint_to_1", "three_sigterms"])
def test_any_signal_pattern_stops_both_at_one_step(tmp_path, signals, sig):
    out, codes, texts = stop_one(tmp_path, signals)
    check_stopped(out, codes, texts, sig)
