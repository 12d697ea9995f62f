"""data.workers: processes that tokenize documents for one data-loading process, so tokenizing
uses more than one core (a tokenizer holds Python's lock: threads would not).

    ReadAhead(stream, pool)          DocumentStream.get with data.workers: the documents after the
                                     one asked for are handed out in chunks ahead of the packer
    WorkerPool(files, settings, n)   n worker processes; tokenize(chunk) hands a chunk of global
                                     document indices to the next worker in turn, result() takes
                                     the oldest chunk's token arrays back (chunks come back in the
                                     order they were handed out, so the stream's order is the
                                     same as with one worker)
    serve(task_fd, result_fd)        a worker's loop: it opens the files itself (the offset index
                                     comes from its sidecar), tokenizes what it is asked for and
                                     writes back only token arrays

The workers are plain `python -c` processes talking over two pipes each, in length-prefixed
frames: a JSON header and raw little-endian int32 / bool bytes; nothing of ours is pickled. They
import the data modules alone (not the package's __init__, which imports jax: seconds and
~150 MB per worker). A worker ignores SIGINT and SIGTERM, whose handling is the trainer's, and
exits when its task pipe closes: on close(), and when its parent exits or is killed, so it never
outlives a run. A worker's DataError comes back as its sentence and is raised in the parent; a
worker that dies is a RuntimeError naming its exit status.
"""
from __future__ import annotations

import json
import os
import signal
import struct
import subprocess
import sys
from collections import deque
from pathlib import Path

import numpy as np

from maxtext_rocm.data.checks import DataError

PACKAGE_ROOT = str(Path(__file__).resolve().parents[2])
# The worker's program: maxtext_rocm as a bare namespace (its __init__ imports jax), then serve().
BOOT = ("import sys, types; sys.path.insert(0, {root!r}); package = types.ModuleType('maxtext_rocm'); "
        "package.__path__ = [{root!r} + '/maxtext_rocm']; sys.modules['maxtext_rocm'] = package; "
        "from maxtext_rocm.data.workers import serve; serve({task}, {result})")
_LENGTH = struct.Struct("<Q")
CHUNK = 16  # documents per chunk handed to a worker: few enough that the packer never waits long
DEPTH = 4  # chunks in flight per worker: each has the next one queued while it works


# -- frames ----------------------------------------------------------------------------------------

def _write(fd: int, payload: bytes) -> None:
    view = memoryview(_LENGTH.pack(len(payload)) + payload)
    while view:
        view = view[os.write(fd, view):]


def _read_exact(fd: int, size: int) -> bytes | None:
    parts, left = [], size
    while left:
        part = os.read(fd, min(left, 1 << 20))
        if not part:
            return None  # the other end closed
        parts.append(part)
        left -= len(part)
    return b"".join(parts)


def _read(fd: int) -> bytes | None:
    head = _read_exact(fd, _LENGTH.size)
    if head is None:
        return None
    return _read_exact(fd, _LENGTH.unpack(head)[0]) if _LENGTH.unpack(head)[0] else b""


# -- the worker ------------------------------------------------------------------------------------

def _open(settings: dict):
    """The worker's documents and its tokenize(index) -> TokenizedExample, as the parent has them."""
    from maxtext_rocm.data.documents import Documents, encoder
    from maxtext_rocm.data.example import as_example
    from maxtext_rocm.data.tokenizer import load_tokenizer

    files = [Path(f) for f in settings["files"]]
    for path, (size, mtime) in zip(files, settings["versions"]):
        stat = path.stat()
        if (stat.st_size, stat.st_mtime_ns) != (size, mtime):
            raise DataError(f"{path} changed since the run opened it ({size:,} bytes then, {stat.st_size:,} now, "
                            "or a new modification time); restore it or start the run again")
    docs = Documents(files, settings["text_field"], check=False)
    encode = encoder(load_tokenizer(settings["tokenizer"]), settings["bos"], settings["eos"])
    return lambda index: as_example(encode(docs[index]))


def _answer(tokenize, indices: np.ndarray) -> list[bytes]:
    examples = [tokenize(int(i)) for i in indices]
    header = {"lengths": [len(e.tokens) for e in examples], "trained": any(e.trained is not None for e in examples)}
    frames = [json.dumps(header).encode(), b"".join(np.asarray(e.tokens, "<i4").tobytes() for e in examples)]
    if header["trained"]:
        frames.append(b"".join((np.ones(len(e.tokens), bool) if e.trained is None else
                                np.asarray(e.trained, bool)).tobytes() for e in examples))
    return frames


def serve(task_fd: int, result_fd: int) -> None:
    """Answer chunks until the task pipe closes. The first frame holds the settings."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    settings = _read(task_fd)
    if settings is None:
        return
    tokenize, failure = None, None
    try:
        tokenize = _open(json.loads(settings))
    except Exception as error:  # noqa: BLE001 - answered to every chunk, raised in the parent
        failure = error
    while (task := _read(task_fd)) is not None:
        try:
            if failure is not None:
                raise failure
            frames = _answer(tokenize, np.frombuffer(task, "<i8"))
        except Exception as error:  # noqa: BLE001 - its sentence goes back to the parent
            user = isinstance(error, DataError) or type(error).__name__ == "DataError"
            frames = [json.dumps({"error": str(error) if user else f"{type(error).__name__}: {error}",
                                  "user": user}).encode()]
        try:
            for frame in frames:
                _write(result_fd, frame)
        except OSError:  # the parent closed its end (close(), or it exited): nothing to answer
            return


# -- the parent's side -------------------------------------------------------------------------------

class WorkerPool:
    """n worker processes for one Documents' files; chunks handed out and taken back in order."""

    def __init__(self, files: list[Path], versions: list[tuple[int, int]], *, text_field: str, tokenizer: str,
                 bos: bool, eos: bool, workers: int):
        settings = json.dumps({"files": [str(Path(f).resolve()) for f in files], "versions": versions,
                               "text_field": text_field, "tokenizer": tokenizer, "bos": bos, "eos": eos}).encode()
        self._procs, self._tasks, self._results = [], [], []
        self._pending: deque[int] = deque()  # the worker of each chunk not yet taken back, oldest first
        self._turn = 0
        try:
            for _ in range(workers):
                task_r, task_w = os.pipe()
                result_r, result_w = os.pipe()
                code = BOOT.format(root=PACKAGE_ROOT, task=task_r, result=result_w)
                proc = subprocess.Popen([sys.executable, "-c", code], pass_fds=(task_r, result_w),
                                        stdin=subprocess.DEVNULL)
                os.close(task_r)
                os.close(result_w)
                self._procs.append(proc)
                self._tasks.append(task_w)
                self._results.append(result_r)
                _write(task_w, settings)
        except BaseException:
            self.close()
            raise

    @property
    def size(self) -> int:
        return len(self._procs)

    @property
    def in_flight(self) -> int:
        return len(self._pending)

    def tokenize(self, indices: np.ndarray) -> None:
        """Hand the documents `indices` (global, in order) to the next worker."""
        worker = self._turn
        self._turn = (self._turn + 1) % len(self._procs)
        try:
            _write(self._tasks[worker], np.asarray(indices, "<i8").tobytes())
        except (BrokenPipeError, OSError):
            raise self._died(worker) from None
        self._pending.append(worker)

    def result(self) -> list:
        """The oldest chunk's TokenizedExamples, in its order (a worker's DataError raised here)."""
        from maxtext_rocm.data.example import TokenizedExample

        worker = self._pending.popleft()
        fd = self._results[worker]
        header = _read(fd)
        if header is None:
            raise self._died(worker)
        header = json.loads(header)
        if "error" in header:
            raise DataError(header["error"]) if header["user"] else RuntimeError(f"data worker: {header['error']}")
        tokens = _read(fd)
        trained = _read(fd) if header["trained"] else None
        if tokens is None or (header["trained"] and trained is None):
            raise self._died(worker)
        ends = np.cumsum(header["lengths"])
        tokens = np.split(np.frombuffer(tokens, "<i4").astype(np.int32), ends[:-1])
        masks = np.split(np.frombuffer(trained, bool).copy(), ends[:-1]) if trained is not None else [None] * len(tokens)
        return [TokenizedExample(t, m) for t, m in zip(tokens, masks)]

    def drain(self) -> None:
        """Take back and drop every chunk in flight (a jump to another position)."""
        while self._pending:
            try:
                self.result()
            except DataError:
                pass

    def _died(self, worker: int) -> RuntimeError:
        proc = self._procs[worker]
        try:
            status = proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            status = "still running, but its pipe closed"
        return RuntimeError(f"data worker {worker} (pid {proc.pid}) exited (status {status}); data.workers="
                            f"{len(self._procs)}: see its error above, or run with data.workers=0")

    def close(self) -> None:
        """Close the task pipes (each worker exits when it reads their end) and reap the workers."""
        for fd in self._tasks + self._results:
            try:
                os.close(fd)
            except OSError:
                pass
        self._tasks, self._results, self._pending = [], [], deque()
        for proc in self._procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:  # busy with a long document: not worth waiting for
                proc.kill()
                proc.wait()
        self._procs = []

    def __del__(self):
        try:
            self.close()
        except Exception:  # noqa: BLE001 - at interpreter exit
            pass


class ReadAhead:
    """A DocumentStream's documents from a WorkerPool: get(epoch, cursor) returns the cursor-th
    document of this process in `epoch`, with the ones after it already being tokenized (DEPTH
    chunks of CHUNK per worker, across epoch ends). Asked for a document it did not hand out ahead
    (a restored or replayed position), it drops what is in flight and starts there."""

    def __init__(self, stream, pool: WorkerPool):
        self.stream, self.pool = stream, pool
        self._ready: dict[tuple[int, int], object] = {}
        self._promised: set[tuple[int, int]] = set()  # handed out ahead, ready or in flight
        self._chunks: deque[list[tuple[int, int]]] = deque()  # each chunk's keys, oldest first
        self._next: tuple[int, int] | None = None  # the next document to hand out

    def get(self, epoch: int, cursor: int):
        key = (epoch, cursor)
        if key not in self._promised:
            self._restart(key)
        while key not in self._ready:
            self._top_up()
            keys = self._chunks.popleft()
            self._ready.update(zip(keys, self.pool.result()))
        example = self._ready.pop(key)
        self._promised.discard(key)
        for passed in [k for k in self._ready if k < key]:  # skipped over by the packer: never asked for again
            del self._ready[passed]
            self._promised.discard(passed)
        self._top_up()
        return example

    def _restart(self, key: tuple[int, int]) -> None:
        self.pool.drain()  # another stream's chunks too, when the pool is reused across restarts
        self._ready, self._promised, self._chunks, self._next = {}, set(), deque(), key

    def _top_up(self) -> None:
        stream = self.stream
        while self.pool.in_flight < DEPTH * self.pool.size:
            epoch, cursor = self._next
            if stream.epochs and epoch >= stream.epochs:
                return  # the data ends here (get raises when the packer gets there)
            order = stream.order(epoch)
            stop = min(cursor + CHUNK, len(order))
            keys = [(epoch, c) for c in range(cursor, stop)]
            self.pool.tokenize(order[cursor:stop])
            self._chunks.append(keys)
            self._promised.update(keys)
            self._next = (epoch, stop) if stop < len(order) else (epoch + 1, 0)
