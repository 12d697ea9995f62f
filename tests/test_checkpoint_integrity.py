"""Nothing lost, nothing hidden (issue 24): checksums verified on resume, damaged checkpoints
skipped for the newest intact one, checkpoint.resume=STEP with newer steps, failed saves, one run
per output_dir, and divergence that skipping cannot cure."""

import errno
import json
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path

import jax
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from maxtext_rocm.checkpoint import restore_params
from maxtext_rocm.config import CheckpointError
from maxtext_rocm.train import Trainer, TrainingDiverged

from conftest import small_config
from test_checkpoint import ENV, REPO, SMALL, finish, logged, start, wait_for_step


def contents(folder) -> dict[str, bytes]:
    """Every file under `folder` by relative path: to show a directory was moved, not altered."""
    folder = Path(folder)
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def array_files(step_dir) -> list[Path]:
    """The array data files of a checkpoint's state, largest last."""
    return sorted((p for p in (Path(step_dir) / "state").rglob("*") if p.is_file() and "/d/" in str(p)),
                  key=lambda p: p.stat().st_size)


def flip_bytes(path: Path, n: int) -> None:
    data = bytearray(path.read_bytes())
    middle = len(data) // 2
    for i in range(middle, middle + n):
        data[i] ^= 0xFF
    path.write_bytes(bytes(data))


def stderr_lines(err: str) -> list[str]:
    return [line for line in err.splitlines() if line.strip()]


# ----------------------------------------------------------------------------------------------
# The checksum itself


def reference_checksum(x: np.ndarray) -> str:
    """maxtext_rocm/checkpoint/checksums.py's sums, in NumPy on the host, one element at a time in row order."""
    bits = (x.astype(np.uint32) if x.dtype == bool else x.view(f"u{x.dtype.itemsize}")).astype(np.uint64).ravel()
    index = np.arange(bits.size, dtype=np.uint64)
    w1 = (index * 0x9E3779B1 % 2**32) | 1
    w2 = ((index ^ 0x5BD1E995) * 0x85EBCA77 % 2**32) | 1
    mixed = bits ^ (bits >> 15)
    s1 = int((bits * w1 % 2**32).sum() % 2**32)
    s2 = int((mixed * w2 % 2**32).sum() % 2**32)
    return f"{s1:08x}{s2:08x}"


def test_checksums_match_a_host_reference_however_the_arrays_are_sharded(devices):
    from maxtext_rocm.checkpoint import checksums  # here, so the other tests also run (and fail) without it

    rng = np.random.default_rng(0)
    host = {"f32": rng.standard_normal((8, 16)).astype(np.float32),
            "bf16": rng.standard_normal((8, 8, 2)).astype(ml_dtypes.bfloat16),
            "int32": rng.integers(-2**31, 2**31 - 1, (16, 4), dtype=np.int32),
            "fp8": rng.standard_normal((8, 8)).astype(ml_dtypes.float8_e4m3fn),
            "scalar": np.int32(7)}
    want = {name: reference_checksum(np.asarray(x)) for name, x in host.items()}
    one = Mesh(np.array(devices[:1]).reshape(1, 1), ("a", "b"))
    line = Mesh(np.array(devices).reshape(8, 1), ("a", "b"))
    grid = Mesh(np.array(devices).reshape(2, 4), ("a", "b"))
    for mesh, spec in ((one, P()), (line, P("a")), (grid, P("a", "b")), (grid, P("b", "a"))):
        placed = {name: jax.device_put(x, NamedSharding(mesh, spec if np.ndim(x) >= len(spec) else P()))
                  for name, x in host.items()}
        got, nonfinite = checksums.summarise(placed)
        assert got == want, (mesh.shape, spec)
        assert nonfinite == []

    # One ulp anywhere changes the sum; inf/NaN are named.
    changed = host["f32"].copy()
    changed[5, 11] = np.nextafter(changed[5, 11], np.float32(np.inf))
    changed[0, 3] = np.nan
    got, nonfinite = checksums.summarise({"f32": jax.device_put(changed, NamedSharding(grid, P("a", "b")))})
    assert got["f32"] != want["f32"] and got["f32"] == reference_checksum(changed)
    assert nonfinite == ["f32"]


def test_the_checksum_program_needs_no_array_sized_temporaries(devices):
    """Issue 34 item 10: the checksum reads the state once. XLA's memory analysis of its program on
    a sharded state of 6 MiB (a compile-time figure): the old one took 4.5x each device's share of
    the state in temporaries (2.25x on one device), which at 70B does not fit beside the state."""
    from maxtext_rocm.checkpoint import checksums

    grid = Mesh(np.array(devices).reshape(2, 4), ("a", "b"))
    state = [jax.ShapeDtypeStruct((1024, 1024), np.float32, sharding=NamedSharding(grid, P("a", "b"))),
             jax.ShapeDtypeStruct((4096, 256), ml_dtypes.bfloat16, sharding=NamedSharding(grid, P("b", None))),
             jax.ShapeDtypeStruct((3, 1000, 64), np.float32, sharding=NamedSharding(grid, P(None, "a")))]
    per_device = sum(np.prod(x.shape) * np.dtype(x.dtype).itemsize for x in state) / len(devices)
    compiled = checksums.summariser(NamedSharding(grid, P())).lower(state).compile()
    assert compiled.memory_analysis().temp_size_in_bytes < 0.01 * per_device


# ----------------------------------------------------------------------------------------------
# Finding 1: a damaged checkpoint is skipped for the newest intact one


def damage(step_dir: Path, how: str) -> None:
    biggest = array_files(step_dir)[-1]
    if how == "64 bytes flipped":
        flip_bytes(biggest, 64)
    elif how == "4 bytes flipped":
        flip_bytes(biggest, 4)
    elif how == "an array file deleted":
        biggest.unlink()
    elif how == "_METADATA deleted":
        (step_dir / "state" / "_METADATA").unlink()
    else:
        raise ValueError(how)


@pytest.mark.parametrize("how", ["64 bytes flipped", "4 bytes flipped", "an array file deleted", "_METADATA deleted"])
def test_a_damaged_newest_checkpoint_is_set_aside_for_the_newest_intact_one(how, devices, tmp_path, capsys):
    cfg = dict(output_dir=str(tmp_path), **{"train.steps": 4, "checkpoint.every": 2})
    trainer = Trainer(small_config(**cfg), devices=devices[:2], log=lambda *_: None)
    trainer.run(2)
    at_2 = jax.tree_util.tree_map(np.asarray, trainer.state.params)
    trainer.run()
    newest = tmp_path / "checkpoints" / "4"
    damage(newest, how)
    damaged = contents(newest)
    capsys.readouterr()

    resumed = Trainer(small_config(**cfg), devices=devices[:2], log=lambda *_: None)
    lines = stderr_lines(capsys.readouterr().err)
    assert resumed.step_count == 2
    for a, b in zip(jax.tree_util.tree_leaves(resumed.state.params), jax.tree_util.tree_leaves(at_2)):
        assert np.array_equal(np.asarray(a), b)
    assert len(lines) == 1, lines
    assert lines[0].startswith(f"warning: checkpoint {newest} ")
    assert "failed verification" in lines[0] or "cannot be read" in lines[0] or "_METADATA" in lines[0]
    assert lines[0].endswith("and the run resumes from step 2")
    # Moved out of the way of this run's next save of step 4, not deleted, not altered.
    (moved,) = (tmp_path / "checkpoints_set_aside").iterdir()
    assert moved.name.startswith("4.failed-verification.") and str(moved) in lines[0]
    assert contents(moved) == damaged
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["2"]
    resumed.run()
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["2", "4"]


def test_an_explicitly_chosen_damaged_checkpoint_is_an_error(devices, tmp_path):
    cfg = dict(output_dir=str(tmp_path), **{"train.steps": 4, "checkpoint.every": 2})
    Trainer(small_config(**cfg), devices=devices[:2], log=lambda *_: None).run()
    damage(tmp_path / "checkpoints" / "2", "64 bytes flipped")
    before = contents(tmp_path / "checkpoints")
    with pytest.raises(CheckpointError, match=f"checkpoint {tmp_path / 'checkpoints' / '2'} "
                       r"(failed verification|cannot be read).*; choose another with checkpoint.resume"):
        Trainer(small_config(**cfg, **{"checkpoint.resume": "2"}), devices=devices[:2], log=lambda *_: None)
    assert contents(tmp_path / "checkpoints") == before


def test_a_corrupt_newest_checkpoint_ends_with_the_losses_of_a_run_resumed_from_the_older(tmp_path):
    run = tmp_path / "run"
    code, _, err = finish(start(run, steps=8))  # checkpoints 4 and 8
    assert code == 0, err
    reference = tmp_path / "reference"  # the same run directory, as if checkpoint 8 had never been
    shutil.copytree(run, reference)
    shutil.rmtree(reference / "checkpoints" / "8")
    flip_bytes(array_files(run / "checkpoints" / "8")[-1], 64)

    code, out, err = finish(start(run, steps=12))
    assert code == 0, err
    lines = stderr_lines(err)
    assert len(lines) == 1 and lines[0].startswith(f"warning: checkpoint {run / 'checkpoints' / '8'} "), lines
    assert f"resumed from {run / 'checkpoints'}/4" in out
    code, _, err = finish(start(reference, steps=12))
    assert code == 0, err
    assert logged(run) == logged(reference)
    assert all(np.isfinite(losses).all() for losses in logged(run).values())


# ----------------------------------------------------------------------------------------------
# Finding 2: checkpoint.resume=STEP with newer steps present


def test_resume_at_an_older_step_moves_the_newer_ones_aside(tmp_path):
    run = tmp_path / "run"
    code, _, err = finish(start(run, "--config.checkpoint.keep=3", steps=12))  # 4, 8, 12
    assert code == 0, err
    first_run = logged(run)
    newer = {step: contents(run / "checkpoints" / str(step)) for step in (8, 12)}

    code, out, err = finish(start(run, "--config.checkpoint.keep=3", "--config.checkpoint.resume=4", steps=12))
    assert code == 0, err
    assert "Traceback" not in err and f"resumed from {run / 'checkpoints'}/4" in out
    aside = {int(p.name.split(".")[0]): p for p in (run / "checkpoints_set_aside").iterdir()}
    assert sorted(aside) == [8, 12]
    for step, path in aside.items():
        assert path.name.startswith(f"{step}.newer-than-resume-4.") and contents(path) == newer[step]
    assert sorted(int(p.name) for p in (run / "checkpoints").iterdir()) == [4, 8, 12]  # written again
    for step, losses in logged(run).items():  # steps 5-12 trained twice, identically
        assert all(loss == first_run[step][0] for loss in losses), step


# ----------------------------------------------------------------------------------------------
# Finding 3: a save that fails ends the run at that save

# Runs the trainer with every array write of checkpoint STEP failing as a full disk does; the
# write happens in orbax's background thread, as a real one would fail.
FAILING_WRITES = """
import errno, sys
from orbax.checkpoint._src.serialization import serialization
write = serialization.async_serialize_from_host
async def failing(rslices, spec, **kwargs):
    if "/{step}.orbax-checkpoint-tmp" in str(spec):
        raise OSError(errno.ENOSPC, "No space left on device")
    return await write(rslices, spec, **kwargs)
serialization.async_serialize_from_host = failing
from maxtext_rocm.train import main
sys.exit(main(sys.argv[1:]))
"""


def test_a_failed_save_stops_the_run_at_that_save_and_a_restart_resumes(tmp_path):
    run = tmp_path / "run"
    failing = subprocess.Popen(
        [sys.executable, "-c", FAILING_WRITES.format(step=8), "configs/tiny_llama.py", *SMALL,
         "--config.train.steps=16", f"--config.output_dir={run}"],
        cwd=REPO, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    code, _, err = finish(failing)
    assert code == 2, err
    assert stderr_lines(err) == [
        f"error: saving checkpoint 8 in {run / 'checkpoints'} failed ({__import__('os').strerror(errno.ENOSPC)}); "
        "its partial directory was removed, checkpoints 4 are untouched and a restart resumes from step 4"]
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["4"]
    assert max(logged(run)) < 12  # stopped before the next save, not at it

    code, out, err = finish(start(run, steps=12))
    assert code == 0, err
    assert f"resumed from {run / 'checkpoints'}/4" in out and not stderr_lines(err)


# ----------------------------------------------------------------------------------------------
# Finding 5: one run per output_dir


def test_a_second_trainer_on_the_same_output_dir_stops_at_once(tmp_path):
    run = tmp_path / "run"
    first = start(run, steps=100_000)
    try:
        wait_for_step(run, 5, first)
        config_written = (run / "config.json").stat().st_mtime_ns
        second = start(run, steps=100_000)
        try:
            code, _, err = finish(second, timeout=120)
        except subprocess.TimeoutExpired:
            second.kill()
            second.communicate()
            raise AssertionError("a second trainer ran on beside the first") from None
        assert code == 2
        assert stderr_lines(err) == [
            f"error: output_dir {run} is in use by process {first.pid} on host {socket.gethostname()} "
            f"(since {(run / 'run.lock').read_text().split('(since ')[1].strip()}; wait for that run to end "
            "or give this one another output_dir"]
        assert (run / "config.json").stat().st_mtime_ns == config_written
    finally:
        first.send_signal(signal.SIGKILL)
        first.communicate()
    rows = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert rows == list(range(1, len(rows) + 1))  # the first trainer's rows only
    # The dead holder's lock is free: the next trainer takes it over and resumes.
    steps = sorted(int(p.name) for p in (run / "checkpoints").iterdir() if p.name.isdigit())
    code, out, err = finish(start(run, steps=steps[-1] + 2))
    assert code == 0, err
    assert f"resumed from {run / 'checkpoints'}/{steps[-1]}" in out
    assert f"process {first.pid} " not in (run / "run.lock").read_text()


def test_a_trainer_that_fails_to_start_frees_its_output_dir(devices, tmp_path):
    """A Trainer whose start fails after it took the run lock (here: a resume step that does not
    exist) releases it, so another process (a command-line run beside the notebook) can start there."""
    cfg = small_config(**{"output_dir": str(tmp_path), "checkpoint.resume": "7"})
    with pytest.raises(CheckpointError, match="checkpoint.resume=7 is not a saved step"):
        Trainer(cfg, devices=devices[:1], log=lambda *_: None)
    from maxtext_rocm.runtime import run_lock

    assert str(tmp_path.resolve()) not in run_lock._held  # unlocked: another process could start there
    retry = Trainer(small_config(**{"output_dir": str(tmp_path)}), devices=devices[:1], log=lambda *_: None)
    retry.close()


# ----------------------------------------------------------------------------------------------
# Divergence is never hidden


def poison_from(trainer, first_bad_step):
    batch = trainer.data.batch

    def poisoned(step):
        host = batch(step)
        if step >= first_bad_step:
            host["weights"] = np.full_like(host["weights"], np.nan)
        return host
    trainer.data.batch = poisoned


def test_skipping_stops_after_max_skipped_steps_even_when_it_rarely_logs(devices, tmp_path):
    cfg = small_config(**{"output_dir": str(tmp_path), "train.steps": 30, "log.every": 1000,
                          "checkpoint.every": 0, "train.max_skipped_steps": 3})
    trainer = Trainer(cfg, devices=devices[:2], log=lambda *_: None)
    trainer.run(2)
    good = jax.tree_util.tree_map(np.asarray, trainer.state.params)
    poison_from(trainer, 2)
    with pytest.raises(TrainingDiverged, match=r"inf/NaN in 3 steps in a row \(steps 3-5, train.max_skipped_steps=3\); "
                       "checkpoint 5 holds the last good state"):
        trainer.run()
    # Noticed only at the run's end (its one logging step), the state froze when the limit was hit.
    assert trainer.step_count == 30 and int(trainer.state.step) == 5
    assert int(trainer.state.skipped_in_a_row) == 3 and int(trainer.state.nonfinite_steps) == 3
    saved = restore_params(tmp_path / "checkpoints" / "5", trainer.state.params)
    for a, b, c in zip(jax.tree_util.tree_leaves(trainer.state.params), jax.tree_util.tree_leaves(good),
                       jax.tree_util.tree_leaves(saved)):
        assert np.array_equal(np.asarray(a), b) and np.array_equal(np.asarray(c), b)


def test_isolated_bad_steps_are_skipped_and_the_run_goes_on(devices, tmp_path):
    cfg = small_config(**{"output_dir": str(tmp_path), "train.steps": 8, "log.every": 1,
                          "train.max_skipped_steps": 2})
    trainer = Trainer(cfg, devices=devices[:2], log=lambda *_: None)
    batch = trainer.data.batch

    def poisoned(step):  # bad steps 2, 4 and 6 (0-based): never two in a row
        host = batch(step)
        if step in (1, 3, 5):
            host["weights"] = np.full_like(host["weights"], np.nan)
        return host
    trainer.data.batch = poisoned
    trainer.run()
    assert int(trainer.state.step) == 8 and int(trainer.state.nonfinite_steps) == 3
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["nonfinite_steps"] for r in rows] == [0, 1, 1, 2, 2, 3, 3, 3]


def test_a_state_holding_nan_is_never_checkpointed(devices, tmp_path):
    cfg = small_config(**{"output_dir": str(tmp_path), "train.steps": 4, "checkpoint.every": 2})
    trainer = Trainer(cfg, devices=devices[:2], log=lambda *_: None)
    trainer.run(2)
    params = dict(trainer.state.params)
    params["final_norm"] = {"scale": params["final_norm"]["scale"] * np.float32(np.nan)}
    trainer.state = trainer.state.replace(params=params)
    with pytest.raises(TrainingDiverged, match=r"the state at step 4 holds inf/NaN values \(first in "
                       r"params.final_norm.scale\); it was not saved; checkpoint 2 is the newest good one"):
        trainer.run()
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["2"]


def test_skipping_without_end_exits_3_from_the_command_line(tmp_path):
    run = tmp_path / "run"
    code, _, err = finish(start(run, "--config.optimizer.lr=1e30", "--config.optimizer.clip_norm=0",
                                "--config.checkpoint.every=0", steps=40))  # the default limit, 5
    assert code == 3, err
    lines = stderr_lines(err)
    assert len(lines) == 1 and lines[0].startswith("error: the loss or gradients were inf/NaN in 5 steps in a row"), lines
    step = int(lines[0].split("checkpoint ")[1].split()[0])
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == [str(step)]
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["step"] < 40 and rows[-1]["nonfinite_steps"] == 5


@pytest.mark.slow
def test_sigkill_trials_resume_bit_exact(tmp_path):
    result = subprocess.run([sys.executable, "scripts/kill_trials.py", "--trials", "4", "--workdir", str(tmp_path)],
                            cwd=REPO, env=ENV, capture_output=True, text=True, timeout=1200)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "4 of 4 trials resumed bit-exact" in result.stdout
