"""The SHA-256 of each data file's every byte, for the fingerprint a checkpoint keeps (data/resume.py),
taken where the file is read whole anyway, so a file is read once, not twice.

Where: the JSON Lines offset index's streaming pass (data/lineindex.py) hashes the chunks it reads
and keeps the digest in its sidecar, so a later launch over the same version of the file (size and
modification time, as the index itself is keyed) reads neither again; the chat / prompt_completion /
preference records (data/records.py) and the text-file check (data/checks.py) read their files whole
and hash those bytes. Parquet and ArrayRecord files, which nothing reads whole, are streamed once
for it (`file_sha256`), and the digest is kept in a sidecar `.NAME.sha256` beside the file (or in
the temp directory where the data directory is read-only), keyed by size and modification time as
the line index is, so later launches and restarts read nothing again.

Cost, measured on this project's 2-core CI machine (2026-12, shared and loaded): SHA-256 runs at
~710 MB/s on one core over bytes in memory (SHA-NI; BLAKE2b ~375, MD5 ~300) and ~390 MB/s reading a
100 MB file from the page cache; the index pass that checks every line as JSON runs at ~34 MB/s
with the hash in it (~136 MB/s without the check), so the hash is under a tenth of a first indexing.
A 100 GB corpus costs ~2.5-4 minutes of one core once per version of its files (the index pass
itself, ~50 minutes, is what dominates), and nothing at later launches: the sidecar keeps it.
100 GB of Parquet costs those minutes once per version of its files too (the first launch's
processes each stream it, or the disk's read time where that is slower; later launches read the
sidecar).
"""
from __future__ import annotations

import hashlib
import os
import socket
import tempfile
from pathlib import Path

CHUNK = 8 << 20

# Digests by file version (absolute path, size, mtime_ns): the index, the records and the
# fingerprint of one launch (and a restart in the same process) share one reading.
_DIGESTS: dict[tuple, str] = {}


def version(path: Path, stat: os.stat_result | None = None) -> tuple:
    stat = stat or path.stat()
    return (str(Path(path).resolve()), stat.st_size, stat.st_mtime_ns)


def remember(key: tuple, digest: str) -> None:
    """Records the digest of file version `key` (`version`), taken by whoever read the file whole."""
    _DIGESTS[key] = digest


def of_bytes(key: tuple, data: bytes) -> str:
    """The digest of version `key` whose bytes are `data` (read whole by the caller)."""
    if key not in _DIGESTS:
        _DIGESTS[key] = hashlib.sha256(data).hexdigest()
    return _DIGESTS[key]


DIGEST_SUFFIX = ".sha256"


def digest_sidecars(path: Path) -> list[Path]:
    """Where `path`'s digest is kept: `.NAME.sha256` beside it, else in the temp directory (a
    read-only data directory), named by a hash of the file's absolute path."""
    named = hashlib.blake2b(str(Path(path).resolve()).encode(), digest_size=12).hexdigest()
    return [path.parent / f".{path.name}{DIGEST_SUFFIX}",
            Path(tempfile.gettempdir()) / "maxtext_rocm-index" / f"{named}{DIGEST_SUFFIX}"]


def _stored(key: tuple, sidecars: list[Path]) -> str | None:
    """A sidecar's digest where it was taken of this version of the file (`size mtime_ns sha256`)."""
    for sidecar in sidecars:
        try:
            size, mtime_ns, digest = sidecar.read_text().split()
        except (OSError, ValueError):
            continue
        if (int(size), int(mtime_ns)) == key[1:] and len(digest) == 64:
            return digest
    return None


def _store(key: tuple, digest: str, sidecars: list[Path]) -> None:
    """Written whole under a temporary name and renamed (processes storing it at once each write a
    whole one); where no place can be written, later launches hash the file again."""
    for sidecar in sidecars:
        tmp = sidecar.with_name(f"{sidecar.name}.{socket.gethostname()}.{os.getpid()}.tmp")
        try:
            sidecar.parent.mkdir(parents=True, exist_ok=True)
            tmp.write_text(f"{key[1]} {key[2]} {digest}\n")
            os.replace(tmp, sidecar)
            return
        except OSError:
            tmp.unlink(missing_ok=True)


def file_sha256(path: Path) -> str:
    """The SHA-256 of `path`'s bytes: from a pass that read them already or the digest sidecar of
    this version of the file, else read now in chunks (and the sidecar written)."""
    key = version(path)
    if key not in _DIGESTS:
        sidecars = digest_sidecars(Path(path))
        stored = _stored(key, sidecars)
        if stored is None:
            digest = hashlib.sha256()
            with open(path, "rb") as f:
                while chunk := f.read(CHUNK):
                    digest.update(chunk)
            stored = digest.hexdigest()
            _store(key, stored, sidecars)
        _DIGESTS[key] = stored
    return _DIGESTS[key]
