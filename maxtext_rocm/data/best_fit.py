"""Whole documents into rows: best-fit decreasing over a window of documents (data.packing="best_fit").

A window is `data.packing_window` consecutive documents of this process's epoch order (never
crossing an epoch). Its documents are placed longest first, each into the open row whose free
space it fills most tightly, or into a new row; a document longer than a row is cut into
row-sized pieces first (the last piece is placed like a document). The window's rows are then
shuffled by a generator seeded from (data.seed, epoch, window start), so one batch does not
hold all the long documents and the next all the short ones.

The plan is a pure function of the window's documents and its position, so the packer's
resumable state stays three integers: (epoch, the window's first document, rows of the window
already handed out); a resumed run re-plans the window and skips those rows.
"""
from __future__ import annotations

import bisect
from typing import NamedTuple

import numpy as np

from maxtext_rocm.data.example import TokenizedExample


class Piece(NamedTuple):
    """`take` training pairs of `doc` from token `start`: inputs tokens[start:start+take], targets
    tokens[start+1:start+take+1]."""

    doc: TokenizedExample
    start: int
    take: int


class WindowPlan(NamedTuple):
    """The rows of one window and where the next window starts."""

    epoch: int
    start: int  # the window's first document (cursor)
    end: int  # the cursor after the window
    rows: list  # list[list[Piece]]


def pieces_of(doc: TokenizedExample, seq_len: int) -> list[Piece]:
    """A document's pairs as row-sized pieces (one piece unless it is longer than a row)."""
    pairs = len(doc.tokens) - 1
    return [Piece(doc, s, min(seq_len, pairs - s)) for s in range(0, max(pairs, 0), seq_len)]


def best_fit_rows(pieces: list[Piece], seq_len: int) -> list[list[Piece]]:
    """Best-fit decreasing: longest piece first, each into the row with the least free space that
    still holds it (ties: the older row), else a new row. Rows in the order they were opened."""
    order = sorted(range(len(pieces)), key=lambda i: -pieces[i].take)  # stable: stream order breaks ties
    rows: list[list[Piece]] = []
    free: list[tuple[int, int]] = []  # (free space, row), sorted: bisect finds the tightest fit
    for i in order:
        piece = pieces[i]
        k = bisect.bisect_left(free, (piece.take, -1))
        if k < len(free):
            space, row = free.pop(k)
            rows[row].append(piece)
        else:
            row, space = len(rows), seq_len
            rows.append([piece])
        space -= piece.take
        if space > 0:
            bisect.insort(free, (space, row))
    return rows


def plan_window(docs: list[TokenizedExample], seq_len: int, seed: int, epoch: int, start: int) -> WindowPlan:
    """The rows of the window of `docs` that starts at document `start` of `epoch`, shuffled."""
    rows = best_fit_rows([p for doc in docs for p in pieces_of(doc, seq_len)], seq_len)
    order = np.random.default_rng([seed, epoch, start]).permutation(len(rows))
    return WindowPlan(epoch, start, start + len(docs), [rows[i] for i in order])
