"""Byte-level tokenizer: every UTF-8 byte is a token, shifted past three special ids.

`load_tokenizer(spec)` (config key `data.tokenizer`) also reads tokenizer files: Hugging Face
tokenizer.json, SentencePiece .model, tiktoken BPE ranks.
"""
from __future__ import annotations

import base64
import binascii
import functools
import json
import re
from pathlib import Path

import numpy as np

from maxtext_rocm.errors import ConfigError


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


# ----------------------------------------------------------------------------------------------
# Tokenizer files: Hugging Face tokenizer.json, SentencePiece .model, tiktoken BPE ranks.
# Each gives the interface above: vocab_size, pad_id/bos_id/eos_id (None where the vocabulary has
# none), encode(text, bos, eos) -> int32 ids, decode(ids) -> text without special tokens.

# Special tokens looked up by name when no tokenizer_config.json says which they are.
_BOS_NAMES = ("<|begin_of_text|>", "<s>", "<bos>", "<|startoftext|>")
_EOS_NAMES = ("<|end_of_text|>", "</s>", "<eos>", "<|endoftext|>")
_PAD_NAMES = ("<pad>", "<|finetune_right_pad_id|>", "<|pad|>")
# Llama 3's pre-tokenizer pattern and special tokens (Meta's tokenizer.py), for tiktoken rank
# files; the 256 special tokens follow the ranks only when there are Llama 3's 128,000 of them.
LLAMA3_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                  r"|\s*[\r\n]+|\s+(?!\S)|\s+")
LLAMA3_RANKS = 128000
LLAMA3_SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|reserved_special_token_0|>",
                   "<|reserved_special_token_1|>", "<|finetune_right_pad_id|>", "<|step_id|>",
                   "<|start_header_id|>", "<|end_header_id|>", "<|eom_id|>", "<|eot_id|>", "<|python_tag|>"]
LLAMA3_SPECIALS += [f"<|reserved_special_token_{i}|>" for i in range(2, 256 - len(LLAMA3_SPECIALS) + 2)]


class _FileTokenizer:
    pad_id = bos_id = eos_id = None
    vocab_size = 0
    _specials: frozenset = frozenset()

    def _ids(self, text: str) -> list[int]:
        raise NotImplementedError

    def encode(self, text: str, bos: bool = False, eos: bool = False) -> np.ndarray:
        for wanted, special, name in ((bos, self.bos_id, "bos"), (eos, self.eos_id, "eos")):
            if wanted and special is None:
                raise ValueError(f"{self.path} has no {name} token")
        ids = ([self.bos_id] if bos else []) + self._ids(text) + ([self.eos_id] if eos else [])
        return np.asarray(ids, np.int32)

    def decode(self, ids) -> str:
        ids = [int(i) for i in np.asarray(ids).reshape(-1) if int(i) not in self._specials]
        return self._text(ids)

    def _text(self, ids: list[int]) -> str:
        raise NotImplementedError


class HFTokenizer(_FileTokenizer):
    """A Hugging Face `tokenizer.json` (the `tokenizers` library); specials from a
    `tokenizer_config.json` beside it, else by their usual names."""

    def __init__(self, path):
        from tokenizers import Tokenizer

        self.path = Path(path)
        self.tok = Tokenizer.from_file(str(self.path))
        self.vocab_size = self.tok.get_vocab_size(with_added_tokens=True)
        named = {}
        config = self.path.with_name("tokenizer_config.json")
        if config.is_file():
            record = json.loads(config.read_text())
            for key in ("bos", "eos", "pad"):
                token = record.get(f"{key}_token")
                named[key] = token.get("content") if isinstance(token, dict) else token
        for key, names in (("bos", _BOS_NAMES), ("eos", _EOS_NAMES), ("pad", _PAD_NAMES)):
            candidates = [named[key]] if named.get(key) else list(names)
            found = [self.tok.token_to_id(name) for name in candidates if self.tok.token_to_id(name) is not None]
            setattr(self, f"{key}_id", found[0] if found else None)
        self._specials = frozenset(i for i in (self.bos_id, self.eos_id, self.pad_id) if i is not None)

    def _ids(self, text):
        return self.tok.encode(text, add_special_tokens=False).ids

    def _text(self, ids):
        return self.tok.decode(ids, skip_special_tokens=True)


class SentencePieceTokenizer(_FileTokenizer):
    """A SentencePiece `.model` (Llama 2, Mixtral)."""

    def __init__(self, path):
        import sentencepiece

        self.path = Path(path)
        self.sp = sentencepiece.SentencePieceProcessor(model_file=str(self.path))
        self.vocab_size = self.sp.get_piece_size()
        for key in ("bos", "eos", "pad"):
            value = getattr(self.sp, f"{key}_id")()
            setattr(self, f"{key}_id", value if value >= 0 else None)
        self._specials = frozenset(i for i in (self.bos_id, self.eos_id, self.pad_id) if i is not None)

    def _ids(self, text):
        return self.sp.encode(text)

    def _text(self, ids):
        return self.sp.decode(ids)


class TiktokenTokenizer(_FileTokenizer):
    """A tiktoken BPE rank file (`base64-token rank` per line; Llama 3's original tokenizer.model)."""

    def __init__(self, path):
        import tiktoken

        self.path = Path(path)
        ranks = {}
        for number, line in enumerate(self.path.read_bytes().splitlines(), 1):
            if line.strip():
                try:
                    token, rank = line.split()
                    ranks[base64.b64decode(token, validate=True)] = int(rank)
                except (ValueError, binascii.Error):
                    raise ValueError(f"line {number} of {self.path} is not 'base64-token rank'") from None
        specials = LLAMA3_SPECIALS if len(ranks) == LLAMA3_RANKS else []
        special_ids = {name: len(ranks) + i for i, name in enumerate(specials)}
        self.enc = tiktoken.Encoding(self.path.name, pat_str=LLAMA3_PATTERN, mergeable_ranks=ranks,
                                     special_tokens=special_ids)
        self.vocab_size = len(ranks) + len(specials)
        self.bos_id = special_ids.get("<|begin_of_text|>")
        self.eos_id = special_ids.get("<|end_of_text|>")
        self.pad_id = special_ids.get("<|finetune_right_pad_id|>")
        self._specials = frozenset(special_ids.values())

    def _ids(self, text):
        return self.enc.encode(text, disallowed_special=())  # special-token text is plain text here

    def _text(self, ids):
        return self.enc.decode(ids)


def _looks_like_tiktoken(path: Path) -> bool:
    with open(path, "rb") as f:
        first = f.readline(4096).strip()
    return re.fullmatch(rb"[A-Za-z0-9+/=]+ \d+", first) is not None


_KINDS = {"hf": HFTokenizer, "sentencepiece": SentencePieceTokenizer, "tiktoken": TiktokenTokenizer}


_BYTE = ByteTokenizer()


def load_tokenizer(spec: str):
    """The tokenizer `data.tokenizer` names: "byte", or a path to a tokenizer.json, a SentencePiece
    .model or a tiktoken rank file (a folder: its tokenizer.json, else its tokenizer.model). The kind
    is found from the file; a prefix `hf:`, `sentencepiece:` or `tiktoken:` forces it."""
    if spec in ("", "byte"):
        return _BYTE  # one object, as files are cached below: what a start-up check kept is found by it (data/kept.py)
    kind, sep, rest = spec.partition(":")
    kind, text = (kind, rest) if sep and kind in _KINDS else (None, spec)
    path = Path(text).expanduser()
    if path.is_dir():
        path = next((path / n for n in ("tokenizer.json", "tokenizer.model") if (path / n).is_file()), path)
    if not path.is_file():
        raise ConfigError(f"data.tokenizer={spec!r} is not a file; use 'byte', a tokenizer.json, a SentencePiece "
                          ".model or a tiktoken BPE file (or a folder holding tokenizer.json / tokenizer.model)")
    if kind is None:
        kind = "hf" if path.suffix == ".json" else "tiktoken" if _looks_like_tiktoken(path) else "sentencepiece"
    # Cached per file version (a tokenizer_config.json beside it counts as part of it).
    versions = tuple(p.stat().st_mtime_ns if p.is_file() else 0
                     for p in (path, path.with_name("tokenizer_config.json")))
    return _load(kind, str(path.resolve()), versions)


@functools.lru_cache(maxsize=8)
def _load(kind: str, path: str, _versions: tuple):
    try:
        return _KINDS[kind](path)
    except ImportError as error:
        raise ConfigError(f"data.tokenizer={path!r} needs the {error.name!r} package; install "
                          "the package's hf extra (pip install -e '.[hf]'), or that package alone") from None
    except Exception as error:  # noqa: BLE001 - each library raises its own types
        first = (str(error).strip().splitlines() or [type(error).__name__])[0][:200]
        raise ConfigError(f"data.tokenizer={path!r} cannot be read as a {kind} tokenizer ({first})") from None


def check_vocab(tokenizer, model_vocab_size: int, spec: str = "") -> None:
    """Every id the tokenizer can produce must have a row in the model's embedding."""
    if tokenizer.vocab_size > model_vocab_size:
        raise ConfigError(f"data.tokenizer={spec or tokenizer.path!r} has {tokenizer.vocab_size} ids but "
                          f"model.vocab_size={model_vocab_size}; use model.vocab_size >= {tokenizer.vocab_size}")
