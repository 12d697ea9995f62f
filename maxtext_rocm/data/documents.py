"""Reading documents from local files: JSON Lines, Parquet, plain text and pre-tokenized ArrayRecord.

Formats are told by the file name: `.jsonl`/`.json`/`.ndjson` (the `data.text_field` of each line),
`.parquet` (the `data.text_field` column), `.txt`/`.md`/`.text` (a whole file is one document),
`.arrayrecord`/`.array_record` (one record per document: little-endian int32 token ids, already
with BOS/EOS; written by scripts/pretokenize.py).
"""
from __future__ import annotations

import glob
import json
from pathlib import Path

import numpy as np

from maxtext_rocm.data.checks import DataError, check_jsonl, check_text, json_text

JSONL, PARQUET, TEXT, ARRAYRECORD = "jsonl", "parquet", "text", "arrayrecord"
SUFFIXES = {".jsonl": JSONL, ".json": JSONL, ".ndjson": JSONL, ".parquet": PARQUET,
            ".txt": TEXT, ".text": TEXT, ".md": TEXT, ".arrayrecord": ARRAYRECORD, ".array_record": ARRAYRECORD}
META_SUFFIX = ".meta.json"  # beside an ArrayRecord file: the tokenizer it was written with


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
        matched = [m for m in matched if Path(m).is_file() and not m.endswith(META_SUFFIX)]
        if not matched:
            raise DataError(f"{key}: {pattern!r} matches no file")
        files += [Path(m) for m in matched if Path(m) not in files]
    return files


class Documents:
    """Random access to every document of a list of files: text (str) or token ids (int32 array).

    JSON Lines and text are held as raw bytes and decoded on access; Parquet columns are read
    whole; ArrayRecord files are read lazily through grain's ArrayRecordDataSource.
    """

    def __init__(self, files: list[Path], text_field: str = "text"):
        self.text_field = text_field
        self._parts = []  # (kind, path, items): items a list, or a grain data source
        self.pretokenized = None
        self.meta = {}
        for path in files:
            kind = file_format(path)
            if path.stat().st_size == 0:
                raise DataError(f"{path} is empty; remove it from the data paths or give it documents")
            if (kind == ARRAYRECORD) != bool(self.pretokenized) and self.pretokenized is not None:
                raise DataError(f"{path}: pre-tokenized ArrayRecord files cannot be mixed with text files")
            self.pretokenized = kind == ARRAYRECORD
            self._parts.append((kind, path, self._read(kind, path)))
        self._ends = np.cumsum([len(items) for _, _, items in self._parts])
        if not files or self._ends[-1] == 0:
            raise DataError(f"{files[0] if files else 'data.paths'} holds no documents")

    def _read(self, kind: str, path: Path):
        if kind == JSONL:
            numbered = [(n, line) for n, line in enumerate(path.read_bytes().splitlines(), 1) if line.strip()]
            if not numbered:
                raise DataError(f"{path} is empty (no JSON lines); give it documents")
            check_jsonl(numbered, self.text_field, path)
            return [line for _, line in numbered]
        if kind == TEXT:
            check_text(path)
            return [path]
        if kind == PARQUET:
            import pyarrow as pa
            import pyarrow.parquet as pq

            try:
                schema = pq.read_schema(path)
                if self.text_field not in schema.names:
                    raise DataError(f"{path} has no column {self.text_field!r} (data.text_field); "
                                    f"its columns are: {', '.join(schema.names)}")
                column = pq.read_table(path, columns=[self.text_field]).column(0)
                if not (pa.types.is_string(column.type) or pa.types.is_large_string(column.type)
                        or pa.types.is_null(column.type)):
                    raise DataError(f"{path} column {self.text_field!r} (data.text_field) holds {column.type}, "
                                    "not strings")
                column = column.to_pylist()
            except (pa.ArrowException, OSError) as error:
                first = (str(error).strip().splitlines() or [type(error).__name__])[0][:200]
                raise DataError(f"{path} cannot be read as Parquet ({first}); it may be truncated or "
                                "corrupt: write it again or leave it out of the data paths") from None
            if not column:
                raise DataError(f"{path} has no rows; give it documents")
            return column
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

    def __getitem__(self, index: int):
        part = int(np.searchsorted(self._ends, index, side="right"))
        kind, path, items = self._parts[part]
        local = index - (int(self._ends[part - 1]) if part else 0)
        try:
            item = items[local]
        except (RuntimeError, OSError, ValueError) as error:  # an ArrayRecord damaged after its footer was read
            if kind != ARRAYRECORD:
                raise
            raise unreadable_arrayrecord(path, error) from None
        if kind == JSONL:
            return json_text(item, self.text_field, path, local + 1)
        if kind == TEXT:
            return item.read_text(encoding="utf-8")  # checked to be UTF-8 when it was listed
        if kind == PARQUET:
            return item if isinstance(item, str) else ("" if item is None else str(item))
        return np.frombuffer(item, dtype="<i4").astype(np.int32)


def unreadable_arrayrecord(path: Path, error: BaseException) -> DataError:
    first = (str(error).strip().splitlines() or [type(error).__name__])[0][:200]
    return DataError(f"{path} cannot be read as ArrayRecord ({first}); it may be truncated or corrupt: write it "
                     "again with scripts/pretokenize.py or leave it out of the data paths")



def tokenized_dataset(docs: Documents, tokenizer, bos: bool, eos: bool):
    """grain.MapDataset of int32 token arrays, one per document (tokenized when read)."""
    import grain

    dataset = grain.MapDataset.source(docs)
    if docs.pretokenized:
        return dataset
    bos = bos and tokenizer.bos_id is not None
    eos = eos and tokenizer.eos_id is not None
    return dataset.map(lambda text: np.asarray(tokenizer.encode(text, bos=bos, eos=eos), np.int32))
