"""The SHA-256 of each data file's every byte, for the fingerprint a checkpoint keeps (data/resume.py),
taken where the file is read whole anyway, so a file is read once, not twice.

Where: the JSON Lines offset index's streaming pass (data/lineindex.py) hashes the chunks it reads
and keeps the digest in its sidecar, so a later launch over the same version of the file (size and
modification time, as the index itself is keyed) reads neither again; the chat / prompt_completion /
preference records (data/records.py) and the text-file check (data/checks.py) read their files whole
and hash those bytes. Parquet and ArrayRecord files, which nothing reads whole, are streamed once
per process and launch for it (`file_sha256`).

Cost, measured on this project's 2-core CI machine (2026-12, shared and loaded): SHA-256 runs at
~710 MB/s on one core over bytes in memory (SHA-NI; BLAKE2b ~375, MD5 ~300) and ~390 MB/s reading a
100 MB file from the page cache; the index pass that checks every line as JSON runs at ~34 MB/s
with the hash in it (~136 MB/s without the check), so the hash is under a tenth of a first indexing.
A 100 GB corpus costs ~2.5-4 minutes of one core once per version of its files (the index pass
itself, ~50 minutes, is what dominates), and nothing at later launches: the sidecar keeps it.
100 GB of Parquet costs those minutes per process at every launch, or the disk's read time where
that is slower.
"""
from __future__ import annotations

import hashlib
import os
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


def file_sha256(path: Path) -> str:
    """The SHA-256 of `path`'s bytes: from a pass that read them already, else read now in chunks."""
    key = version(path)
    if key not in _DIGESTS:
        digest = hashlib.sha256()
        with open(path, "rb") as f:
            while chunk := f.read(CHUNK):
                digest.update(chunk)
        _DIGESTS[key] = digest.hexdigest()
    return _DIGESTS[key]
