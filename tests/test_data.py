"""Data sources: tokenizer round trip, determinism, process slicing, the embedded corpus."""
import time

import ml_collections
import numpy as np
import pytest

from maxtext_rocm.data import ByteTokenizer, EmbeddedSource, SyntheticSource, build_source
from maxtext_rocm.data.embedded import DEFAULT_MAX_BYTES, load_corpus

TOK = ByteTokenizer()


def test_byte_tokenizer_round_trip_and_special_ids():
    text = "héllo wörld — Привет, 世界 🚀\n\tdef f(): pass"
    ids = TOK.encode(text, bos=True, eos=True)
    assert ids.dtype == np.int32
    assert ids[0] == ByteTokenizer.bos_id and ids[-1] == ByteTokenizer.eos_id
    assert len(ids) == len(text.encode("utf-8")) + 2
    assert ids[1:-1].min() >= ByteTokenizer.offset and ids.max() < ByteTokenizer.vocab_size
    assert TOK.decode(ids) == text
    assert TOK.decode([ByteTokenizer.pad_id, *TOK.encode("a"), ByteTokenizer.eos_id, *TOK.encode("b")]) == "ab"
    # A window cut mid-character must decode, not raise.
    assert TOK.decode(TOK.encode("世")[:2]) == "\ufffd"
    raw = bytes(range(256))
    np.testing.assert_array_equal(TOK.encode_bytes(raw), np.arange(256) + 3)
    np.testing.assert_array_equal(TOK.encode_bytes(np.frombuffer(raw, np.uint8)), TOK.encode_bytes(raw))


def test_synthetic_is_deterministic_and_shifted():
    src = SyntheticSource(vocab_size=50, global_batch=4, seq_len=16, seed=3)
    a, b, c = src.batch(7), SyntheticSource(50, 4, 16, seed=3).batch(7), src.batch(8)
    assert a["inputs"].shape == a["targets"].shape == a["weights"].shape == (4, 16)
    assert a["inputs"].dtype == np.int32 and a["weights"].dtype == np.float32
    for k in a:
        np.testing.assert_array_equal(a[k], b[k])
    assert not np.array_equal(a["inputs"], c["inputs"])
    assert not np.array_equal(a["inputs"], SyntheticSource(50, 4, 16, seed=4).batch(7)["inputs"])
    np.testing.assert_array_equal(a["inputs"][:, 1:], a["targets"][:, :-1])
    assert a["inputs"].min() >= 0 and a["inputs"].max() < 50
    assert np.all(a["weights"] == 1)
    eval_batch = SyntheticSource(50, 4, 16, seed=3, split="eval").batch(7)
    assert not np.array_equal(a["inputs"], eval_batch["inputs"])


@pytest.mark.parametrize("cls", [SyntheticSource, EmbeddedSource])
def test_process_slices_concatenate_to_global_batch(cls):
    whole = cls(300, 6, 12, seed=1).batch(5)
    parts = [cls(300, 6, 12, seed=1, process_index=i, process_count=2).batch(5) for i in range(2)]
    for k in whole:
        assert parts[0][k].shape[0] == 3
        np.testing.assert_array_equal(np.concatenate([p[k] for p in parts]), whole[k])
    with pytest.raises(ValueError, match="divide"):
        cls(300, 5, 12, seed=1, process_count=2)


def test_embedded_tokens_and_determinism():
    src = EmbeddedSource(vocab_size=ByteTokenizer.vocab_size, global_batch=8, seq_len=64, seed=0)
    a, b = src.batch(3), EmbeddedSource(259, 8, 64, seed=0).batch(3)
    for k in a:
        np.testing.assert_array_equal(a[k], b[k])
    assert not np.array_equal(a["inputs"], src.batch(4)["inputs"])
    assert a["inputs"].dtype == np.int32 and a["inputs"].shape == (8, 64)
    np.testing.assert_array_equal(a["inputs"][:, 1:], a["targets"][:, :-1])
    assert src.corpus.min() >= 0 and src.corpus.max() < ByteTokenizer.vocab_size
    assert np.all(a["weights"] == 1)
    assert "embedded:" in src.describe() and "files" in src.describe()


def test_embedded_windows_come_from_the_corpus():
    src = EmbeddedSource(259, 4, 128, seed=11)
    batch, starts = src.batch(2), src.offsets(2)
    corpus_text = TOK.decode(src.corpus)
    assert "def " in corpus_text and "import " in corpus_text and "return" in corpus_text
    for row, start in enumerate(starts):
        window = src.corpus[start:start + 129]
        np.testing.assert_array_equal(batch["inputs"][row], window[:-1])
        np.testing.assert_array_equal(batch["targets"][row], window[1:])
        # Text check independent of offsets(): a partial UTF-8 character at either edge decodes to U+FFFD.
        text = TOK.decode(np.append(batch["inputs"][row], batch["targets"][row][-1])).strip("\ufffd")
        assert len(text) > 50 and text in corpus_text


def test_embedded_eval_split_is_disjoint_from_train():
    train, evals = (EmbeddedSource(259, 16, 256, seed=5, split=s) for s in ("train", "eval"))
    assert train.stop <= evals.start and evals.stop == len(train.corpus)
    assert evals.num_tokens == pytest.approx(0.05 * len(train.corpus), abs=1)
    assert train.num_tokens + evals.num_tokens == len(train.corpus)
    for step in range(20):
        t, e = train.offsets(step), evals.offsets(step)
        assert t.min() >= 0 and (t + 257).max() <= train.stop
        assert e.min() >= evals.start and (e + 257).max() <= evals.stop


def test_embedded_rejects_small_vocab_and_bad_split():
    with pytest.raises(ValueError, match="vocab_size=128"):
        EmbeddedSource(128, 2, 8, seed=0)
    with pytest.raises(ValueError, match="split"):
        EmbeddedSource(259, 2, 8, seed=0, split="test")
    with pytest.raises(ValueError, match="seq_len"):
        EmbeddedSource(259, 2, 10_000, seed=0, max_bytes=4096)


def test_build_source_dispatch():
    cfg = ml_collections.ConfigDict(dict(source="synthetic", seed=9))
    src = build_source(cfg, vocab_size=100, global_batch=2, seq_len=8)
    assert isinstance(src, SyntheticSource)
    np.testing.assert_array_equal(src.batch(0)["inputs"], SyntheticSource(100, 2, 8, seed=9).batch(0)["inputs"])
    cfg.source = "embedded"
    src = build_source(cfg, vocab_size=300, global_batch=4, seq_len=8, process_index=1, process_count=2, split="eval")
    assert isinstance(src, EmbeddedSource) and src.split == "eval" and src.batch(0)["inputs"].shape == (2, 8)
    cfg.source = "files"
    with pytest.raises(ValueError, match="data.source"):
        build_source(cfg, vocab_size=300, global_batch=4, seq_len=8)


def test_corpus_load_time():
    t0 = time.perf_counter()
    tokens, files, used = load_corpus.__wrapped__(DEFAULT_MAX_BYTES)  # bypass the cache: a fresh read
    seconds = time.perf_counter() - t0
    print(f"\nembedded corpus: {used / 2**20:.1f} MiB, {files} files, {len(tokens):,} tokens in {seconds:.3f} s")
    assert used <= DEFAULT_MAX_BYTES and len(tokens) == used + files
