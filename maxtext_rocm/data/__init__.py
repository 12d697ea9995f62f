"""Data sources: each gives batch(step) -> {"inputs", "targets", "weights"} for this process's rows
(files add "positions" and "segment_ids"; see data/files.py)."""
from __future__ import annotations

from maxtext_rocm.data.embedded import EmbeddedSource
from maxtext_rocm.data.synthetic import SyntheticSource
from maxtext_rocm.data.tokenizer import ByteTokenizer

__all__ = ["ByteTokenizer", "EmbeddedSource", "SyntheticSource", "build_source"]


def build_source(data_cfg, *, vocab_size: int, global_batch: int, seq_len: int,
                 process_index: int = 0, process_count: int = 1, split: str = "train"):
    """The source named by data_cfg.source, seeded by data_cfg.seed."""
    common = dict(vocab_size=vocab_size, global_batch=global_batch, seq_len=seq_len, seed=data_cfg.seed,
                  process_index=process_index, process_count=process_count)
    if data_cfg.source == "synthetic":
        return SyntheticSource(**common, split=split)
    if data_cfg.source == "embedded":
        return EmbeddedSource(**common, split=split)
    if data_cfg.source == "files":
        from maxtext_rocm.data.files import FilesSource  # grain and pyarrow load only when used

        return FilesSource(data_cfg, vocab_size=vocab_size, global_batch=global_batch, seq_len=seq_len,
                           process_index=process_index, process_count=process_count, split=split)
    raise ValueError(f"data.source={data_cfg.source!r} is not one of 'synthetic', 'embedded', 'files'")
