"""Data sources: each gives batch(step) -> {"inputs", "targets", "weights"} for this process's rows
(files add "positions" and "segment_ids"; see data/files.py and data/packing.py)."""
from __future__ import annotations

import numpy as np

from maxtext_rocm.data.embedded import EmbeddedSource
from maxtext_rocm.data.packed_pairs import packs_pairs
from maxtext_rocm.data.synthetic import SyntheticSource
from maxtext_rocm.data.tokenizer import ByteTokenizer

__all__ = ["ByteTokenizer", "EmbeddedSource", "SyntheticSource", "batch_spec", "build_source"]


def batch_spec(data_cfg) -> dict[str, np.dtype]:
    """The arrays of a batch and their dtypes (each [rows, seq_len]), known before any batch exists,
    so the train step can be compiled from shapes alone."""
    spec = {"inputs": np.dtype(np.int32), "targets": np.dtype(np.int32), "weights": np.dtype(np.float32)}
    if data_cfg.source == "files":  # packed documents: per-document positions and segment ids
        spec.update(positions=np.dtype(np.int32), segment_ids=np.dtype(np.int32))
    if data_cfg.get("format") == "prompt":  # GRPO's scored samples: each row's advantage on its positions
        spec["advantages"] = np.dtype(np.float32)
    if packs_pairs(data_cfg):  # each position's pair in its row (data/packed_pairs.py)
        spec["pair_ids"] = np.dtype(np.int32)
    return spec


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
