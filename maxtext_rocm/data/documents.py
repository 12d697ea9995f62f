"""Reading documents from local files: JSON Lines, Parquet, plain text and pre-tokenized ArrayRecord.

Formats are told by the file name: `.jsonl`/`.json`/`.ndjson` (the `data.text_field` of each line),
`.parquet` (the `data.text_field` column), `.txt`/`.md`/`.text` (a whole file is one document),
`.arrayrecord`/`.array_record` (one record per document: little-endian int32 token ids, already
with BOS/EOS; written by scripts/pretokenize.py).
"""
from __future__ import annotations

import glob
import json
import os
from pathlib import Path

import numpy as np

from maxtext_rocm.data.checks import DataError, check_text, json_record, json_text
from maxtext_rocm.data.lineindex import LineIndex, is_sidecar, line_index, line_number, read_line
from maxtext_rocm.data.parquet import ParquetFileRows

JSONL, PARQUET, TEXT, ARRAYRECORD = "jsonl", "parquet", "text", "arrayrecord"
SUFFIXES = {".jsonl": JSONL, ".json": JSONL, ".ndjson": JSONL, ".parquet": PARQUET,
            ".txt": TEXT, ".text": TEXT, ".md": TEXT, ".arrayrecord": ARRAYRECORD, ".array_record": ARRAYRECORD}
META_SUFFIX = ".meta.json"  # beside an ArrayRecord file: the tokenizer it was written with
MAX_OPEN = 64  # JSON Lines files held open at once by one Documents (a corpus of many shards)


def file_format(path: Path) -> str:
    kind = SUFFIXES.get(path.suffix.lower())
    if kind is None:
        raise DataError(f"{path} has no known data format; name it .jsonl, .parquet, .txt or .arrayrecord")
    return kind


def expand_paths(spec, key: str = "data.paths") -> list[Path]:
    """The sorted files that comma-separated paths or globs name; a pattern matching nothing is an error."""
    patterns = [p.strip() for p in spec.split(",")] if isinstance(spec, str) else [str(p) for p in spec]
    patterns = [p for p in patterns if p]
    if not patterns:
        raise DataError(f"{key} is empty; give one or more files or globs, comma-separated")
    files = []
    for pattern in patterns:
        matched = sorted(glob.glob(str(Path(pattern).expanduser()), recursive=True))
        matched = [m for m in matched if Path(m).is_file() and not m.endswith(META_SUFFIX) and not is_sidecar(m)]
        if not matched:
            raise DataError(f"{key}: {pattern!r} matches no file")
        files += [Path(m) for m in matched if Path(m) not in files]
    return files


class Documents:
    """Random access to every document of a list of files: text (str) or token ids (int32 array),
    without holding the files in memory.

    JSON Lines are read a line at a time through an offset index (data/lineindex.py: one streaming
    pass that also checks every line, kept in a sidecar file); Parquet a row group at a time (the
    one that holds the document; the last two are cached); text files when asked for; ArrayRecord
    files through grain's ArrayRecordDataSource. `record(i)` gives a document's whole record (every
    field of its JSON line or Parquet row), `where(i)` its file and line or row, for messages.
    `check=False` skips the line checks where an index has to be built (the data workers, whose
    parent process checked the files). `record_check(record, where)` replaces the check that each
    JSON line holds a string text field, for records of other shapes (a chat's `messages`): it
    raises a DataError naming `where` ("FILE line N") for a record it cannot use.
    """

    def __init__(self, files: list[Path], text_field: str = "text", check: bool = True, record_check=None):
        self.text_field, self.files, self.record_check = text_field, list(files), record_check
        self._parts = []  # (kind, path, items): a LineIndex, a ParquetFileRows, [path] or a grain source
        self._fds: dict[int, int] = {}  # part -> open file descriptor (JSON Lines), opened on first read
        self._pid = os.getpid()
        self.pretokenized = None
        self.meta = {}
        self.versions = []  # (size, mtime_ns) of each file as it was opened: the workers check theirs
        for path in files:
            kind = file_format(path)
            stat = path.stat()
            self.versions.append((stat.st_size, stat.st_mtime_ns))
            if stat.st_size == 0:
                raise DataError(f"{path} is empty; remove it from the data paths or give it documents")
            if (kind == ARRAYRECORD) != bool(self.pretokenized) and self.pretokenized is not None:
                raise DataError(f"{path}: pre-tokenized ArrayRecord files cannot be mixed with text files")
            self.pretokenized = kind == ARRAYRECORD
            self._parts.append((kind, path, self._open(kind, path, check)))
        self._ends = np.cumsum([items.count if kind == JSONL else len(items) for kind, _, items in self._parts])
        if not files or self._ends[-1] == 0:
            raise DataError(f"{files[0] if files else 'data.paths'} holds no documents")

    def _open(self, kind: str, path: Path, check: bool):
        if kind == JSONL:
            field, record_check = self.text_field, self.record_check

            def check_line(line: bytes, number: int) -> None:
                if record_check is None:
                    json_text(line, field, path, number)
                else:
                    record_check(json_record(line, path, number), f"{path} line {number}")

            # What was checked, for the sidecar: another check reads the file again.
            key = (f"text_field={field}" if record_check is None else
                   f"record_check={record_check.__module__}.{record_check.__qualname__}")
            index = line_index(path, check_line if check else None, key)
            if not index.count:
                raise DataError(f"{path} is empty (no JSON lines); give it documents")
            return index
        if kind == TEXT:
            if check:
                check_text(path)
            return [path]
        if kind == PARQUET:
            return ParquetFileRows(path, self.text_field)
        import grain

        meta_path = Path(str(path) + META_SUFFIX)
        if meta_path.is_file():
            self.meta = json.loads(meta_path.read_text())
        try:
            source = grain.sources.ArrayRecordDataSource([str(path)])
        except (RuntimeError, OSError, ValueError) as error:  # array_record's reader: truncated or not one
            raise unreadable_arrayrecord(path, error) from None
        if len(source) == 0:
            raise DataError(f"{path} holds no records; give it documents")
        return source

    def __len__(self) -> int:
        return int(self._ends[-1])

    def blocks(self) -> np.ndarray | None:
        """Where Parquet files are among these: the end (a document index) of each block of documents
        read together, for a shuffle by blocks (a Parquet row group; one document of any other file).
        None where every document is read alone cheaply (shuffled one by one)."""
        if not any(kind == PARQUET for kind, _, _ in self._parts):
            return None
        ends, start = [], 0
        for (kind, _, items), end in zip(self._parts, self._ends):
            ends.append(items.group_ends + start if kind == PARQUET else np.arange(start + 1, end + 1, dtype=np.int64))
            start = int(end)
        return np.concatenate(ends)

    def _locate(self, index: int):
        if not 0 <= index < len(self):
            raise IndexError(f"document {index} of {len(self)}")
        part = int(np.searchsorted(self._ends, index, side="right"))
        kind, path, items = self._parts[part]
        return part, kind, path, items, index - (int(self._ends[part - 1]) if part else 0)

    def _line(self, part: int, path: Path, index: LineIndex, local: int) -> bytes:
        if self._pid != os.getpid():  # a forked copy: descriptors share their parent's file offsets
            self._fds, self._pid = {}, os.getpid()
        fd = self._fds.get(part)
        if fd is None:
            if len(self._fds) >= MAX_OPEN:  # many shards: keep a bounded number open
                os.close(self._fds.pop(next(iter(self._fds))))
            fd = self._fds[part] = os.open(path, os.O_RDONLY)
        return read_line(fd, index, local, path)

    def __getitem__(self, index: int):
        part, kind, path, items, local = self._locate(int(index))
        if kind == JSONL:
            line = self._line(part, path, items, local)
            try:
                return json_text(line, self.text_field, path, local + 1)
            except DataError:  # changed since it was checked: name the real line
                json_text(line, self.text_field, path, line_number(path, int(items.starts[local])))
                raise
        if kind == TEXT:
            return items[local].read_text(encoding="utf-8")  # checked to be UTF-8 when it was listed
        if kind == PARQUET:
            return items.text(local)
        try:
            item = items[local]
        except (RuntimeError, OSError, ValueError) as error:  # an ArrayRecord damaged after its footer was read
            raise unreadable_arrayrecord(path, error) from None
        return np.frombuffer(item, dtype="<i4").astype(np.int32)

    def record(self, index: int) -> dict:
        """Document `index`'s whole record: its JSON line as a dict, its Parquet row (every column),
        {text_field: text} for a text file; a pre-tokenized one has no record (TypeError)."""
        part, kind, path, items, local = self._locate(int(index))
        if kind == JSONL:
            line = self._line(part, path, items, local)
            record = json_record(line, path, local + 1)  # checked to parse when it was indexed
            if not isinstance(record, dict):
                raise DataError(f"{self.where(index)} is not a JSON object")
            return record
        if kind == PARQUET:
            return items.row(local)
        if kind == TEXT:
            return {self.text_field: self[index]}
        raise TypeError(f"{path} is pre-tokenized: its documents are token ids, not records")

    def where(self, index: int) -> str:
        """'FILE line N' (JSON Lines), 'FILE row N' (Parquet, 1-based) or the file, for a message."""
        part, kind, path, items, local = self._locate(int(index))
        if kind == JSONL:
            return f"{path} line {line_number(path, int(items.starts[local]))}"
        return f"{path} row {local + 1}" if kind == PARQUET else str(path)

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds = {}

    def __del__(self):
        try:
            if self._pid == os.getpid():
                self.close()
        except (AttributeError, TypeError, OSError):  # half-built, or at interpreter exit
            pass


def unreadable_arrayrecord(path: Path, error: BaseException) -> DataError:
    first = (str(error).strip().splitlines() or [type(error).__name__])[0][:200]
    return DataError(f"{path} cannot be read as ArrayRecord ({first}); it may be truncated or corrupt: write it "
                     "again with scripts/pretokenize.py or leave it out of the data paths")



def encoder(tokenizer, bos: bool, eos: bool):
    """text -> int32 token ids with BOS/EOS where the tokenizer has them: the one tokenization of a
    document, used by the grain map below and by the data workers (data/workers.py)."""
    bos = bos and tokenizer.bos_id is not None
    eos = eos and tokenizer.eos_id is not None
    return lambda text: np.asarray(tokenizer.encode(text, bos=bos, eos=eos), np.int32)


def tokenized_dataset(docs: Documents, tokenizer, bos: bool, eos: bool):
    """grain.MapDataset of int32 token arrays, one per document (tokenized when read)."""
    import grain

    dataset = grain.MapDataset.source(docs)
    if docs.pretokenized:
        return dataset
    return dataset.map(encoder(tokenizer, bos, eos))
