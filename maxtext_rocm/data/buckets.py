"""Row lengths from a few buckets: a batch whose rows each hold one example (GRPO's prompt and
completion) is padded to the shortest bucket that holds its longest row, not to train.seq_len.
Each bucket is one more compiled train step (kept in the persistent compilation cache), so there
are few: quarters of train.seq_len, rounded up to a multiple of 128 where train.seq_len is one (the
tile attention kernels and the chunked LM head like), else of 8. Padding sits after every row's
tokens, which causal attention never reads and the loss weighs 0, so a row's loss and gradient are
the same in any bucket that holds it (tests/test_grpo.py holds GRPO's to that)."""

from __future__ import annotations

import math

QUARTERS = 4


def bucket_lengths(seq_len: int) -> tuple[int, ...]:
    """The row lengths a run of `seq_len` pads its one-example batches to, shortest first."""
    multiple = 128 if seq_len % 128 == 0 and seq_len >= 4 * 128 else 8
    lengths = {min(seq_len, math.ceil(seq_len * k / QUARTERS / multiple) * multiple) for k in range(1, QUARTERS + 1)}
    return tuple(sorted(lengths))


def bucket_of(longest: int, seq_len: int) -> int:
    """The shortest bucket that holds a row of `longest` positions."""
    return next(length for length in bucket_lengths(seq_len) if length >= longest)
