"""From this process's documents to rows of (input, target) pairs, resumably.

    DocumentStream: this epoch's global order (a permutation drawn from (data.seed, epoch), the
                    same on every process), this process's share of it, one document at a time
    RowPacker:      rows of train.seq_len with segment ids and per-document positions

The position is three integers per process (epoch, document cursor, token offset in the current
document; under best_fit: epoch, the window's first document, rows of the window handed out), so
a checkpoint keeps it as a small JSON dict and a resumed run sees the batches it would have seen.
"""
from __future__ import annotations

import numpy as np

from maxtext_rocm.data.best_fit import Piece, plan_window
from maxtext_rocm.data.checks import DataError
from maxtext_rocm.data.example import as_example


class DocumentStream:
    """This process's documents, epoch after epoch, in a fixed order: `get(epoch, cursor)`.

    Epoch e reads every document once, in the permutation drawn from (seed, e) (or file order
    without shuffling); process p of P takes every P-th of them from the p-th.
    """

    def __init__(self, dataset, seed: int, process_index: int, process_count: int,
                 shuffle: bool = True, epochs: int = 0, pool=None, blocks=None):
        self.dataset, self.seed, self.shuffle, self.epochs = dataset, seed, shuffle, epochs
        self.blocks = blocks  # Documents.blocks(): shuffle by blocks (Parquet row groups), or None
        self.process_index, self.process_count = process_index, process_count
        self.num_docs = len(dataset)
        if self.num_docs < process_count:
            raise DataError(f"the data has {self.num_docs} documents, fewer than the {process_count} "
                            "processes that share it; give more documents")
        self._orders: dict[int, np.ndarray] = {}  # this epoch's and the next (read ahead across the end)
        self._doc_key, self._doc = None, None
        # data.workers: documents tokenized by worker processes, in this order (data/workers.py)
        self._ahead = None
        if pool is not None:
            from maxtext_rocm.data.workers import ReadAhead

            self._ahead = ReadAhead(self, pool)

    def order(self, epoch: int) -> np.ndarray:
        """Global document indices this process reads in `epoch`, in order."""
        if epoch not in self._orders:
            rng = np.random.default_rng([self.seed, epoch])
            order = (np.arange(self.num_docs) if not self.shuffle else rng.permutation(self.num_docs)
                     if self.blocks is None else block_order(rng, self.blocks))
            while len(self._orders) >= 2:
                self._orders.pop(min(self._orders))
            self._orders[epoch] = order[self.process_index::self.process_count]
        return self._orders[epoch]

    def per_epoch(self, epoch: int) -> int:
        return len(self.order(epoch))

    def get(self, epoch: int, cursor: int):
        """The cursor-th document of this process in `epoch` (the last one is cached)."""
        key = (epoch, cursor)
        if self._doc_key != key:
            if self.epochs and epoch >= self.epochs:
                raise DataError(f"the data ran out after data.epochs={self.epochs} epochs; raise data.epochs "
                                "(0: no limit) or lower train.steps")
            self._doc = (self._ahead.get(epoch, cursor) if self._ahead is not None else
                         as_example(self.dataset[int(self.order(epoch)[cursor])]))
            self._doc_key = key
        return self._doc


# data.packing: how documents become rows (RowPacker; docs/data.md#packing compares them).
PACKING_MODES = ("concat", "best_fit", "none")
PACKING_HELP = ("'concat' (rows filled to the last token, documents continuing into the next row), "
                "'best_fit' (whole documents, best-fit over data.packing_window documents) or "
                "'none' (one document per row, truncated or padded)")


def packing_mode(value) -> str:
    """data.packing checked: one of PACKING_MODES. The booleans of earlier versions are refused
    with what replaced them: true packed whole documents greedily, which no mode does exactly now."""
    if isinstance(value, str) and value in PACKING_MODES:
        return value
    hint = {"true": " (true packed whole documents greedily: 'concat' now fills rows to the last token, "
                    "'best_fit' keeps documents whole)",
            "false": " (what false did is now 'none')"}.get(str(value).lower(), "")
    raise DataError(f"data.packing={value!r} is not valid{hint}; choose {PACKING_HELP}")


def block_order(rng: np.random.Generator, ends: np.ndarray, window: int = 2) -> np.ndarray:
    """Every document once: the blocks (ending at `ends`) in a random order, `window` blocks at a
    time, the documents of each window in a random order. A Parquet row group is decoded once per
    window (data/parquet.py keeps the last two decoded) instead of once per document."""
    ends = np.asarray(ends, np.int64)
    window_of_block = rng.permutation(len(ends)) // window
    block_of_doc = np.repeat(np.arange(len(ends)), np.diff(ends, prepend=0))
    return np.lexsort((rng.random(int(ends[-1])), window_of_block[block_of_doc]))


class RowPacker:
    """Turns a DocumentStream into rows of seq_len (input, target) pairs, resumably.

    Every piece of a document in a row is its own segment (ids 1, 2, ... in the row, 0 is
    padding) with positions from 0, so attention never crosses documents and rotary positions
    restart. The modes (data.packing):

    - "concat": documents one after another, a document that does not fit continuing into the
      next row; rows are full, padding appears only at the very end of finite data (data.epochs).
      State: (epoch, document cursor, token offset in that document).
    - "best_fit": whole documents (cut only when longer than a row) placed by best-fit decreasing
      over windows of `window` documents (data/best_fit.py); the rest of each row is padding.
      State: (epoch, the window's first document, rows of the window already handed out).
    - "none": one document per row, truncated or padded. State as for concat (offset 0).
    """

    def __init__(self, stream: DocumentStream, seq_len: int, packing: str = "concat", window: int = 512,
                 name: str = "the data"):
        self.stream, self.seq_len, self.packing = stream, seq_len, packing_mode(packing)
        if window < 1:
            raise DataError(f"data.packing_window={window!r} is not valid; use a number of documents >= 1")
        self.window = window
        self.name = name  # the files, for errors
        self.epoch, self.cursor, self.offset = 0, 0, 0
        self._plan = None  # best_fit: the current window's rows (best_fit.WindowPlan)

    def state(self) -> dict:
        return {"epoch": self.epoch, "cursor": self.cursor, "offset": self.offset}

    def set_state(self, state: dict) -> None:
        self.epoch, self.cursor, self.offset = int(state["epoch"]), int(state["cursor"]), int(state["offset"])

    # -- the position ---------------------------------------------------------------------------

    def _exhausted(self) -> bool:
        """Past the last epoch of finite data (data.epochs)."""
        epochs = getattr(self.stream, "epochs", 0)
        return bool(epochs) and self.epoch >= epochs

    def _advance(self, documents: int = 1) -> None:
        self.cursor, self.offset = self.cursor + documents, 0
        if self.cursor >= self.stream.per_epoch(self.epoch):
            self.epoch, self.cursor = self.epoch + 1, 0

    def _nothing_to_predict(self) -> DataError:
        return DataError(f"none of the {self.stream.per_epoch(self.epoch)} documents of {self.name} that this "
                         "process reads yields two tokens (empty or one-token texts); give longer documents or "
                         "more of them")

    def _next_document(self):
        """The document at the position with a pair left to predict (skipping spent and one-token
        ones), or None where the data ended (finite epochs)."""
        skipped = 0
        while not self._exhausted():
            doc = self.stream.get(self.epoch, self.cursor)
            if len(doc.tokens) - self.offset - 1 >= 1:
                return doc
            skipped += 1
            if skipped > self.stream.per_epoch(self.epoch):  # a whole pass gave nothing: never will
                raise self._nothing_to_predict()
            self._advance()
        return None

    # -- the modes: each returns a row's pieces and moves the position past them -----------------

    def _concat_pieces(self) -> list[Piece]:
        pieces, fill = [], 0
        while fill < self.seq_len:
            doc = self._next_document()
            if doc is None:
                break  # the end of finite data: the rest of this row is padding
            pairs = len(doc.tokens) - self.offset - 1
            take = min(pairs, self.seq_len - fill)
            pieces.append(Piece(doc, self.offset, take))
            fill += take
            if take < pairs:
                self.offset += take  # the rest of the document starts the next row
            else:
                self._advance()
        return pieces

    def _single_pieces(self) -> list[Piece]:
        doc = self._next_document()
        if doc is None:
            return []
        self._advance()  # whatever does not fit the row is dropped
        return [Piece(doc, 0, min(len(doc.tokens) - 1, self.seq_len))]

    def _best_fit_pieces(self) -> list[Piece]:
        plan, examined = self._plan, 0
        while plan is None or (plan.epoch, plan.start) != (self.epoch, self.cursor) or self.offset >= len(plan.rows):
            if plan is not None and (plan.epoch, plan.start) == (self.epoch, self.cursor):
                self._advance(plan.end - plan.start)  # a window with nothing left (or nothing at all)
                examined += plan.end - plan.start
                if examined > self.stream.per_epoch(plan.epoch):
                    raise self._nothing_to_predict()
            if self._exhausted():
                return []
            end = min(self.cursor + self.window, self.stream.per_epoch(self.epoch))
            docs = [self.stream.get(self.epoch, c) for c in range(self.cursor, end)]
            plan = self._plan = plan_window(docs, self.seq_len, getattr(self.stream, "seed", 0), self.epoch,
                                            self.cursor)
        pieces = plan.rows[self.offset]
        self.offset += 1
        if self.offset == len(plan.rows):  # the window is spent: the position moves to the next one
            self._advance(plan.end - plan.start)
        return pieces

    # -- rows and batches -----------------------------------------------------------------------

    def _layout(self, pieces: list[Piece]) -> dict[str, np.ndarray]:
        L = self.seq_len
        out = {"inputs": np.zeros(L, np.int32), "targets": np.zeros(L, np.int32),
               "positions": np.zeros(L, np.int32), "segment_ids": np.zeros(L, np.int32),
               "weights": np.zeros(L, np.float32)}
        fill = 0
        for segment, (doc, start, take) in enumerate(pieces, 1):
            tokens, end = doc.tokens, fill + take
            out["inputs"][fill:end] = tokens[start:start + take]
            out["targets"][fill:end] = tokens[start + 1:start + take + 1]
            out["positions"][fill:end] = np.arange(take)
            out["segment_ids"][fill:end] = segment
            out["weights"][fill:end] = 1.0 if doc.trained is None else doc.trained[start + 1:start + take + 1]
            fill = end
        return out

    def row(self) -> dict[str, np.ndarray]:
        """The next row. Past the end of finite data: the stream's DataError (the data ran out)."""
        if self._exhausted():
            self.stream.get(self.epoch, 0)  # raises the stream's one sentence: the data ran out
        pieces = {"concat": self._concat_pieces, "best_fit": self._best_fit_pieces,
                  "none": self._single_pieces}[self.packing]()
        return self._layout(pieces)

    def batch(self, rows: int) -> dict[str, np.ndarray]:
        """`rows` rows; where finite data ends within them, the rest are padding (the data ran out
        at the next batch), so every document of the last epoch is trained on."""
        made = [self.row()]
        made += [self._layout([]) if self._exhausted() else self.row() for _ in range(rows - 1)]
        return {k: np.stack([r[k] for r in made]) for k in made[0]}
