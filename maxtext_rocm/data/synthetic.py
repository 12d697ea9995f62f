"""Deterministic random tokens: a data source for benchmarks that costs nothing to read."""
from __future__ import annotations

import numpy as np


def local_rows(global_batch: int, process_index: int, process_count: int) -> slice:
    """This process's rows of the global batch; every process draws the whole batch, so they agree."""
    if process_count < 1 or not 0 <= process_index < process_count:
        raise ValueError(f"process_index={process_index} is outside 0..{process_count - 1}")
    if global_batch % process_count:
        raise ValueError(f"global batch {global_batch} does not divide among {process_count} processes; "
                         f"use a multiple of {process_count}")
    local = global_batch // process_count
    return slice(process_index * local, (process_index + 1) * local)


class SyntheticSource:
    """Uniform random ids in [0, vocab_size); batch(step) is a pure function of (seed, step, split)."""

    def __init__(self, vocab_size: int, global_batch: int, seq_len: int, seed: int,
                 process_index: int = 0, process_count: int = 1, split: str = "train"):
        if split not in ("train", "eval"):
            raise ValueError(f"split={split!r} is not one of 'train', 'eval'")
        self.vocab_size, self.global_batch, self.seq_len, self.seed = vocab_size, global_batch, seq_len, seed
        self.rows = local_rows(global_batch, process_index, process_count)
        # Random tokens have no held-out text; eval gets its own stream so it never replays a train step.
        self.stream = [] if split == "train" else [1]

    def batch(self, step: int) -> dict[str, np.ndarray]:
        rng = np.random.default_rng([self.seed, step, *self.stream])
        window = rng.integers(0, self.vocab_size, (self.global_batch, self.seq_len + 1), dtype=np.int32)
        window = window[self.rows]
        return {"inputs": np.ascontiguousarray(window[:, :-1]), "targets": np.ascontiguousarray(window[:, 1:]),
                "weights": np.ones(window[:, 1:].shape, np.float32)}

    def describe(self) -> str:
        return f"synthetic: uniform random tokens over {self.vocab_size} ids, seed {self.seed}"
