"""Where each JSON line of a file starts: an offset index, so a corpus larger than memory is read one
document at a time (os.pread) instead of whole.

One streaming pass over the file (chunks of CHUNK bytes) finds every non-blank line, checks it (by
default: it is JSON with the text field; the same sentences as before, naming file and line), and
records its start and length as int64. The index is kept in a sidecar file, `.NAME.idx.npy` beside
the data (or in the temp directory when that is read-only), keyed by the file's size and
modification time and by what was checked, so later runs, other processes and the data workers
load it (memory-mapped) instead of reading the corpus again. 16 bytes per document. The same pass
hashes the file (SHA-256, kept in the sidecar's header) for the data fingerprint that checkpoints
keep (data/filehash.py, data/resume.py): the corpus is read once for both.
"""
from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import socket
import tempfile
from pathlib import Path
from typing import Callable, NamedTuple

import numpy as np

from maxtext_rocm.data import filehash
from maxtext_rocm.data.checks import DataError

CHUNK = 8 << 20  # bytes read per step of the index pass: bounded memory whatever the file's size
MAGIC = 0x4D58544A534F4E32  # "MXTJSON2": a sidecar of this layout (an older one is built again)
# MAGIC, size, mtime_ns, check key hash, document count, the file's SHA-256 (4 x int64); then
# starts[n], lengths[n].
HEADER = 9
DIGEST = slice(5, 9)
SIDECAR_PREFIX, SIDECAR_SUFFIX = ".", ".idx.npy"  # and ".idx.npy.lock", taken while one is built

# Indexes built or loaded in this process, by (path, size, mtime, check key): config validation,
# the train source and a restart share one pass even where no sidecar could be written.
_LOADED: dict[tuple, "LineIndex"] = {}


class LineIndex(NamedTuple):
    starts: np.ndarray  # int64 [n]: byte offset of each non-blank line
    lengths: np.ndarray  # int64 [n]: its length in bytes, without the newline

    @property
    def count(self) -> int:
        return len(self.starts)


def is_sidecar(path) -> bool:
    name = Path(path).name
    return name.startswith(SIDECAR_PREFIX) and name.endswith((SIDECAR_SUFFIX, SIDECAR_SUFFIX + ".lock",
                                                             filehash.DIGEST_SUFFIX))


def sidecar_paths(path: Path) -> list[Path]:
    """Where the index of `path` is kept: beside it, else in the temp directory (a read-only data
    directory), named by a hash of the file's absolute path."""
    beside = path.parent / f"{SIDECAR_PREFIX}{path.name}{SIDECAR_SUFFIX}"
    digest = hashlib.blake2b(str(path.resolve()).encode(), digest_size=12).hexdigest()
    return [beside, Path(tempfile.gettempdir()) / "maxtext_rocm-index" / f"{digest}{SIDECAR_SUFFIX}"]


def _key_hash(check_key: str) -> int:
    return int.from_bytes(hashlib.blake2b(check_key.encode(), digest_size=7).digest(), "little")


def line_index(path: Path, check: Callable[[bytes, int], None] | None, check_key: str) -> LineIndex:
    """The index of `path`'s non-blank lines, each passed to `check(line, number)` when it is built
    (`check_key` names that check: a sidecar built with another one is built again). check=None
    (the data workers, whose parent checked the file) takes any sidecar of this version of the file
    and marks one it builds as unchecked."""
    stat = path.stat()
    check_key = check_key if check is not None else ""
    key = (str(path.resolve()), stat.st_size, stat.st_mtime_ns, check_key)
    if key in _LOADED:
        return _LOADED[key]
    header = np.array([MAGIC, stat.st_size, stat.st_mtime_ns, _key_hash(check_key), 0, 0, 0, 0, 0], np.int64)

    def saved():
        for sidecar in sidecar_paths(path):
            found = _load(sidecar, header, any_check=check is None)
            if found is not None:
                filehash.remember(filehash.version(path, stat), found[1])
                return found[0]
        return None

    index = saved()
    if index is None:
        with _building(path):  # the processes of a node start together: one reads the file, the others wait
            index = saved()
            if index is None:
                index, digest = _build(path, check)
                filehash.remember(filehash.version(path, stat), digest)
                header[4] = len(index.starts)
                header[DIGEST] = np.frombuffer(bytes.fromhex(digest), np.int64)
                flat = np.concatenate([header, index.starts, index.lengths])
                any(_save(sidecar, flat) for sidecar in sidecar_paths(path))
    _LOADED[key] = index
    return index


@contextlib.contextmanager
def _building(path: Path):
    """An exclusive lock (flock) on a lock file beside the sidecar, or in the temp directory; no
    lock where neither can be created (each process then reads the file itself)."""
    for sidecar in sidecar_paths(path):
        try:
            sidecar.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(sidecar.with_name(sidecar.name + ".lock"), os.O_CREAT | os.O_RDWR, 0o666)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)  # releases the lock
        return
    yield


def _load(sidecar: Path, header: np.ndarray, any_check: bool) -> tuple[LineIndex, str] | None:
    """(the index, the file's SHA-256) from `sidecar` if it describes the version in `header`."""
    try:
        flat = np.load(sidecar, mmap_mode="r", allow_pickle=False)
    except (OSError, ValueError):
        return None
    if flat.dtype != np.int64 or flat.ndim != 1 or len(flat) < HEADER:
        return None
    if not np.array_equal(flat[:4 - any_check], header[:4 - any_check]):
        return None  # another version of the file, or checked for another field
    n = int(flat[4])
    if len(flat) != HEADER + 2 * n:
        return None
    digest = np.ascontiguousarray(flat[DIGEST]).tobytes().hex()
    return LineIndex(flat[HEADER:HEADER + n], flat[HEADER + n:]), digest


def _save(sidecar: Path, flat: np.ndarray) -> bool:
    """Written to a temporary name and renamed: a process reading it never sees half of one, and
    processes building it at once each write a whole one."""
    tmp = sidecar.with_name(f"{sidecar.name}.{socket.gethostname()}.{os.getpid()}.tmp")  # hosts sharing a disk
    try:
        sidecar.parent.mkdir(parents=True, exist_ok=True)
        with open(tmp, "wb") as f:
            np.save(f, flat, allow_pickle=False)
        os.replace(tmp, sidecar)
        return True
    except OSError:
        try:
            tmp.unlink()
        except OSError:
            pass
        return False


def _build(path: Path, check: Callable[[bytes, int], None] | None) -> tuple[LineIndex, str]:
    """(the index, the file's SHA-256) in one pass over the file in CHUNK-byte reads: a line cut by a
    chunk's end is carried over."""
    starts, lengths, digest = [], [], hashlib.sha256()
    number, offset, carry = 0, 0, b""
    with open(path, "rb") as f:
        while True:
            chunk = f.read(CHUNK)
            digest.update(chunk)
            data = carry + chunk if carry else chunk
            if not chunk:  # the end: a last line without a newline
                pieces, carry = ([data] if data else []), b""
            else:
                pieces = data.split(b"\n")
                carry = pieces.pop()
            chunk_starts, chunk_lengths = [], []
            for piece in pieces:
                number += 1
                if piece.strip():
                    if check is not None:
                        check(piece, number)
                    chunk_starts.append(offset)
                    chunk_lengths.append(len(piece))
                offset += len(piece) + 1
            starts.append(np.asarray(chunk_starts, np.int64))
            lengths.append(np.asarray(chunk_lengths, np.int64))
            if not chunk:
                break
    return LineIndex(np.concatenate(starts), np.concatenate(lengths)), digest.hexdigest()


def line_number(path: Path, offset: int) -> int:
    """The 1-based line number of the line starting at byte `offset` (counted on demand, for an
    error message: the index keeps offsets only)."""
    count, done = 0, 0
    with open(path, "rb") as f:
        while done < offset:
            chunk = f.read(min(CHUNK, offset - done))
            if not chunk:
                break
            count += chunk.count(b"\n")
            done += len(chunk)
    return count + 1


def read_line(fd: int, index: LineIndex, local: int, path: Path) -> bytes:
    start, length = int(index.starts[local]), int(index.lengths[local])
    line = os.pread(fd, length, start)
    if len(line) != length:
        raise DataError(f"{path} is shorter than when it was indexed (line {line_number(path, start)} is cut "
                        "off); it changed while the run was reading it: restore it or start the run again")
    return line
