"""Text to tokens and back for lm-eval, with the run's own tokenizer (data.tokenizer).

lm-eval's `hf` backend encodes with the tokenizer's defaults: a Hugging Face tokenizer.json adds
what its post-processor adds (Llama 3's: <|begin_of_text|> before every text) unless the text
already starts with that token. The same rule here makes a run's scores comparable with the `hf`
backend's on the run's `to-hf` export. Tokenizers without a post-processor of their own
(SentencePiece, tiktoken, bytes) add BOS where the run trained with one before each document
(data.add_bos). `add_bos_token` (lm-eval's model argument) overrides both.
"""

from __future__ import annotations

from dataclasses import dataclass

from maxtext_rocm.data.tokenizer import HFTokenizer, load_tokenizer


@dataclass
class TextCodec:
    tokenizer: object
    add_bos: bool | None  # None: as the tokenizer (or the run's data.add_bos) does by itself
    trained_with_bos: bool

    @classmethod
    def for_run(cls, cfg, add_bos: bool | None) -> "TextCodec":
        data = cfg.data
        trained_with_bos = data.get("source") == "files" and bool(data.get("add_bos", True))
        return cls(load_tokenizer(data.tokenizer), add_bos, trained_with_bos)

    def special_text(self, token: int | None) -> str | None:
        """A special token as text, where the tokenizer writes it as text (a tokenizer.json's
        "<|begin_of_text|>"); None for the others, whose decode drops their specials."""
        if token is None or not isinstance(self.tokenizer, HFTokenizer):
            return None
        return self.tokenizer.tok.decode([int(token)], skip_special_tokens=False)

    @property
    def bos_text(self) -> str | None:
        return self.special_text(self.tokenizer.bos_id)

    def encode(self, text: str, add_special_tokens: bool | None = None) -> list[int]:
        """lm-eval's `tok_encode`: `add_special_tokens` None means the defaults above."""
        bos = self.tokenizer.bos_id
        starts_with_bos = self.bos_text is not None and text.startswith(self.bos_text)
        if add_special_tokens is None and self.add_bos is None and isinstance(self.tokenizer, HFTokenizer):
            return list(self.tokenizer.tok.encode(text, add_special_tokens=not starts_with_bos).ids)
        if add_special_tokens is None:
            add_special_tokens = (self.trained_with_bos if self.add_bos is None else self.add_bos) and not starts_with_bos
        if isinstance(self.tokenizer, HFTokenizer):
            ids = list(self.tokenizer.tok.encode(text, add_special_tokens=False).ids)
        else:
            ids = [int(i) for i in self.tokenizer.encode(text)]
        return ([bos] if add_special_tokens and bos is not None else []) + ids

    def decode(self, ids) -> str:
        """Text of generated tokens, special tokens dropped (as the `hf` backend decodes)."""
        return self.tokenizer.decode(ids)
