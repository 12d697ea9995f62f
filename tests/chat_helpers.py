"""Tiny chat tokenizers and chat files for the fine-tuning tests, built offline: a byte-level BPE
trained by `tokenizers` with Llama 3's chat tokens (or Qwen3's), saved with a tokenizer_config.json
that transformers' AutoTokenizer loads (its chat_template is the reference rendering)."""
from __future__ import annotations

import json
from pathlib import Path

from maxtext_rocm.data.builtin_templates import QWEN3, QWEN3_GENERATION  # noqa: F401  (the tests' templates)

SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>",
            "<|finetune_right_pad_id|>"]
LLAMA3_NAMES = {"bos_token": "<|begin_of_text|>", "eos_token": "<|end_of_text|>",
                "pad_token": "<|finetune_right_pad_id|>"}
# Qwen3's: three special tokens, and <think> / </think> added as plain (not special) tokens, no BOS;
# the chat models' tokenizer_config.json names <|im_end|> as EOS.
QWEN3_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
QWEN3_ADDED = ["<think>", "</think>"]
QWEN3_NAMES = {"bos_token": None, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}
# Llama 3's template with transformers' {% generation %} marks around what the assistant writes.
LLAMA3_GENERATION = (
    "{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
    "{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] | trim }}<|eot_id|>{% endgeneration %}"
    "{% else %}{{ m['content'] | trim }}<|eot_id|>{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}")
# ChatML (Qwen-style) with generation marks; this tokenizer has no <|im_start|>/<|im_end|> tokens, so
# they are plain text whose bytes may merge with their neighbours: boundaries inside tokens.
CHATML_GENERATION = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' }}{% if m['role'] == 'assistant' %}"
    "{% generation %}{{ m['content'] + '<|im_end|>' }}{% endgeneration %}{{ '\n' }}"
    "{% else %}{{ m['content'] + '<|im_end|>' + '\n' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
CORPUS = ["the quick brown fox jumps over the lazy dog", "hello world, hello tokenizer", "what is two plus two?",
          "the answer is four.", "system: you are terse", "Grüße aus Köln — 東京"] * 10

CHATS = [
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "What is 2+2?"},
     {"role": "assistant", "content": "4."}, {"role": "user", "content": "And 3+3?"},
     {"role": "assistant", "content": " Six, of course. "}],
    [{"role": "user", "content": "Say hello."}, {"role": "assistant", "content": "hello world"}],
    [{"role": "user", "content": "Grüße?"}, {"role": "assistant", "content": "aus Köln"},
     {"role": "user", "content": "more"}, {"role": "assistant", "content": "the quick brown fox"}],
]


def make_chat_tokenizer(folder: Path, template: str | None = LLAMA3_GENERATION, vocab: int = 320,
                        specials: list[str] = SPECIALS, names: dict = LLAMA3_NAMES, added: list[str] = ()) -> Path:
    """folder/tokenizer.json (`specials` special, `added` plain added tokens) + tokenizer_config.json
    (`names`: bos/eos/pad, and `template`); returns folder."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=list(specials),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS, trainer)
    tok.add_tokens(list(added))
    tok.save(str(folder / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", **names, "model_max_length": 256}
    if template is not None:
        config["chat_template"] = template
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


def write_jsonl(path: Path, records) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path
