"""Row lengths from a few buckets: a batch whose rows each hold one example (GRPO's prompt and
completion, SFT's one example per row under data.packing='none', DPO's preference pairs) is padded
to the shortest bucket that holds its longest row, not to train.seq_len. Each bucket is one more
compiled train step (kept in the persistent compilation cache), so there are few: quarters of
train.seq_len, rounded up to a multiple of 128 where train.seq_len is one (the tile attention
kernels and the chunked LM head like), else of 8. Padding sits after every row's tokens, which
causal attention never reads and the loss weighs 0, so a row's loss and gradient are the same in
any bucket that holds it (tests/test_grpo.py and tests/test_buckets_sft_dpo.py hold them to that).

data.buckets says which lengths a data source uses ('auto', 'none' or a list: `row_buckets`); the
resolve step writes what 'auto' became into the config (`resolved`); data/bucketed.py plans the
batches of a files source over them.
"""

from __future__ import annotations

import math

QUARTERS = 4
VALID = "'auto' (quarters of train.seq_len), 'none' (every row train.seq_len long) or ascending row lengths " \
        "such as '256,512,1024' (positive, at most train.seq_len)"


def bucket_lengths(seq_len: int) -> tuple[int, ...]:
    """The row lengths a run of `seq_len` pads its one-example batches to, shortest first."""
    multiple = 128 if seq_len % 128 == 0 and seq_len >= 4 * 128 else 8
    lengths = {min(seq_len, math.ceil(seq_len * k / QUARTERS / multiple) * multiple) for k in range(1, QUARTERS + 1)}
    return tuple(sorted(lengths))


def bucket_of(longest: int, seq_len: int, buckets: tuple[int, ...] | None = None) -> int:
    """The shortest bucket (of `buckets`, default bucket_lengths(seq_len)) that holds a row of
    `longest` positions; train.seq_len where none does."""
    return next((length for length in buckets or bucket_lengths(seq_len) if length >= longest), seq_len)


def one_example_rows(data_cfg) -> bool:
    """Whether each row of the files source holds one example whose length start-up knows: records
    of chat / prompt_completion under data.packing='none' (the start-up check tokenizes every one),
    preference pairs unless packed (data/packed_pairs.py) and GRPO's prompts with their sampled
    completions (each batch padded to the bucket of its longest row). Text documents are tokenized
    as the stream reads them."""
    from maxtext_rocm.data.packed_pairs import packs_pairs

    fmt = data_cfg.get("format", "text")
    return data_cfg.get("source") == "files" and (
        fmt == "prompt" or (fmt == "preference" and not packs_pairs(data_cfg))
        or (fmt in ("chat", "prompt_completion") and data_cfg.get("packing") == "none"))


def parse(value, seq_len: int) -> tuple[int, ...] | None:
    """data.buckets as lengths (None: 'none'); a ValueError naming what is wrong and what is valid."""
    text = str(value).strip()
    if text == "auto":
        return bucket_lengths(seq_len)
    if text == "none":
        return None
    try:
        lengths = tuple(int(part) for part in text.replace(" ", "").strip("()[]").split(","))
    except ValueError:
        raise ValueError(f"data.buckets={value!r} is not valid; use {VALID}") from None
    if not all(0 < n <= seq_len for n in lengths) or list(lengths) != sorted(set(lengths)):
        raise ValueError(f"data.buckets={value!r} is not valid for train.seq_len={seq_len}; use {VALID}")
    return lengths if lengths[-1] == seq_len else (*lengths, seq_len)  # a truncated row still fits one


def row_buckets(data_cfg, seq_len: int) -> tuple[int, ...] | None:
    """The row lengths the files source pads one-example rows to, or None: every row seq_len long
    (data.buckets='none', or rows that hold packed documents). A data group without the key (an
    older run's config) keeps rows of seq_len."""
    if not one_example_rows(data_cfg):
        return None
    lengths = parse(data_cfg.get("buckets", "none"), seq_len)
    return None if lengths is None or lengths == (seq_len,) else lengths


def resolved(data_cfg, seq_len: int, divisor: int = 1) -> str:
    """data.buckets as a run resolves it: 'none' where rows are not bucketed, else the lengths
    ('256,512,768,1024'); 'auto' keeps only the quarters that divide into `divisor` chunks (the mesh's
    sequence shards: each bucket must split over them as train.seq_len does)."""
    if str(data_cfg.get("buckets", "none")).strip() == "auto":
        lengths = row_buckets(data_cfg, seq_len)
        lengths = lengths and tuple(n for n in lengths if n % divisor == 0)
    else:
        lengths = row_buckets(data_cfg, seq_len)
    return "none" if not lengths or lengths == (seq_len,) else ",".join(map(str, lengths))
