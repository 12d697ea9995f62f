"""Real text with no download: the Python standard library's own source, byte-tokenized."""
from __future__ import annotations

import functools
import os
import sysconfig

import numpy as np

from maxtext_rocm.data.synthetic import local_rows
from maxtext_rocm.data.tokenizer import ByteTokenizer

DEFAULT_MAX_BYTES = 8 << 20
EVAL_FRACTION = 0.05


@functools.lru_cache(maxsize=4)
def load_corpus(max_bytes: int = DEFAULT_MAX_BYTES) -> tuple[np.ndarray, int, int]:
    """(tokens, files read, source bytes kept): sorted stdlib .py files joined by eos, cut at max_bytes.

    Cached per process so several sources (train, eval, tests) share one read-only array.
    """
    root = sysconfig.get_paths()["stdlib"]
    paths = []
    for dirpath, dirnames, filenames in os.walk(root):
        # Installed packages vary from machine to machine; the corpus must not.
        dirnames[:] = [d for d in dirnames if d not in ("site-packages", "dist-packages", "__pycache__")]
        paths.extend(os.path.join(dirpath, f) for f in filenames if f.endswith(".py"))
    tok = ByteTokenizer()
    sep = np.array([tok.eos_id], np.int32)
    parts, used, files = [], 0, 0
    for path in sorted(paths):
        if used >= max_bytes:
            break
        try:
            with open(path, "rb") as f:
                data = f.read(max_bytes - used)
        except OSError:
            continue
        if not data:
            continue
        parts += [tok.encode_bytes(data), sep]
        used, files = used + len(data), files + 1
    if not parts:
        raise ValueError(f"no readable Python source under {root} for data.source='embedded'; "
                         f"use data.source='synthetic'")
    tokens = np.concatenate(parts)
    tokens.setflags(write=False)
    return tokens, files, used


class EmbeddedSource:
    """Windows of seq_len+1 tokens at offsets drawn from (seed, step); the last 5% is the eval split."""

    def __init__(self, vocab_size: int, global_batch: int, seq_len: int, seed: int,
                 process_index: int = 0, process_count: int = 1,
                 max_bytes: int = DEFAULT_MAX_BYTES, split: str = "train"):
        if vocab_size < ByteTokenizer.vocab_size:
            raise ValueError(f"model.vocab_size={vocab_size} is smaller than the byte tokenizer's "
                             f"{ByteTokenizer.vocab_size} ids; use vocab_size >= {ByteTokenizer.vocab_size}")
        if split not in ("train", "eval"):
            raise ValueError(f"split={split!r} is not one of 'train', 'eval'")
        self.global_batch, self.seq_len, self.seed, self.split = global_batch, seq_len, seed, split
        self.rows = local_rows(global_batch, process_index, process_count)
        self.corpus, self.num_files, self.num_bytes = load_corpus(max_bytes)
        cut = len(self.corpus) - int(len(self.corpus) * EVAL_FRACTION)
        self.start, self.stop = (0, cut) if split == "train" else (cut, len(self.corpus))
        self.num_tokens = self.stop - self.start
        if self.num_tokens < seq_len + 1:
            raise ValueError(f"the embedded {split} split has {self.num_tokens} tokens, fewer than "
                             f"seq_len + 1 = {seq_len + 1}; raise max_bytes or lower seq_len")

    def offsets(self, step: int) -> np.ndarray:
        """Absolute corpus offsets of every row of the global batch at this step."""
        # Same key scheme as SyntheticSource: [seed, step] for train, an extra stream id for eval.
        rng = np.random.default_rng([self.seed, step, *([] if self.split == "train" else [1])])
        return self.start + rng.integers(0, self.num_tokens - self.seq_len, self.global_batch)

    def batch(self, step: int) -> dict[str, np.ndarray]:
        starts = self.offsets(step)[self.rows]
        window = self.corpus[starts[:, None] + np.arange(self.seq_len + 1)]
        return {"inputs": np.ascontiguousarray(window[:, :-1]), "targets": np.ascontiguousarray(window[:, 1:]),
                "weights": np.ones((len(starts), self.seq_len), np.float32)}

    def describe(self) -> str:
        return (f"embedded: {self.num_bytes / 2**20:.1f} MiB of Python stdlib source ({self.num_files} files), "
                f"byte tokenizer, {self.split} split {self.num_tokens:,} tokens")
