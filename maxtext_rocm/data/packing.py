"""From this process's documents to rows of (input, target) pairs, resumably.

    DocumentStream: this epoch's global order (a permutation drawn from (data.seed, epoch), the
                    same on every process), this process's share of it, one document at a time
    RowPacker:      rows of train.seq_len with segment ids and per-document positions

The position is three integers per process (epoch, document cursor, token offset in the current
document), so a checkpoint keeps it as a small JSON dict and a resumed run sees the batches it
would have seen.
"""
from __future__ import annotations

import numpy as np

from maxtext_rocm.data.checks import DataError
from maxtext_rocm.data.example import as_example


class DocumentStream:
    """This process's documents, epoch after epoch, in a fixed order: `get(epoch, cursor)`.

    Epoch e reads every document once, in the permutation drawn from (seed, e) (or file order
    without shuffling); process p of P takes every P-th of them from the p-th.
    """

    def __init__(self, dataset, seed: int, process_index: int, process_count: int,
                 shuffle: bool = True, epochs: int = 0):
        self.dataset, self.seed, self.shuffle, self.epochs = dataset, seed, shuffle, epochs
        self.process_index, self.process_count = process_index, process_count
        self.num_docs = len(dataset)
        if self.num_docs < process_count:
            raise DataError(f"the data has {self.num_docs} documents, fewer than the {process_count} "
                            "processes that share it; give more documents")
        self._order_epoch, self._order, self._doc_key, self._doc = None, None, None, None

    def order(self, epoch: int) -> np.ndarray:
        """Global document indices this process reads in `epoch`, in order."""
        if self._order_epoch != epoch:
            order = (np.random.default_rng([self.seed, epoch]).permutation(self.num_docs) if self.shuffle
                     else np.arange(self.num_docs))
            self._order_epoch, self._order = epoch, order[self.process_index::self.process_count]
        return self._order

    def per_epoch(self, epoch: int) -> int:
        return len(self.order(epoch))

    def get(self, epoch: int, cursor: int):
        """The cursor-th document of this process in `epoch` (the last one is cached)."""
        key = (epoch, cursor)
        if self._doc_key != key:
            if self.epochs and epoch >= self.epochs:
                raise DataError(f"the data ran out after data.epochs={self.epochs} epochs; raise data.epochs "
                                "(0: no limit) or lower train.steps")
            self._doc_key, self._doc = key, as_example(self.dataset[int(self.order(epoch)[cursor])])
        return self._doc


class RowPacker:
    """Turns a DocumentStream into rows of seq_len (input, target) pairs, resumably.

    Packing places whole documents one after another and starts a new row when the next one does
    not fit (the rest of the row is padding); a document longer than a row is cut into row-sized
    pieces, each its own segment. Without packing a row holds one document, truncated or padded.
    """

    def __init__(self, stream: DocumentStream, seq_len: int, packing: bool = True, name: str = "the data"):
        self.stream, self.seq_len, self.packing = stream, seq_len, packing
        self.name = name  # the files, for errors
        self.epoch, self.cursor, self.offset = 0, 0, 0

    def state(self) -> dict:
        return {"epoch": self.epoch, "cursor": self.cursor, "offset": self.offset}

    def set_state(self, state: dict) -> None:
        self.epoch, self.cursor, self.offset = int(state["epoch"]), int(state["cursor"]), int(state["offset"])

    def _advance(self) -> None:
        self.cursor, self.offset = self.cursor + 1, 0
        if self.cursor >= self.stream.per_epoch(self.epoch):
            self.epoch, self.cursor = self.epoch + 1, 0

    def row(self) -> dict[str, np.ndarray]:
        L = self.seq_len
        out = {"inputs": np.zeros(L, np.int32), "targets": np.zeros(L, np.int32),
               "positions": np.zeros(L, np.int32), "segment_ids": np.zeros(L, np.int32),
               "weights": np.zeros(L, np.float32)}
        fill, segment, skipped = 0, 0, 0
        while fill < L:
            doc, trained = self.stream.get(self.epoch, self.cursor)
            pairs = len(doc) - self.offset - 1
            if pairs < 1:  # a document of one token (or a spent one) predicts nothing
                skipped += 1
                if skipped > self.stream.per_epoch(self.epoch):  # a whole pass gave nothing: never will
                    raise DataError(f"none of the {self.stream.per_epoch(self.epoch)} documents of "
                                    f"{self.name} that this process reads yields two tokens (empty or one-token "
                                    "texts); give longer documents or more of them")
                self._advance()
                continue
            skipped = 0
            if fill and pairs > L - fill and (pairs <= L or not self.packing):
                break  # it fits a fresh row whole (or is a new unpacked row): pad this one
            take = min(pairs, L - fill)
            start = self.offset
            segment += 1
            out["inputs"][fill:fill + take] = doc[start:start + take]
            out["targets"][fill:fill + take] = doc[start + 1:start + take + 1]
            out["positions"][fill:fill + take] = np.arange(take)
            out["segment_ids"][fill:fill + take] = segment
            out["weights"][fill:fill + take] = 1.0 if trained is None else trained[start + 1:start + take + 1]
            fill += take
            if self.packing and take < pairs:
                self.offset += take  # the rest of a long document starts the next row
            else:
                self._advance()  # done with it (without packing, whatever did not fit is dropped)
            if not self.packing:
                break
        return out

    def batch(self, rows: int) -> dict[str, np.ndarray]:
        made = [self.row() for _ in range(rows)]
        return {k: np.stack([r[k] for r in made]) for k in made[0]}
