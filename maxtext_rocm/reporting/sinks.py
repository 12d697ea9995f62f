"""Where logged scalars go: metrics.jsonl (one JSON row per logging step), TensorBoard event files
(tensorboardX) and, when log.wandb_project names one, a Weights & Biases run (online, or offline
under WANDB_MODE=offline, which wandb itself reads).

Each sink is opened by process 0 only (MetricsWriter decides) and takes the same scalars.
"""

from __future__ import annotations

import importlib
import os
import socket
import struct
import sys
import time
from typing import Any, Mapping

from maxtext_rocm.errors import UserError


class WholeRecordFile:
    """Records appended to one file, each whole or not at all: each goes out in one write, and a
    write that fails (a full disk) truncates the file back to its last whole record and raises one
    sentence naming the file and the cause."""

    def __init__(self, path: str):
        self.path = path
        self._fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_APPEND, 0o644)
        self._size = os.fstat(self._fd).st_size

    def write_bytes(self, data: bytes) -> None:
        written = 0
        try:
            while written < len(data):  # a short write (a nearly full disk) goes on where it stopped
                written += os.write(self._fd, data[written:])
        except OSError as error:
            try:
                os.ftruncate(self._fd, self._size)  # back to the last whole record
            except OSError:
                pass
            raise UserError(f"cannot write {self.path} ({error.strerror}); what it held up to the previous "
                            "logging step is kept; free space on output_dir's filesystem and resume the run") from None
        self._size += len(data)

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


class JsonlFile(WholeRecordFile):
    """metrics.jsonl: one JSON row per line. A file left ending in a cut row by an earlier launch
    that died while writing it (a kill, a power cut) is repaired on open, with one warning, so
    that this launch never appends onto the cut row."""

    def __init__(self, path: str, warn=None):
        super().__init__(path)
        warn = warn or (lambda message: print(f"warning: {message}", file=sys.stderr))
        kept = self._complete_length()
        if kept < self._size:
            os.ftruncate(self._fd, kept)
            warn(f"{path} ended in a row cut short by an earlier launch ({self._size - kept} bytes without a "
                 "line end); removed that row, the rows before it are kept")
            self._size = kept

    def _complete_length(self) -> int:
        """Bytes up to and including the file's last line end."""
        end = self._size
        while end > 0:
            start = max(0, end - 65536)
            cut = os.pread(self._fd, end - start, start).rfind(b"\n")
            if cut >= 0:
                return start + cut + 1
            end = start
        return 0

    def write(self, line: str) -> None:
        self.write_bytes((line + "\n").encode())


def _import_tensorboardx():
    """tensorboardX, imported without torch.

    tensorboardX's writer module imports torch whenever torch is installed, only so that it can
    accept torch tensors; that costs a training process start-up time and memory before its first
    step (docs/figures.md#tensorboardx-without-torch), and scalars never need it. A `None` entry in
    sys.modules makes `import torch` raise ImportError, which tensorboardX handles; the entry is
    removed at once, so torch imports normally afterwards (a notebook that imported torch first
    keeps it: nothing is hidden then).
    """
    if "tensorboardX" in sys.modules or "torch" in sys.modules:
        return importlib.import_module("tensorboardX")
    sys.modules["torch"] = None
    try:
        return importlib.import_module("tensorboardX")
    finally:
        del sys.modules["torch"]


class TensorBoardSink:
    """One event per step holding all its scalars, in a new events.out.tfevents.* file in `logdir`.

    The records are framed here (TFRecord: length, its masked CRC-32C, data, its CRC) and written
    in the calling thread, each whole or not at all (WholeRecordFile), rather than by tensorboardX's
    background thread: a full disk is then one sentence from the step that hit it, not a traceback
    from a thread and another at exit.
    """

    def __init__(self, logdir: str):
        _import_tensorboardx()
        from tensorboardX.proto.event_pb2 import Event
        from tensorboardX.proto.summary_pb2 import Summary
        from tensorboardX.record_writer import masked_crc32c

        self._event, self._summary, self._crc = Event, Summary, masked_crc32c
        os.makedirs(logdir, exist_ok=True)
        name = f"events.out.tfevents.{str(time.time())[:10]}.{socket.gethostname()}"
        self._file = WholeRecordFile(os.path.join(logdir, name))
        self._write_event(Event(wall_time=time.time(), file_version="brain.Event:2"))

    def _write_event(self, event) -> None:
        data = event.SerializeToString()
        header = struct.pack("Q", len(data))
        self._file.write_bytes(header + struct.pack("I", self._crc(header)) + data
                               + struct.pack("I", self._crc(data)))

    def write(self, step: int, scalars: Mapping[str, float]) -> None:
        # Summary protos directly rather than SummaryWriter.add_scalar: add_scalar warns on every NaN,
        # and a NaN loss is worth drawing (it shows where a run diverged), not worth a warning a step.
        values = [self._summary.Value(tag=tag, simple_value=value) for tag, value in scalars.items()]
        self._write_event(self._event(wall_time=time.time(), step=int(step), summary=self._summary(value=values)))

    def close(self) -> None:
        self._file.close()


class WandbSink:
    """A Weights & Biases run in project `project`, its files under `directory`/wandb, with the
    resolved config as the run's config."""

    def __init__(self, project: str, run_name: str, run_config: Mapping[str, Any] | None, directory: str):
        try:
            import wandb
        except ImportError:
            raise UserError(
                f"log.wandb_project={project!r} needs the wandb package, which is not installed; "
                "install it with pip install -e '.[wandb]' or leave log.wandb_project empty") from None
        try:
            self._run = wandb.init(project=project, name=run_name or None, dir=directory,
                                   config=dict(run_config or {}))
        except wandb.errors.Error as error:  # no API key, no network, no such entity
            raise UserError(
                f"log.wandb_project={project!r}: W&B could not start a run ({error}); log in with "
                "`wandb login` or WANDB_API_KEY, or set WANDB_MODE=offline to keep the run on disk") from None

    def write(self, step: int, scalars: Mapping[str, float]) -> None:
        self._run.log(dict(scalars), step=int(step))

    def close(self) -> None:
        self._run.finish()
