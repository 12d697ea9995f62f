"""Tokenizer files behind data.tokenizer: a tiny BPE trained with `tokenizers`, a tiny SentencePiece
model, a tiny tiktoken rank file, all built here; vocabulary sizes checked against the model's."""

import base64
import json

import numpy as np
import pytest

from maxtext_rocm import config as config_lib
from maxtext_rocm.config import ConfigError
from maxtext_rocm.data.tokenizer import (ByteTokenizer, HFTokenizer, SentencePieceTokenizer, TiktokenTokenizer,
                                         check_vocab, load_tokenizer)

CORPUS = ["the quick brown fox jumps over the lazy dog", "hello world, hello tokenizer",
          "def forward(config, params, tokens): return logits", "Grüße aus Köln 🚀 — 東京"] * 20
TEXT = "hello brown fox: def forward(tokens) 🚀"


@pytest.fixture(scope="module")
def hf_json(tmp_path_factory):
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<pad>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS, trainer)
    path = tmp_path_factory.mktemp("hf") / "tokenizer.json"
    tok.save(str(path))
    return path


@pytest.fixture(scope="module")
def spm_model(tmp_path_factory):
    sentencepiece = pytest.importorskip("sentencepiece")
    folder = tmp_path_factory.mktemp("spm")
    (folder / "corpus.txt").write_text("\n".join(CORPUS) + "\n")
    sentencepiece.SentencePieceTrainer.train(
        input=str(folder / "corpus.txt"), model_prefix=str(folder / "tiny"), vocab_size=320,
        model_type="bpe", character_coverage=1.0, byte_fallback=True, pad_id=3, hard_vocab_limit=False,
        minloglevel=2)
    return folder / "tiny.model"


@pytest.fixture(scope="module")
def tiktoken_file(tmp_path_factory):
    pytest.importorskip("tiktoken")
    # All 256 bytes, then a few merges that the text below uses.
    tokens = [bytes([b]) for b in range(256)] + [b"he", b"ll", b"hell", b"hello", b" f", b" fo", b" fox"]
    path = tmp_path_factory.mktemp("tt") / "tokenizer.model"
    path.write_bytes(b"".join(base64.b64encode(t) + b" " + str(rank).encode() + b"\n"
                              for rank, t in enumerate(tokens)))
    return path


def test_hf_tokenizer_json(hf_json):
    tok = load_tokenizer(str(hf_json))
    assert isinstance(tok, HFTokenizer) and tok.vocab_size == 300
    assert (tok.pad_id, tok.bos_id, tok.eos_id) == (0, 1, 2)
    ids = tok.encode(TEXT, bos=True, eos=True)
    assert ids.dtype == np.int32 and ids[0] == 1 and ids[-1] == 2 and ids.max() < tok.vocab_size
    assert len(ids) < len(TEXT.encode())  # merges happened
    assert tok.decode(ids) == TEXT
    # a folder holding tokenizer.json works too, and a tokenizer_config.json names the specials
    (hf_json.parent / "tokenizer_config.json").write_text(json.dumps({"bos_token": "</s>", "eos_token": "</s>"}))
    try:
        assert load_tokenizer(f"hf:{hf_json.parent}").bos_id == 2
    finally:
        (hf_json.parent / "tokenizer_config.json").unlink()


def test_sentencepiece_model(spm_model):
    tok = load_tokenizer(str(spm_model))
    assert isinstance(tok, SentencePieceTokenizer) and tok.vocab_size == tok.sp.get_piece_size() > 260
    assert (tok.bos_id, tok.eos_id, tok.pad_id) == (1, 2, 3)
    ids = tok.encode(TEXT, bos=True, eos=True)
    assert ids[0] == 1 and ids[-1] == 2 and ids.max() < tok.vocab_size
    assert len(ids) < len(TEXT.encode())  # merges happened
    assert tok.decode(ids) == TEXT  # byte fallback covers what the tiny vocabulary lacks


def test_tiktoken_ranks(tiktoken_file):
    tok = load_tokenizer(str(tiktoken_file))  # named tokenizer.model, as Llama 3's is: found by content
    assert isinstance(tok, TiktokenTokenizer) and tok.vocab_size == 263
    assert tok.bos_id is None  # not Llama 3's 128,000 ranks, so no Llama 3 special tokens
    ids = tok.encode("hello fox")
    assert ids.tolist() == [259, 262]
    assert tok.decode(ids) == "hello fox" and tok.decode(tok.encode(TEXT)) == TEXT
    with pytest.raises(ValueError, match="no bos token"):
        tok.encode("x", bos=True)


def test_byte_is_the_default():
    assert config_lib.defaults().data.tokenizer == "byte"
    assert isinstance(load_tokenizer("byte"), ByteTokenizer)


def test_vocab_size_is_checked_against_the_model(hf_json, tmp_path):
    from maxtext_rocm.trainer.preflight import check_inputs

    base = ["--config.data.source=synthetic", f"--config.data.tokenizer={hf_json}"]
    cfg = config_lib.load("tiny_llama", base + ["--config.model.vocab_size=300"])
    check_vocab(load_tokenizer(cfg.data.tokenizer), cfg.model.vocab_size)
    # The tokenizer is read by the run's preflight (config.load reads no file).
    with pytest.raises(ConfigError, match="has 300 ids but model.vocab_size=299; use model.vocab_size >= 300"):
        check_inputs(config_lib.load("tiny_llama", base + ["--config.model.vocab_size=299"]))
    with pytest.raises(ConfigError, match="is not a file"):
        check_inputs(config_lib.load("tiny_llama", ["--config.data.source=synthetic",
                                                    f"--config.data.tokenizer={tmp_path}/nope.json"]))
    with pytest.raises(ConfigError, match="byte-tokenized"):
        config_lib.load("tiny_llama", [f"--config.data.tokenizer={hf_json}"])
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ConfigError, match="cannot be read as a hf tokenizer"):
        load_tokenizer(str(bad))
