"""Rows of preference pairs for the DPO objective (data.format="preference").

Each record gives two rows, one after the other: row 2i = prompt + chosen, row 2i+1 = prompt +
rejected, for the same prompt. A row holds one example (never packed with another): segment id 1 on
its tokens, 0 on padding; `weights` are 1 exactly on the response's target tokens. An example longer
than a row (seq_len + 1 tokens: seq_len inputs and targets) loses prompt tokens from the left first,
keeping at least one, the same ones in both rows, then response tokens from the right.

The position is the RowPacker's (epoch, cursor, offset; offset stays 0), so FilesSource saves and
restores it the same way.
"""
from __future__ import annotations

import numpy as np

from maxtext_rocm.data.checks import DataError
from maxtext_rocm.data.example import TokenizedExample


def prompt_length(example: TokenizedExample) -> int:
    """Tokens before the first trained one: the prompt (the template's generation prompt included)."""
    trained = np.flatnonzero(example.trained) if example.trained is not None else []
    return int(trained[0]) if len(trained) else len(example.tokens)


def truncate_pair(chosen: TokenizedExample, rejected: TokenizedExample, seq_len: int):
    """Both examples cut to at most seq_len + 1 tokens: the shared prompt from the left first (at
    least one token stays, so the first response token is a target), then each response from the right."""
    room = seq_len + 1
    prompt = min(prompt_length(chosen), prompt_length(rejected))
    longest = max(len(chosen.tokens), len(rejected.tokens)) - prompt
    drop = min(max(0, prompt + longest - room), max(0, prompt - 1))
    out = []
    for example in (chosen, rejected):
        trained = example.trained if example.trained is not None else np.ones(len(example.tokens), bool)
        tokens, trained = example.tokens[drop:drop + room], trained[drop:drop + room]
        out.append(TokenizedExample(tokens, trained))
    return out


def pair_row(example: TokenizedExample, seq_len: int) -> dict[str, np.ndarray]:
    L, n = seq_len, len(example.tokens) - 1
    row = {"inputs": np.zeros(L, np.int32), "targets": np.zeros(L, np.int32), "positions": np.zeros(L, np.int32),
           "segment_ids": np.zeros(L, np.int32), "weights": np.zeros(L, np.float32)}
    row["inputs"][:n] = example.tokens[:-1]
    row["targets"][:n] = example.tokens[1:]
    row["positions"][:n] = np.arange(n)
    row["segment_ids"][:n] = 1
    row["weights"][:n] = example.trained[1:]
    return row


class PairPacker:
    """The RowPacker's interface (state, set_state, batch) over a stream of PreferencePairs."""

    def __init__(self, stream, seq_len: int, packing: bool = False, name: str = "the data"):
        del packing  # a pair is never packed with another example
        self.stream, self.seq_len, self.name = stream, seq_len, name
        self.epoch, self.cursor, self.offset = 0, 0, 0

    def state(self) -> dict:
        return {"epoch": self.epoch, "cursor": self.cursor, "offset": self.offset}

    def set_state(self, state: dict) -> None:
        self.epoch, self.cursor, self.offset = int(state["epoch"]), int(state["cursor"]), 0

    def batch(self, rows: int) -> dict[str, np.ndarray]:
        if rows % 2:
            raise DataError(f"data.format='preference' puts each pair in two rows, but this process has {rows} rows "
                            "of the global batch; make train.per_device_batch_size x local devices even")
        made = []
        for _ in range(rows // 2):
            pair = self.stream.get(self.epoch, self.cursor)
            made += [pair_row(example, self.seq_len) for example in truncate_pair(*pair, self.seq_len)]
            self.cursor += 1
            if self.cursor >= self.stream.per_epoch(self.epoch):
                self.epoch, self.cursor = self.epoch + 1, 0
        return {k: np.stack([r[k] for r in made]) for k in made[0]}
