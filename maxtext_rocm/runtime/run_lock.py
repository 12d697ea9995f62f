"""One run per output directory: an advisory lock on `output_dir/run.lock`.

Two trainers writing one directory interleave metrics.jsonl rows and, worse, each one's orbax
retention policy deletes the other's checkpoints. The lock is `fcntl.flock` on a file in the
directory: the kernel releases it when its holder dies, however it dies (SIGKILL included), so a
stale lock is simply free and the next trainer takes it over without any liveness guessing.
The file's text names the holder (pid, host, start time) for the error the next trainer prints.

Multi-process runs: only process 0 takes it (all processes of one run share the directory, so a
lock per process would have the run's own processes exclude each other); every process learns
whether it got it, so they stop together. On shared filesystems: NFSv4 and most cluster
filesystems implement flock across hosts (NFS clients map it to a byte-range lock on the server;
Lustre needs its `flock` mount option). Where the filesystem refuses locks the run goes on with
one warning, as it did before there was a lock.

A process holds each directory's lock once: a second Trainer in the same process (a notebook
cell run again) shares it. It lasts until the process ends, or until every Trainer of this
process that took it has been closed (`Trainer.close()`, `release`).
"""

from __future__ import annotations

import errno
import fcntl
import os
import socket
import sys
import time
from pathlib import Path

from maxtext_rocm.config import UserError

LOCK_NAME = "run.lock"
_held: dict[str, list[int]] = {}  # resolved output_dir -> [file descriptor holding its lock, holders]


class DirectoryInUse(UserError):
    """Another live process is training in this output_dir."""


def _describe_holder(fd: int) -> str:
    os.lseek(fd, 0, os.SEEK_SET)
    text = os.read(fd, 4096).decode(errors="replace").strip()
    return text or "a process that has not yet written its name"


def acquire(output_dir: str, warn=None) -> None:
    """Takes `output_dir`'s lock for this process, creating the directory if needed; raises
    DirectoryInUse naming the holder if another process has it."""
    warn = warn or (lambda message: print(f"warning: {message}", file=sys.stderr))
    directory = Path(output_dir).absolute()
    key = str(directory.resolve())
    if key in _held:
        _held[key][1] += 1
        return
    path = directory / LOCK_NAME
    if directory.exists() and not directory.is_dir():
        raise UserError(f"output_dir {directory} exists and is not a directory; set output_dir to a writable "
                        "directory")
    try:
        directory.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as error:
        raise UserError(f"cannot create {path} ({error.strerror}); set output_dir to a writable "
                        "directory") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as error:
        if error.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            holder = _describe_holder(fd)
            os.close(fd)
            raise DirectoryInUse(f"output_dir {directory} is in use by {holder}; wait for that run to end "
                                 "or give this one another output_dir") from None
        os.close(fd)  # ENOLCK, EOPNOTSUPP, ENOSYS: a filesystem without locks
        warn(f"{path.parent} does not support file locks ({error.strerror}); nothing stops a second "
             "trainer from using this output_dir at the same time")
        _held[key] = [-1, 1]
        return
    # Ours now (a dead holder's lock is released by the kernel): record who holds it.
    stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"process {os.getpid()} on host {socket.gethostname()} (since {stamp})\n".encode(), 0)
    except OSError as error:  # ENOSPC, EDQUOT, EIO: the run could write nothing else there either
        os.close(fd)
        raise UserError(f"cannot write {path} ({error.strerror}); free space on output_dir's filesystem "
                        "or set output_dir to another directory") from None
    _held[key] = [fd, 1]


def release(output_dir: str) -> None:
    """One holder in this process is done with `output_dir`; the last one unlocks it."""
    key = str(Path(output_dir).absolute().resolve())
    if key not in _held:
        return
    _held[key][1] -= 1
    if _held[key][1] == 0:
        fd, _ = _held.pop(key)
        if fd >= 0:
            os.close(fd)  # closing the only descriptor of the lock releases it


def acquire_for_run(output_dir: str, process_index: int, process_count: int) -> None:
    """`acquire` on process 0; with several processes, all of them raise if process 0 could not."""
    error = None
    if process_index == 0:
        try:
            acquire(output_dir)
        except UserError as raised:
            error = raised
    if process_count > 1:
        import numpy as np
        from jax.experimental import multihost_utils

        failed = multihost_utils.broadcast_one_to_all(np.int32(error is not None))
        if failed and error is None:
            error = DirectoryInUse(f"process 0 of this run could not take {output_dir}/{LOCK_NAME} "
                                   "(its error names the cause)")
    if error is not None:
        raise error
