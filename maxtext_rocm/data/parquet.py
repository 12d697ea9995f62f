"""One Parquet file's rows, read a row group at a time: a corpus larger than memory is never read
whole. Opening reads the footer only (row counts per row group, the schema); a document's text
comes from decoding the text column of the row group that holds it, and the last CACHED row
groups stay decoded, so neighbouring documents (file order, or the documents of one worker's
chunk) cost one decode.

A document-level shuffle would visit row groups at random and decode a whole row group for
nearly every document (0.055M tokens/s on a 200 MB file of 20 MB row groups, against 7M in file
order: docs/figures.md#corpora-larger-than-memory). So where Parquet files are among the data, an
epoch's order is shuffled by blocks (data/packing.py, `block_order`): the row groups in a random
order, CACHED of them at a time, their documents shuffled together; each row group is decoded once
per epoch (per worker). Documents of other files are blocks of one document each.
"""
from __future__ import annotations

from collections import OrderedDict
from pathlib import Path

import numpy as np

from maxtext_rocm.data.checks import DataError

CACHED = 2  # decoded row groups kept per file (their text column; whole rows for record())


def unreadable(path: Path, error: BaseException) -> DataError:
    first = (str(error).strip().splitlines() or [type(error).__name__])[0][:200]
    return DataError(f"{path} cannot be read as Parquet ({first}); it may be truncated or corrupt: write it "
                     "again or leave it out of the data paths")


class ParquetFileRows:
    """len() rows; text(i) the text column's value of row i (None as ""), row(i) the whole row."""

    def __init__(self, path: Path, field: str):
        import pyarrow as pa
        import pyarrow.parquet as pq

        self.path, self.field = path, field
        try:
            meta = pq.ParquetFile(path).metadata
            schema = meta.schema.to_arrow_schema()
        except (pa.ArrowException, OSError) as error:
            raise unreadable(path, error) from None
        if field not in schema.names:
            raise DataError(f"{path} has no column {field!r} (data.text_field); "
                            f"its columns are: {', '.join(schema.names)}")
        kind = schema.field(field).type
        if not (pa.types.is_string(kind) or pa.types.is_large_string(kind) or pa.types.is_null(kind)):
            raise DataError(f"{path} column {field!r} (data.text_field) holds {kind}, not strings")
        self._ends = np.cumsum([meta.row_group(g).num_rows for g in range(meta.num_row_groups)], dtype=np.int64)
        if not len(self._ends) or self._ends[-1] == 0:
            raise DataError(f"{path} has no rows; give it documents")
        self._file = None  # opened on first read (and again in a forked or spawned process)
        self._groups: OrderedDict = OrderedDict()  # (group, columns) -> pyarrow table, most recent last

    def __len__(self) -> int:
        return int(self._ends[-1])

    @property
    def group_ends(self) -> np.ndarray:
        """int64: each row group's end, as a row number (the last is len())."""
        return self._ends

    def _group(self, index: int, whole_rows: bool):
        """(table of the row group holding row `index`, the row's place in it)."""
        import pyarrow as pa
        import pyarrow.parquet as pq

        if not 0 <= index < len(self):
            raise IndexError(f"row {index} of {len(self)}")
        group = int(np.searchsorted(self._ends, index, side="right"))
        key = (group, whole_rows)
        table = self._groups.get(key)
        if table is None:
            try:
                if self._file is None:
                    self._file = pq.ParquetFile(self.path)
                table = self._file.read_row_group(group, columns=None if whole_rows else [self.field])
            except (pa.ArrowException, OSError) as error:
                raise unreadable(self.path, error) from None
            self._groups[key] = table
            while len(self._groups) > CACHED:
                self._groups.popitem(last=False)
        else:
            self._groups.move_to_end(key)
        return table, index - (int(self._ends[group - 1]) if group else 0)

    def text(self, index: int) -> str:
        table, row = self._group(index, whole_rows=False)
        value = table.column(0)[row].as_py()
        return "" if value is None else value if isinstance(value, str) else str(value)

    def row(self, index: int) -> dict:
        table, row = self._group(index, whole_rows=True)
        return table.slice(row, 1).to_pylist()[0]

