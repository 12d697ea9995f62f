"""Preference pairs packed into rows (data.format="preference" with data.packing="best_fit").

Without packing a pair takes two rows (data/preference.py), each padded to a bucket. Packed, a row
of train.seq_len holds several whole pairs, each sequence its own segment: pair k of a row is
segments 2k+1 (chosen) and 2k+2 (rejected), so attention never crosses a sequence and rotary
positions restart at each; `pair_ids` is k+1 on both sequences' positions (0 on padding), the map
from a position to its pair that finetune/dpo.py sums each sequence's log-probability over. A pair
is cut as data/preference.py cuts it (truncate_pair), so its two sequences are the ones the
unpacked rows would hold, and the pair's loss is the same.

Pairs are placed as data/best_fit.py places documents: best-fit decreasing over a window of
data.packing_window consecutive pairs of this process's epoch order (never crossing an epoch), a
pair's size being its two sequences' positions; the window's rows are then shuffled by (data.seed,
epoch, window start). A pair is never cut, so one whose two sequences together are longer than a
row is refused at start-up (data/formats.py: `pair_positions`). The position is the RowPacker's
best_fit one (epoch, the window's first pair, rows of the window handed out), which FilesSource
saves and restores the same way.
"""
from __future__ import annotations

import numpy as np

from maxtext_rocm.data.best_fit import Piece, best_fit_rows
from maxtext_rocm.data.checks import DataError
from maxtext_rocm.data.preference import truncate_pair

KEYS = ("inputs", "targets", "positions", "segment_ids", "weights", "pair_ids")


def packs_pairs(data_cfg) -> bool:
    """Whether the files source packs preference pairs into rows (this module), rather than giving
    each sequence a row of its own (data/preference.py, padded to data.buckets)."""
    return data_cfg.get("source") == "files" and data_cfg.get("format") == "preference" and \
        data_cfg.get("packing") == "best_fit"


def pair_positions(pair, seq_len: int) -> int:
    """The positions a pair takes in a packed row: both sequences' (tokens - 1 each), as truncated
    for rows of seq_len; at least 1, so no row gathers more pairs than it has positions."""
    return _positions(truncate_pair(*pair, seq_len))


def _positions(cut_pair) -> int:
    return max(1, sum(len(example.tokens) - 1 for example in cut_pair))


def packed_row(pairs: list, seq_len: int) -> dict[str, np.ndarray]:
    """`pairs` (each already cut by truncate_pair) one after another in a row of seq_len positions."""
    row = {k: np.zeros(seq_len, np.float32 if k == "weights" else np.int32) for k in KEYS}
    fill = 0
    for slot, pair in enumerate(pairs):
        for side, example in enumerate(pair):
            n, end = len(example.tokens) - 1, fill + len(example.tokens) - 1
            if end > seq_len:
                raise ValueError(f"pairs of {end} positions do not fit a row of {seq_len}")
            row["inputs"][fill:end] = example.tokens[:-1]
            row["targets"][fill:end] = example.tokens[1:]
            row["positions"][fill:end] = np.arange(n)
            row["segment_ids"][fill:end] = 2 * slot + side + 1
            row["weights"][fill:end] = 1.0 if example.trained is None else example.trained[1:]
            row["pair_ids"][fill:end] = slot + 1
            fill = end
    return row


class PackedPairs:
    """The RowPacker's interface (state, set_state, batch) over a stream of PreferencePairs, packed."""

    def __init__(self, stream, seq_len: int, packing: str = "best_fit", window: int = 512, name: str = "the data"):
        if window < 1:
            raise DataError(f"data.packing_window={window!r} is not valid; use a number of pairs >= 1")
        self.stream, self.seq_len, self.window, self.name = stream, seq_len, window, name
        self.epoch, self.cursor, self.offset = 0, 0, 0
        self._plan = None  # the current window: (epoch, start, end, rows of pair indices within it)

    def state(self) -> dict:
        return {"epoch": self.epoch, "cursor": self.cursor, "offset": self.offset}

    def set_state(self, state: dict) -> None:
        self.epoch, self.cursor, self.offset = int(state["epoch"]), int(state["cursor"]), int(state["offset"])

    def _window(self):
        if self._plan is None or self._plan[:2] != (self.epoch, self.cursor):
            end = min(self.cursor + self.window, self.stream.per_epoch(self.epoch))
            pairs = [truncate_pair(*self.stream.get(self.epoch, c), self.seq_len) for c in range(self.cursor, end)]
            pieces = [Piece(pair, 0, _positions(pair)) for pair in pairs]
            for piece in pieces:
                if piece.take > self.seq_len:
                    raise DataError(f"a preference pair of {self.name} takes {piece.take} positions (chosen and "
                                    f"rejected), more than a packed row of train.seq_len={self.seq_len}; raise "
                                    "train.seq_len or set data.packing='none'")
            rows = best_fit_rows(pieces, self.seq_len)
            seed = getattr(self.stream, "seed", 0)
            order = np.random.default_rng([seed, self.epoch, self.cursor]).permutation(len(rows))
            self._plan = (self.epoch, self.cursor, end, [[piece.doc for piece in rows[i]] for i in order])
        return self._plan

    def row(self) -> dict[str, np.ndarray]:
        if self.stream.epochs and self.epoch >= self.stream.epochs:
            self.stream.get(self.epoch, 0)  # raises the stream's one sentence: the data ran out
        _, start, end, rows = self._window()
        pairs = rows[self.offset]
        self.offset += 1
        if self.offset == len(rows):  # the window is spent: the position moves to the next one
            self.cursor, self.offset = end, 0
            if self.cursor >= self.stream.per_epoch(self.epoch):
                self.epoch, self.cursor = self.epoch + 1, 0
        return packed_row(pairs, self.seq_len)

    def batch(self, rows: int) -> dict[str, np.ndarray]:
        made = [self.row() for _ in range(rows)]
        return {k: np.stack([r[k] for r in made]) for k in KEYS}
