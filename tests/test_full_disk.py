"""A full disk (issue 34, items 7 and 8): one sentence naming the file and the cause, exit status 2,
and nothing already written damaged: metrics.jsonl never ends in a cut row, and one left so by an
earlier crash is repaired before the next launch appends.

The disk is a real one where this machine allows it (a small tmpfs, as root); elsewhere writes
under the folder are made to fail as a full disk's do (a short write up to the end of the file's
last page, then ENOSPC), in this process.
"""

import errno
import json
import logging
import os
import subprocess

import pytest

from maxtext_rocm.reporting import metrics
from maxtext_rocm.runtime import run_lock
from maxtext_rocm import train
from maxtext_rocm.errors import UserError

PAGE = 4096


class SmallDisk:
    """`path`: a folder on a 256 KiB filesystem; `fill()` takes all its free space."""

    def __init__(self, root, monkeypatch):
        self.path = str(root / "disk")
        os.makedirs(self.path)
        self.mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", self.path],
                                      capture_output=True).returncode == 0
        self.full = False
        if not self.mounted:
            self._inject(monkeypatch)

    def fill(self):
        if not self.mounted:
            self.full = True
            return
        with open(os.path.join(self.path, "filler"), "wb", buffering=0) as f:
            try:
                while True:
                    f.write(b"\0" * PAGE)
            except OSError as error:
                assert error.errno == errno.ENOSPC

    def _inject(self, monkeypatch):
        real_write, real_pwrite = os.write, os.pwrite

        def room(fd):  # bytes left in the file's last page, on a full disk
            try:
                target = os.readlink(f"/proc/self/fd/{fd}")
            except OSError:
                return None
            if not (self.full and target.startswith(self.path + os.sep)):
                return None
            return -os.fstat(fd).st_size % PAGE

        def write(fd, data):
            left = room(fd)
            if left is None:
                return real_write(fd, data)
            if left == 0:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            return real_write(fd, bytes(data[:left]))

        def pwrite(fd, data, offset):
            if room(fd) is not None and offset + len(data) > os.fstat(fd).st_size:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            return real_pwrite(fd, data, offset)
        monkeypatch.setattr(os, "write", write)
        monkeypatch.setattr(os, "pwrite", pwrite)

    def close(self):
        if self.mounted:
            subprocess.run(["umount", "-l", self.path], check=True)


@pytest.fixture
def small_disk(tmp_path, monkeypatch):
    disk = SmallDisk(tmp_path, monkeypatch)
    yield disk
    disk.close()


def test_no_space_for_the_run_lock_is_one_sentence(small_disk, capsys):
    small_disk.fill()
    out = os.path.join(small_disk.path, "run")
    status = train.main(["configs/tiny_llama.py", f"--config.output_dir={out}"])
    err = capsys.readouterr().err.strip().splitlines()
    assert status == 2 and len(err) == 1, err
    assert err[0] == (f"error: cannot write {out}/run.lock (No space left on device); free space on output_dir's "
                      "filesystem or set output_dir to another directory")
    run_lock.release(out)  # nothing held: a no-op


@pytest.mark.parametrize("tensorboard", [False, True])
def test_the_disk_filling_while_metrics_are_written_keeps_whole_rows(small_disk, tensorboard):
    out = os.path.join(small_disk.path, "run")
    writer = metrics.MetricsWriter(out, tensorboard=tensorboard)
    row = {"loss": 2.5, "lr": 1e-3, "grad_norm": 0.75, "step_time_s": 0.125}
    for step in range(3):
        writer.write(step, row)
    small_disk.fill()
    with pytest.raises(UserError, match=r"cannot write .*(metrics\.jsonl|events\.out\.tfevents).* \(No space left "
                                        r"on device\); what it held up to the previous logging step is kept"):
        for step in range(3, 10_000):
            writer.write(step, row)
    writer.close()
    text = open(os.path.join(out, "metrics.jsonl")).read()
    assert text.endswith("\n")
    steps = [json.loads(line)["step"] for line in text.splitlines()]
    assert steps == list(range(len(steps))) and len(steps) >= 3
    if tensorboard:
        from test_metrics import read_scalars  # TensorBoard's own loader: every record's framing and CRC

        events, = (os.path.join(out, "tensorboard", name) for name in os.listdir(os.path.join(out, "tensorboard")))
        assert sorted(read_scalars(events)) == list(range(len(read_scalars(events))))


def test_a_row_cut_short_by_an_earlier_crash_is_removed_before_appending(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "loss": 2.0}\n{"step": 2, "lo')
    warnings = []
    with metrics.MetricsWriter(str(tmp_path), tensorboard=False) as writer:
        writer.write(2, {"loss": 1.5})
    lines = path.read_text().splitlines()
    assert [json.loads(line) for line in lines] == [{"step": 1, "loss": 2.0}, {"step": 2, "loss": 1.5}]
    from maxtext_rocm.reporting.sinks import JsonlFile

    path.write_text('{"step": 1, "lo')  # no whole row at all
    JsonlFile(str(path), warn=warnings.append).close()
    assert path.read_text() == "" and len(warnings) == 1 and "cut short" in warnings[0]


def test_a_failed_async_save_does_not_flood_stderr_with_closed_event_loops(monkeypatch):
    """What the Checkpointer's constructor installs (quiet_orbax_error_logs) drops the callbacks'
    "Event loop is closed" reports that a full disk during an async save set off, and nothing else."""
    import sys
    import types

    from maxtext_rocm.checkpoint import errors as checkpoint_errors

    reported = []
    monkeypatch.setattr(sys, "unraisablehook", reported.append)  # what would reach stderr
    checkpoint_errors.quiet_orbax_error_logs()

    def report(error):
        sys.unraisablehook(types.SimpleNamespace(exc_type=type(error), exc_value=error, exc_traceback=None,
                                                 err_msg="Exception ignored in", object=None))
    for _ in range(240):
        report(RuntimeError("Event loop is closed"))
    assert reported == []
    report(ValueError("something else"))
    assert [str(r.exc_value) for r in reported] == ["something else"]


def test_unread_failures_of_orbax_reads_are_not_reported_at_exit_but_other_tasks_are(caplog):
    """A damaged checkpoint's restore raises its one sentence; the other tensorstore reads that
    failed with it are tasks wrapping a non-coroutine awaitable (asyncio.ensure_future), which
    asyncio reported at exit with a traceback apiece. quiet_orbax_error_logs drops exactly those;
    a failing coroutine is still reported."""
    import asyncio
    import gc

    from maxtext_rocm.checkpoint import errors as checkpoint_errors

    checkpoint_errors.quiet_orbax_error_logs()

    async def leave_failed_tasks():
        failed = asyncio.get_running_loop().create_future()
        failed.set_exception(ValueError("a tensorstore read failed"))

        class Read:  # what a tensorstore future looks like to asyncio: an awaitable, not a coroutine
            def __await__(self):
                return failed.__await__()

        async def coroutine():
            raise KeyError("a coroutine's own failure")

        asyncio.ensure_future(Read())
        asyncio.ensure_future(coroutine())
        await asyncio.sleep(0.01)

    with caplog.at_level(logging.ERROR, logger="asyncio"):
        asyncio.run(leave_failed_tasks())
        gc.collect()
    reports = [r.getMessage() for r in caplog.records if r.name == "asyncio"]
    assert len(reports) == 1 and "coroutine" in reports[0] and "_wrap_awaitable" not in reports[0]
