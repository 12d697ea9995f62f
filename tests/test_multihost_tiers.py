"""Issue 47: two processes (dcn.data=2 x ici.fsdp=4) with a node-local tier each, killed with SIGKILL.
With both local tiers intact, the relaunch resumes from the newest local step both hold; with
process 1's removed (a replaced node), both fall back to the persistent tier together; either way
every loss equals the uninterrupted run's bit for bit."""

import shutil
import signal
import time

import pytest

from maxtext_rocm.checkpoint.local_tier import run_folder
from test_multihost_stop import STEPS, finish, logged_step, losses, start_pair

TIERS = ["--config.checkpoint.every=10", "--config.checkpoint.local_every=2", "--config.checkpoint.local_keep=2"]


def local_steps(folder):
    return sorted(int(p.name) for p in folder.iterdir() if p.name.isdigit()) if folder.is_dir() else []


def killed_pair(tmp_path, local):
    """Both processes SIGKILLed once local step 12 is committed on both (the persistent tier holds 10)."""
    out, logs = tmp_path / "run", tmp_path / "logs"
    logs.mkdir(exist_ok=True)
    procs = start_pair(out, logs, "killed", *TIERS, f"--config.checkpoint.local_dir={local}")
    folders = [run_folder(str(local), str(out)) / f"process-{i}-of-2" for i in range(2)]
    deadline = time.monotonic() + 240
    while logged_step(out) < 13 or not all(12 in local_steps(f) for f in folders):
        assert time.monotonic() < deadline and all(p.poll() is None for p, _ in procs), \
            (logs / "killed_0.log").read_text()[-3000:]
        time.sleep(0.02)
    for p, _ in procs:
        p.send_signal(signal.SIGKILL)
    finish(procs)
    return out, folders


def relaunched(tmp_path, out, local, tag):
    codes = finish(start_pair(out, tmp_path / "logs", tag, *TIERS, f"--config.checkpoint.local_dir={local}"))
    text = (tmp_path / "logs" / f"{tag}_0.log").read_text()
    assert codes == [0, 0], text[-3000:]
    return text


def matches_uninterrupted(tmp_path, out):
    reference = tmp_path / "reference"
    codes = finish(start_pair(reference, tmp_path / "logs", "reference", *TIERS))
    assert codes == [0, 0], (tmp_path / "logs" / "reference_0.log").read_text()[-3000:]
    got, want = losses(out), losses(reference)
    assert sorted(got) == list(range(1, STEPS + 1)) == sorted(want)
    for step, values in got.items():
        assert all(v == want[step][0] for v in values), (step, values, want[step])  # bit for bit


@pytest.mark.slow
def test_two_processes_resume_from_the_local_tier_they_both_hold(tmp_path):
    local = tmp_path / "local"
    out, folders = killed_pair(tmp_path, local)
    newest = min(local_steps(f)[-1] for f in folders)
    text = relaunched(tmp_path, out, local, "resumed")
    assert f"resuming from the local tier at step {newest}: the newest step every process holds intact " \
           "(the newest persistent checkpoint is step 10)" in text, text[-3000:]
    matches_uninterrupted(tmp_path, out)


@pytest.mark.slow
def test_one_process_without_its_local_tier_makes_both_fall_back_to_the_persistent_tier(tmp_path):
    local = tmp_path / "local"
    out, folders = killed_pair(tmp_path, local)
    shutil.rmtree(folders[1])  # process 1's node was replaced
    text = relaunched(tmp_path, out, local, "resumed")
    assert "resuming from the persistent tier (newest: step 10): process 1 holds no local checkpoint" in text, \
        text[-3000:]
    assert "resumed from" in text and "checkpoints/10" in text
    assert local_steps(folders[0])[-1] <= STEPS  # process 0's newer local steps were discarded, then rewritten
    matches_uninterrupted(tmp_path, out)
