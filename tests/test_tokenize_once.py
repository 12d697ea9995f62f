"""Each record of data.format chat / prompt_completion / preference is tokenized once in a start-up
and its first epoch, whatever data.packing: the start-up check's examples (data/kept.py) are the ones
the source trains on, and they give the rows a fresh tokenization gives."""

import collections
import random

import numpy as np
import pytest

from chat_helpers import make_chat_tokenizer, write_jsonl
from conftest import small_config
from maxtext_rocm.data import formats, kept
from maxtext_rocm.data.files import FilesSource, check_inputs

pytest.importorskip("tokenizers")

WORDS = "the quick brown fox jumps over the lazy dog hello world what is two plus four".split()


def records(fmt: str, count: int) -> list[dict]:
    """Chats of one to three exchanges (three sequences of roles), or plain prompts and responses."""
    rng = random.Random(0)

    def say():
        return " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 5)))

    if fmt == "chat":
        out = []
        for _ in range(count):
            turns = [{"role": "system", "content": say()}]
            for _ in range(rng.randint(1, 3)):
                turns += [{"role": "user", "content": say()}, {"role": "assistant", "content": say()}]
            out.append({"messages": turns})
        return out
    if fmt == "prompt_completion":
        return [{"prompt": say(), "completion": say()} for _ in range(count)]
    return [{"prompt": say(), "chosen": say(), "rejected": say()} for _ in range(count)]


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    return make_chat_tokenizer(tmp_path_factory.mktemp("once_tok"))


def files_config(tok_dir, path, fmt: str, packing: str, out):
    overrides = {"data.source": "files", "data.paths": str(path), "data.format": fmt, "data.packing": packing,
                 "data.tokenizer": str(tok_dir / "tokenizer.json"), "data.epochs": 1, "model.vocab_size": 320,
                 "train.seq_len": 256, "output_dir": str(out), "checkpoint.enabled": False}
    if fmt == "preference":
        overrides.update({"train.objective": "dpo", "train.per_device_batch_size": 2})
    return small_config(**overrides)


@pytest.mark.parametrize("fmt,packing,buckets", [
    ("chat", "none", "auto"), ("chat", "best_fit", "auto"), ("prompt_completion", "none", "auto"),
    ("prompt_completion", "best_fit", "auto"), ("preference", "none", "auto"), ("preference", "none", "none"),
    ("chat", "none", "none")])
def test_a_trainer_start_up_and_its_epoch_tokenize_each_record_once(fmt, packing, buckets, tok_dir, tmp_path, devices,
                                                                     monkeypatch):
    from maxtext_rocm.trainer.trainer import Trainer

    count = 40
    path = write_jsonl(tmp_path / f"{fmt}.jsonl", records(fmt, count))
    calls = collections.Counter()
    tokenize = formats.Tokenize.__call__

    def counting(self, item):
        calls[item[1]] += 1  # item: (record, "FILE line N")
        return tokenize(self, item)

    monkeypatch.setattr(formats.Tokenize, "__call__", counting)
    cfg = files_config(tok_dir, path, fmt, packing, tmp_path / "run")
    cfg.data.buckets = buckets
    trainer = Trainer(cfg, devices, log=lambda *_: None)
    try:
        at_start_up = sum(calls.values())
        step = 0
        while trainer.data.state()["epoch"] < 1:  # the whole first (and, with data.epochs=1, only) epoch
            trainer.data.batch(step)
            step += 1
    finally:
        trainer.close()
    # Under packing 'none' the check reads every record (bucketed pairs too: their plan needs every
    # length); otherwise the first of each sequence of roles.
    reads_all = packing == "none" and (fmt != "preference" or buckets != "none")
    assert at_start_up == (count if reads_all else 3 if fmt == "chat" else 1)
    assert len(calls) == count and set(calls.values()) == {1}, collections.Counter(calls.values())
    assert not kept._WAITING  # the source took what the check kept: nothing else holds it


@pytest.mark.parametrize("fmt,packing", [("chat", "none"), ("prompt_completion", "none"), ("chat", "best_fit"),
                                         ("preference", "none")])
def test_the_kept_examples_give_the_rows_a_fresh_tokenization_gives(fmt, packing, tok_dir, tmp_path):
    """A source over the check's kept examples and one that tokenizes every record itself (no
    check before it) hand out the same batches; `train_on_prompt` keeps no mask, and reads back so."""
    path = write_jsonl(tmp_path / "data.jsonl", records(fmt, 30))
    for train_on_prompt in (False, True) if fmt != "preference" else (False,):
        cfg = files_config(tok_dir, path, fmt, packing, tmp_path / "run").data
        cfg.train_on_prompt, cfg.epochs = train_on_prompt, 0  # epochs: 7 batches cross the first epoch's end
        args = dict(vocab_size=320, global_batch=4, seq_len=256)
        fresh = FilesSource(cfg, **args)
        check_inputs(cfg, 320, seq_len=256)
        from_check = FilesSource(cfg, **args)
        assert not kept._WAITING
        try:
            for step in range(7):
                want, got = fresh.batch(step), from_check.batch(step)
                for key in want:
                    np.testing.assert_array_equal(got[key], want[key], err_msg=f"{key} at step {step}")
        finally:
            fresh.close()
            from_check.close()


def test_the_byte_tokenizer_finds_what_its_check_kept(tmp_path):
    """data.tokenizer='byte' (the default) is one object, so the source finds the examples the
    check kept by it: once it was made anew per call, and every record was tokenized twice."""
    from maxtext_rocm.data.tokenizer import load_tokenizer

    assert load_tokenizer("byte") is load_tokenizer("byte") is load_tokenizer("")
    path = write_jsonl(tmp_path / "data.jsonl", records("prompt_completion", 12))
    cfg = small_config(**{"data.source": "files", "data.paths": str(path), "data.format": "prompt_completion",
                          "data.packing": "none", "data.tokenizer": "byte", "train.seq_len": 256,
                          "output_dir": str(tmp_path / "run"), "checkpoint.enabled": False}).data
    check_inputs(cfg, 320, seq_len=256)
    assert kept._WAITING
    source = FilesSource(cfg, vocab_size=320, global_batch=4, seq_len=256)
    try:
        assert not kept._WAITING  # taken by the source
    finally:
        source.close()
