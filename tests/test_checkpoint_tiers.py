"""Issue 47: the node-local checkpoint tier (checkpoint.local_dir) beside the persistent one. A run
killed with SIGKILL resumes from the newest local step every process holds intact (from an older one
when the newest is damaged; from the persistent tier when a process holds none), and every loss
equals the uninterrupted run's bit for bit."""

import json
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest

from maxtext_rocm.checkpoint.local_tier import run_folder
from test_checkpoint import final_params, finish, logged, start, wait_for_step

TIERS = ["--config.checkpoint.every=10", "--config.checkpoint.local_every=2", "--config.checkpoint.local_keep=2"]


def local_steps(folder: Path) -> list[int]:
    return sorted(int(p.name) for p in folder.iterdir() if p.name.isdigit()) if folder.is_dir() else []


def killed_after_local_save(run, local, step, at_least_logged):
    """Starts the run and SIGKILLs it once local step `step` is committed and step `at_least_logged` logged."""
    process = start(run, *TIERS, f"--config.checkpoint.local_dir={local}")
    folder = run_folder(str(local), str(run)) / "process-0-of-1"
    wait_for_step(run, at_least_logged, process)
    deadline = time.time() + 60
    while step not in local_steps(folder):
        assert time.time() < deadline and process.poll() is None, process.communicate()
        time.sleep(0.02)
    process.send_signal(signal.SIGKILL)
    process.wait()
    return folder


def assert_same_run(run, reference):
    got, want = logged(run), logged(reference)
    assert sorted(got) == sorted(want)
    for step, losses in got.items():  # steps redone after the resume are logged again: all must agree
        assert all(loss == want[step][0] for loss in losses), (step, losses, want[step])
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(final_params(run)),
                            jax.tree_util.tree_leaves(final_params(reference))):
        assert np.array_equal(a, b), jax.tree_util.keystr(path)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    out = tmp_path_factory.mktemp("reference") / "run"
    code, _, err = finish(start(out, *TIERS))  # no local tier: the local saves change nothing
    assert code == 0, err
    return out


def test_sigkill_resumes_from_the_local_tier_bit_exact(reference, tmp_path):
    run, local = tmp_path / "run", tmp_path / "local"
    folder = killed_after_local_save(run, local, 6, 7)  # persistent: none yet (every=10); local: 4, 6 (or 6, 8)
    newest = local_steps(folder)[-1]
    assert newest >= 6 and not (run / "checkpoints").exists()
    code, out, err = finish(start(run, *TIERS, f"--config.checkpoint.local_dir={local}"))
    assert code == 0, err
    assert (f"resuming from the local tier at step {newest}: the newest step every process holds intact "
            "(no persistent checkpoint yet)") in out, out
    assert f"resumed from the local tier's step {newest}" in out
    assert_same_run(run, reference)
    assert local_steps(folder) == [6, 8]  # local_keep=2; steps 10 and 12 went to the persistent tier
    assert sorted(int(p.name) for p in (run / "checkpoints").iterdir() if p.name.isdigit()) == [10, 12]


def test_a_damaged_local_step_falls_back_to_the_newest_intact_one(reference, tmp_path):
    run, local = tmp_path / "run", tmp_path / "local"
    folder = killed_after_local_save(run, local, 6, 7)
    older, newest = local_steps(folder)[-2:]  # 4, 6 (or 6, 8: step 8 written before the kill)
    # The largest of orbax's data files: the embedding's or the optimizer state's chunks.
    victim = max((p for p in (folder / str(newest) / "state").rglob("*") if p.is_file()),
                 key=lambda p: p.stat().st_size)
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0x01  # one bit
    victim.write_bytes(bytes(data))
    code, out, err = finish(start(run, *TIERS, f"--config.checkpoint.local_dir={local}"))
    assert code == 0, err
    assert f"resuming from the local tier at step {older}" in out, out
    # A flipped bit in compressed chunks fails to decompress or decompresses to other numbers.
    assert re.search(rf"local checkpoint {re.escape(str(folder / str(newest)))} "
                     r"(cannot be read \(.+\)|failed verification \(.+ does not match its checksum\)); "
                     rf"it was moved to {re.escape(str(folder / f'{newest}.damaged'))}", err), err
    assert (folder / f"{newest}.damaged").is_dir()  # set aside, not deleted
    assert_same_run(run, reference)


def test_without_local_dir_a_left_local_tier_is_not_read(reference, tmp_path):
    """A local tier that another launch left is not read without checkpoint.local_dir."""
    run, local = tmp_path / "run", tmp_path / "local"
    killed_after_local_save(run, local, 6, 7)
    code, out, err = finish(start(run, *TIERS))
    assert code == 0, err
    assert "local tier" not in out and "resumed from" not in out  # no persistent step yet: a fresh start
    assert_same_run(run, reference)


@pytest.mark.slow  # CI budget: three runs of 12 steps; the tier's own path is the tests above
def test_a_lora_run_resumes_from_the_local_tier_bit_exact_and_checks_its_base(tmp_path):
    """A LoRA run's local steps hold its adapters and record its base as its persistent checkpoints
    do: the resume is bit-exact, and a resume onto another base is refused as from the persistent tier."""
    lora = ["--config.lora.rank=2"]
    reference = tmp_path / "reference"
    code, _, err = finish(start(reference, *TIERS, *lora))
    assert code == 0, err
    run, local = tmp_path / "run", tmp_path / "local"
    process = start(run, *TIERS, *lora, f"--config.checkpoint.local_dir={local}")
    folder = run_folder(str(local), str(run)) / "process-0-of-1"
    wait_for_step(run, 7, process)
    while 6 not in local_steps(folder):
        assert process.poll() is None, process.communicate()
        time.sleep(0.02)
    process.send_signal(signal.SIGKILL)
    process.wait()
    newest = local_steps(folder)[-1]
    meta = json.loads((folder / str(newest) / "meta" / "metadata").read_text())
    assert meta["lora"]["rank"] == 2 and meta["lora"]["base"]["seed"] is not None

    other_base = finish(start(run, *TIERS, *lora, f"--config.checkpoint.local_dir={local}", "--config.train.seed=7"))
    assert other_base[0] == 2 and "Traceback" not in other_base[2], other_base[2]
    assert f"the local tier's step {newest}" not in other_base[1]  # refused before it trained on
    assert "base" in other_base[2].splitlines()[-1], other_base[2]

    code, out, err = finish(start(run, *TIERS, *lora, f"--config.checkpoint.local_dir={local}"))
    assert code == 0, err
    assert f"resumed from the local tier's step {newest}" in out, out
    got, want = logged(run), logged(reference)
    assert sorted(got) == sorted(want)
    for step, losses in got.items():
        assert all(loss == want[step][0] for loss in losses), (step, losses, want[step])
    final = [json.loads((r / "checkpoints" / "12" / "meta" / "metadata").read_text())["checksums"] for r in (run, reference)]
    assert final[0] == final[1]


def test_a_local_save_writes_only_this_process_s_files_and_keeps_local_keep(reference, tmp_path):
    run, local = tmp_path / "run", tmp_path / "local"
    code, _, err = finish(start(run, *TIERS, f"--config.checkpoint.local_dir={local}"))
    assert code == 0, err
    folder = run_folder(str(local), str(run)) / "process-0-of-1"
    assert local_steps(folder) == [6, 8]  # local_keep=2; steps 10 and 12 went to the persistent tier
    meta = json.loads((folder / "8" / "meta" / "metadata").read_text())
    assert meta["step"] == 8 and meta["processes"] == 1
    assert len(json.loads((folder / "8" / "checksums.json").read_text())) > 10  # one per array of the state
    assert json.loads((folder / "8" / "data" / "metadata").read_text())["step"] == 8
    assert not list(folder.glob("*orbax-checkpoint-tmp*"))
    assert_same_run(run, reference)


@pytest.mark.skipif(not Path("/dev/shm").is_dir(), reason="no /dev/shm here")
def test_the_start_up_fit_counts_a_local_tier_in_memory(tmp_path, devices, monkeypatch):
    from conftest import small_config
    from maxtext_rocm.config import ConfigError, memory_fit

    shm = Path("/dev/shm")
    assert memory_fit.in_memory_file_system(str(shm / "run-local")) and not memory_fit.in_memory_file_system("/proc/x")
    on_disk = small_config(**{"checkpoint.local_dir": str(tmp_path), "checkpoint.local_keep": 3,
                              "output_dir": str(tmp_path / "run")})
    in_memory = small_config(**{"checkpoint.local_dir": str(shm / "run-local"), "checkpoint.local_keep": 3,
                                "output_dir": str(tmp_path / "run")})
    state = memory_fit.lower_bounds(on_disk, len(devices))["state"]
    assert memory_fit.lower_bounds(in_memory, len(devices))["local_tier"] == 3 * state
    if not memory_fit.in_memory_file_system(str(tmp_path)):
        assert memory_fit.lower_bounds(on_disk, len(devices))["local_tier"] == 0
    bounds = memory_fit.lower_bounds(in_memory, len(devices))
    without = bounds["state"] + bounds["activations"] + bounds["batches"]
    monkeypatch.setattr(memory_fit, "host_available_bytes", lambda: without + state)  # room for one copy, not 3
    with pytest.raises(ConfigError, match=r"local checkpoints in /dev/shm/run-local .* GiB"):
        memory_fit.check_fits(in_memory, devices)
    memory_fit.check_fits(on_disk if not memory_fit.in_memory_file_system(str(tmp_path)) else
                          small_config(output_dir=str(tmp_path / "run")), devices)
