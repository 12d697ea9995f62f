"""data.packing (issue 35): "concat" fills rows to the last token and continues documents into the
next row, "best_fit" keeps documents whole, "none" puts one per row; each piece is its own segment
with positions from 0, the model sees no other document, the position resumes exactly, and the
padding fraction (segment id 0) is what the trainer logs."""
import json

import jax
import numpy as np
import pytest

from maxtext_rocm import config as config_lib
from maxtext_rocm.data import resume
from maxtext_rocm.data.checks import DataError
from maxtext_rocm.data.example import TokenizedExample
from maxtext_rocm.data.packing import DocumentStream, RowPacker
from conftest import small_config
from helpers import assert_close
from test_data_files import make_docs, source, write_jsonl
from test_data_resume import assert_same, batches, saved_by

L = 16


def documents(n=40, seed=0, hi=60):
    """Token documents of 0 to hi-1 tokens (some empty or of one token: nothing to predict), each
    with a random trained-target mask (a prompt's tokens are untrained)."""
    rng = np.random.default_rng(seed)
    docs = []
    for _ in range(n):
        length = int(rng.integers(0, hi)) if rng.random() < 0.9 else int(rng.integers(0, 2))
        docs.append(TokenizedExample(rng.integers(3, 500, length).astype(np.int32), rng.random(length) < 0.7))
    return docs


def rows_of_one_epoch(docs, packing, process_index=0, process_count=1, window=512):
    """Every row `packing` makes of one epoch (data.epochs=1), until the data runs out."""
    stream = DocumentStream(docs, seed=1, process_index=process_index, process_count=process_count, epochs=1)
    packer, rows = RowPacker(stream, L, packing=packing, window=window), []
    while True:
        try:
            rows.append(packer.row())
        except DataError as error:
            assert "ran out after data.epochs=1" in str(error)
            return stream, rows


def concat_reference(docs, order):
    """Rows as concatenation says they should be, built independently: every training pair of the
    epoch's documents in order, cut every L pairs; a segment is a document's run within a row."""
    pairs = [(d.tokens[:-1], d.tokens[1:], d.trained[1:], np.full(len(d.tokens) - 1, i))
             for i, d in enumerate(docs[j] for j in order) if len(d.tokens) > 1]
    inputs, targets, trained, doc = (np.concatenate(x) for x in zip(*pairs))
    rows = []
    for start in range(0, len(inputs), L):
        n = min(L, len(inputs) - start)
        ids = doc[start:start + n]
        segment = 1 + np.concatenate([[0], np.cumsum(ids[1:] != ids[:-1])])
        first = {s: np.flatnonzero(segment == s)[0] for s in np.unique(segment)}
        row = {k: np.zeros(L, dt) for k, dt in (("inputs", np.int32), ("targets", np.int32), ("positions", np.int32),
                                                ("segment_ids", np.int32), ("weights", np.float32))}
        row["inputs"][:n], row["targets"][:n], row["weights"][:n] = (inputs[start:start + n],
                                                                     targets[start:start + n], trained[start:start + n])
        row["segment_ids"][:n] = segment
        row["positions"][:n] = np.arange(n) - np.array([first[s] for s in segment])
        rows.append(row)
    return rows


@pytest.mark.parametrize("process_count", [1, 2])
def test_concat_rows_are_full_and_hold_every_token_once_in_order(process_count):
    docs = documents()
    for p in range(process_count):
        stream, rows = rows_of_one_epoch(docs, "concat", p, process_count)
        want = concat_reference(docs, stream.order(0))
        assert len(rows) == len(want) > 5
        assert_same(rows, want)  # tokens, targets, trained mask, segments and positions
        assert all(np.all(r["segment_ids"] > 0) for r in rows[:-1])  # full rows: padding only in the last
        assert np.any(rows[-1]["segment_ids"] == 0)  # (this corpus does not end on a row end)
        assert max(r["segment_ids"].max() for r in rows) >= 3  # several documents share rows
        # Documents continue across row ends: some row starts mid-document, at position 0.
        assert any(rows[i]["segment_ids"][0] == 1 and rows[i - 1]["segment_ids"][-1] > 0 and
                   rows[i]["inputs"][0] == rows[i - 1]["targets"][-1] for i in range(1, len(rows)))


def test_best_fit_rows_hold_whole_documents_and_their_padding():
    docs = documents(60, seed=2, hi=40)  # some longer than a row of 16: cut into row-sized pieces
    for window in (7, 512):
        stream, rows = rows_of_one_epoch(docs, "best_fit", window=window)
        got = []
        for r in rows:
            seg = r["segment_ids"]
            assert np.all(np.diff((seg > 0).astype(int)) <= 0)  # the padding sits at the row's end
            for s in range(1, seg.max() + 1):
                where = np.flatnonzero(seg == s)
                np.testing.assert_array_equal(r["positions"][where], np.arange(len(where)))
                got.append(tuple(np.append(r["inputs"][where], r["targets"][where][-1])))
        # Each document exactly once: whole, or (longer than a row) in row-sized pieces.
        want = [tuple(d.tokens[s:s + L + 1]) for d in (docs[i] for i in stream.order(0))
                for s in range(0, len(d.tokens) - 1, L)]
        assert sorted(got) == sorted(want)
        padding = np.mean([r["segment_ids"] == 0 for r in rows])
        assert 0 < padding < 0.25, padding
        # Best fit beats the whole-document greedy packer of old (a new row whenever the next
        # document would fit a fresh row whole but not this one), on the same documents and order.
        assert len(rows) < old_greedy_rows([len(docs[i].tokens) - 1 for i in stream.order(0)]) or window < 512


def old_greedy_rows(pairs_per_doc):
    rows, fill = 0, 0
    for pairs in (p for p in pairs_per_doc if p >= 1):
        while pairs:
            if fill and L - fill < pairs <= L:
                rows, fill = rows + 1, 0
            take = min(pairs, L - fill)
            fill, pairs = fill + take, pairs - take
            if fill == L:
                rows, fill = rows + 1, 0
    return rows + (fill > 0)


def test_none_puts_one_document_per_row():
    docs = documents()
    stream, rows = rows_of_one_epoch(docs, "none")
    kept = [docs[i] for i in stream.order(0) if len(docs[i].tokens) > 1]
    assert len(rows) == len(kept)
    for r, d in zip(rows, kept):
        n = min(len(d.tokens) - 1, L)
        np.testing.assert_array_equal(r["segment_ids"], np.arange(L) < n)
        np.testing.assert_array_equal(r["targets"][:n], d.tokens[1:n + 1])


def test_the_last_batch_of_finite_data_is_padded_then_the_data_runs_out(tmp_path):
    corpus = write_jsonl(tmp_path / "c.jsonl", make_docs(9, lo=1, hi=6))
    src = source(corpus, epochs=1)
    out = []
    with pytest.raises(DataError, match="ran out after data.epochs=1"):
        while True:
            out.append(src.batch(len(out)))
    rows = np.concatenate([b["segment_ids"] for b in out])
    last = int(np.flatnonzero((rows == 0).any(axis=1))[0])  # the first row with padding
    assert np.all(rows[:last] > 0) and np.all(rows[last + 1:] == 0) and rows[last, 0] > 0
    assert last >= len(rows) - 4  # in the last batch
    assert int((rows > 0).sum()) == sum(len(t.encode()) + 1 for t in make_docs(9, lo=1, hi=6))  # every pair


@pytest.mark.parametrize("packing", ["concat", "best_fit"])
@pytest.mark.parametrize("processes", [1, 2])
def test_resume_at_any_step_equals_the_uninterrupted_stream(tmp_path, monkeypatch, packing, processes):
    rng = np.random.default_rng(5)
    corpus = write_jsonl(tmp_path / "c.jsonl", [t * int(rng.integers(1, 4)) for t in make_docs(12, lo=1, hi=8)])
    opts = dict(packing=packing, packing_window=5, process_count=processes)  # windows span batches
    steps = 8  # past an epoch's end for every process
    want = [batches(source(corpus, process_index=p, **opts), range(steps)) for p in range(processes)]
    epochs, offsets = set(), set()
    for k in range(1, steps):
        first = [source(corpus, process_index=p, **opts) for p in range(processes)]
        for s in first:
            batches(s, range(k))
        saved = saved_by(first, k, monkeypatch)
        assert saved["packing"] == packing
        epochs |= {p["epoch"] for p in saved["positions"]}
        offsets |= {p["offset"] for p in saved["positions"]}  # mid-document (concat), mid-window (best_fit)
        for p in range(processes):
            resumed = source(corpus, process_index=p, **opts)
            resumed.restore(saved)
            assert_same(batches(resumed, range(k, steps)), want[p][k:])
    assert epochs >= {0, 1} and max(offsets) > 0


def test_best_fit_resumes_mid_window_only_with_the_window_it_was_saved_with(tmp_path, monkeypatch):
    """A best_fit position counts rows of a window, which another data.packing_window plans
    differently: resuming with another size mid-window is one sentence (or, allowed, the window's start)."""
    corpus = write_jsonl(tmp_path / "c.jsonl", make_docs(30, lo=5, hi=20))
    first = source(corpus, packing="best_fit", packing_window=6)
    batches(first, range(1))
    saved = saved_by([first], 1, monkeypatch)
    assert saved["packing_window"] == 6 and saved["positions"][0]["offset"] > 0  # mid-window
    with pytest.raises(DataError, match=r"saved with data.packing='best_fit' \(data.packing_window=6\) in the middle"):
        source(corpus, packing="best_fit", packing_window=8).restore(saved)
    allowed = source(corpus, packing="best_fit", packing_window=8, allow_changed=True)
    allowed.restore(saved)
    assert allowed.state()["offset"] == 0
    same = source(corpus, packing="best_fit", packing_window=6)
    same.restore(saved)
    assert_same(batches(same, [1]), batches(source(corpus, packing="best_fit", packing_window=6), range(2))[1:])


def test_a_checkpoint_of_another_mode_resumes_at_a_document_start_only(tmp_path, monkeypatch):
    corpus = write_jsonl(tmp_path / "c.jsonl", make_docs(30, lo=20, hi=40))  # longer than rows of 32
    first = source(corpus)
    batches(first, range(2))
    saved = saved_by([first], 2, monkeypatch)
    assert saved["positions"][0]["offset"] > 0  # mid-document
    with pytest.raises(DataError, match="saved with data.packing='concat' in the middle of a document"):
        source(corpus, packing="best_fit").restore(saved)
    allowed = source(corpus, packing="best_fit", allow_changed=True)
    allowed.restore(saved)
    assert allowed.state()["offset"] == 0 and allowed.state()["cursor"] == saved["positions"][0]["cursor"]
    # Checkpoints from before the modes hold no "packing": their token offsets are concat's.
    older = {k: v for k, v in saved.items() if k != "packing"}
    resumed = source(corpus)
    resumed.restore(older)
    assert_same(batches(resumed, [2]), batches(source(corpus), range(3))[2:])


@pytest.mark.parametrize("value, said", [
    ("true", "(true packed whole documents greedily: 'concat' now fills rows"), ("false", "(what false did is now 'none')"),
    ("first_fit", "not valid; choose 'concat' (rows filled to the last token")])
def test_data_packing_takes_a_mode(value, said):
    with pytest.raises(config_lib.ConfigError) as error:
        config_lib.load("configs/tiny_llama.py", [f"--config.data.packing={value}"])
    assert said in str(error.value) and str(error.value).startswith(f"data.packing={value!r} is not valid")
    assert "\n" not in str(error.value)
    with pytest.raises(config_lib.ConfigError, match="data.packing_window must be >= 1"):
        config_lib.load("configs/tiny_llama.py", ["--config.data.packing_window=0"])


def test_padding_fraction_counts_positions_without_a_token_not_masked_prompts():
    from maxtext_rocm.reporting import metrics, run_report
    from maxtext_rocm.trainer.step import padding_fraction

    seg = np.array([[1, 1, 2, 0], [1, 1, 1, 1]], np.int32)
    weights = np.array([[0, 1, 1, 0], [0, 0, 1, 1]], np.float32)  # prompts masked: not padding
    batch = {"inputs": seg, "targets": seg, "weights": weights, "segment_ids": seg}
    assert float(padding_fraction(batch)) == 1 / 8
    assert float(padding_fraction({k: v for k, v in batch.items() if k != "segment_ids"})) == 0.0  # synthetic
    cfg = small_config()
    row = run_report.logged_row(cfg, {"loss": 2.0, "lr": 1e-3, "grad_norm": 1.0, "nonfinite_steps": 0,
                                      "padding": np.float32(0.125)}, 0.5, 2, 1, 1e6, None)
    assert row["padding_fraction"] == 0.125 and "pad 12.5%" in metrics.format_line(3, 10, row)


def test_a_packed_row_loses_what_its_documents_lose_alone():
    """The model sees no other document: per-token losses of a concat row (with pieces of
    documents continued from the row before and into the next) equal each piece's alone."""
    from maxtext_rocm.models import build_model
    from maxtext_rocm.numerics.precision import policy_from_config
    from maxtext_rocm.trainer.step import token_losses

    from maxtext_rocm.resolve import resolve_here

    cfg = resolve_here(small_config(**{"model.vocab_size": 512}))
    model = build_model(cfg.model, policy_from_config(cfg.precision, jax.devices()[0]))
    params = jax.jit(model.init)(jax.random.key(0), np.zeros((1, 8), np.int32))["params"]
    stream = DocumentStream(documents(12, seed=3, hi=40), seed=0, process_index=0, process_count=1)
    packed = RowPacker(stream, 2 * L).batch(3)
    assert packed["segment_ids"][:, 0].min() == 1 and packed["segment_ids"].max() >= 3
    pieces = [(r, np.flatnonzero(packed["segment_ids"][r] == s)) for r in range(3)
              for s in range(1, packed["segment_ids"][r].max() + 1)]
    alone = {k: np.zeros((len(pieces), 2 * L), v.dtype) for k, v in packed.items()}
    for i, (r, where) in enumerate(pieces):
        for k in ("inputs", "targets", "weights"):
            alone[k][i, :len(where)] = packed[k][r][where]
        alone["positions"][i], alone["segment_ids"][i, :len(where)] = np.arange(2 * L), 1
    both = {k: np.concatenate([packed[k], alone[k]]) for k in packed}  # one program for both
    logits = jax.jit(lambda b: model.apply({"params": params}, b["inputs"], b["positions"], b["segment_ids"]))(both)
    ce = np.asarray(token_losses(logits, both["targets"])[0])
    for i, (r, where) in enumerate(pieces):
        assert_close(ce[r][where], ce[3 + i, :len(where)], err_msg=f"piece {i}")
    total = float(np.sum(ce[:3] * packed["weights"]))
    assert_close(total, float(np.sum(ce[3:] * alone["weights"])))
