"""Byte-level tokenizer: every UTF-8 byte is a token, shifted past three special ids."""
from __future__ import annotations

import numpy as np


class ByteTokenizer:
    """Lossless for any text, needs no vocabulary file; ids 0..2 are pad, bos, eos."""

    pad_id = 0
    bos_id = 1
    eos_id = 2
    offset = 3
    vocab_size = 256 + offset  # a class attribute: config validation reads it without an instance

    def encode_bytes(self, data: bytes | np.ndarray) -> np.ndarray:
        """Raw bytes (or a uint8 array) -> int32 ids."""
        raw = np.frombuffer(data, np.uint8) if isinstance(data, (bytes, bytearray, memoryview)) else np.asarray(data, np.uint8)
        return raw.astype(np.int32) + self.offset

    def encode(self, text: str, bos: bool = False, eos: bool = False) -> np.ndarray:
        ids = self.encode_bytes(text.encode("utf-8"))
        head = [self.bos_id] if bos else []
        tail = [self.eos_id] if eos else []
        if head or tail:
            ids = np.concatenate([np.array(head, np.int32), ids, np.array(tail, np.int32)])
        return ids

    def decode(self, ids) -> str:
        """Special ids are dropped; a window cut mid-character decodes to U+FFFD, not an error."""
        ids = np.asarray(ids, np.int64).reshape(-1)
        ids = ids[(ids >= self.offset) & (ids < self.vocab_size)]
        return (ids - self.offset).astype(np.uint8).tobytes().decode("utf-8", errors="replace")
