"""data.source='files': formats, packing, determinism, process shares, resume, eval, bad inputs."""
import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest

from maxtext_rocm import config as config_lib
from maxtext_rocm.data import build_source
from maxtext_rocm.data.documents import Documents, expand_paths, tokenized_dataset
from maxtext_rocm.data.files import FilesSource
from maxtext_rocm.data.packing import DocumentStream, RowPacker
from maxtext_rocm.data.tokenizer import ByteTokenizer
from conftest import small_config
from helpers import assert_close

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOK = ByteTokenizer()


def make_docs(n, seed=0, lo=3, hi=40):
    rng = np.random.default_rng(seed)
    words = ["alpha", "beta", "gamma", "delta", "eps", "zeta", "eta", "theta"]
    return [f"doc{i} " + " ".join(rng.choice(words, rng.integers(lo, hi))) for i in range(n)]


def write_jsonl(path, texts, field="text"):
    path.write_text("".join(json.dumps({field: t, "id": i}) + "\n" for i, t in enumerate(texts)))
    return path


def data_cfg(paths, **kw):
    cfg = config_lib.defaults().data
    cfg.update(source="files", paths=str(paths), **kw)
    return cfg


def source(paths, global_batch=4, seq_len=32, **kw):
    split = kw.pop("split", "train")
    pi, pc = kw.pop("process_index", 0), kw.pop("process_count", 1)
    return FilesSource(data_cfg(paths, **kw), vocab_size=512, global_batch=global_batch, seq_len=seq_len,
                       process_index=pi, process_count=pc, split=split)


def test_formats_read_the_same_documents(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    texts = make_docs(5)
    write_jsonl(tmp_path / "a.jsonl", texts, field="body")
    pq.write_table(pa.table({"body": texts}), tmp_path / "b.parquet")
    for i, t in enumerate(texts):
        (tmp_path / f"t{i}.txt").write_text(t)
    assert list(Documents(expand_paths(str(tmp_path / "a.jsonl")), "body")) == texts
    assert list(Documents(expand_paths(str(tmp_path / "b.parquet")), "body")) == texts
    assert list(Documents(expand_paths(str(tmp_path / "t*.txt")))) == texts
    both = Documents(expand_paths(f"{tmp_path}/a.jsonl,{tmp_path}/b.parquet"), "body")
    assert len(both) == 10 and both[7] == texts[2]


def test_pretokenize_script_round_trips_to_arrayrecord(tmp_path):
    texts = make_docs(6)
    write_jsonl(tmp_path / "c.jsonl", texts)
    out = tmp_path / "c.arrayrecord"
    result = subprocess.run([sys.executable, "scripts/pretokenize.py", str(tmp_path / "c.jsonl"), "--out", str(out)],
                            cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    docs = Documents(expand_paths(str(out)))
    assert docs.pretokenized and len(docs) == 6 and docs.meta["vocab_size"] == TOK.vocab_size
    for text, ids in zip(texts, docs):
        np.testing.assert_array_equal(ids, TOK.encode(text, bos=True, eos=True))
    # Same batches from the text and from its pre-tokenized form.
    a, b = source(tmp_path / "c.jsonl").batch(0), source(out).batch(0)
    for k in a:
        np.testing.assert_array_equal(a[k], b[k])


def test_packing_layout(tmp_path):
    texts = make_docs(30, lo=1, hi=6)  # each shorter than a row
    write_jsonl(tmp_path / "d.jsonl", texts)
    src = source(tmp_path / "d.jsonl", seq_len=64, packing="best_fit")  # whole documents
    b = src.batch(0)
    assert set(b) == {"inputs", "targets", "weights", "positions", "segment_ids"}
    assert all(v.shape == (4, 64) for v in b.values())
    for row in range(4):
        seg = b["segment_ids"][row]
        assert seg.max() >= 2  # several documents per row
        np.testing.assert_array_equal(b["weights"][row], seg > 0)
        for s in range(1, seg.max() + 1):
            where = np.flatnonzero(seg == s)
            np.testing.assert_array_equal(b["positions"][row][where], np.arange(len(where)))
            tokens = np.append(b["inputs"][row][where], b["targets"][row][where][-1])
            assert tokens[0] == TOK.bos_id and tokens[-1] == TOK.eos_id
            assert TOK.decode(tokens) in texts
    # Without packing: one document per row, padded, the padding weighted 0.
    b = source(tmp_path / "d.jsonl", seq_len=64, packing="none").batch(0)
    assert b["segment_ids"].max() == 1 and np.all(b["weights"] == (b["segment_ids"] > 0))
    assert b["weights"].sum(axis=1).min() < 64
    # A document longer than a row is cut, not dropped: every token is a target exactly once.
    write_jsonl(tmp_path / "long.jsonl", ["x" * 150])
    src = source(tmp_path / "long.jsonl", global_batch=1, seq_len=64)
    rows = [src.batch(s) for s in range(3)]
    got = np.concatenate([r["targets"][0][r["segment_ids"][0] == 1] for r in rows])
    np.testing.assert_array_equal(got, TOK.encode("x" * 150, bos=True, eos=True)[1:])


def test_packed_logits_equal_each_document_alone(tmp_path):
    from maxtext_rocm.models import build_model
    from maxtext_rocm.numerics.precision import policy_from_config

    from maxtext_rocm.resolve import resolve_here

    cfg = resolve_here(small_config(**{"model.vocab_size": 512}))
    model = build_model(cfg.model, policy_from_config(cfg.precision, jax.devices()[0]))
    params = jax.jit(model.init)(jax.random.key(0), np.zeros((1, 8), np.int32))["params"]
    write_jsonl(tmp_path / "p.jsonl", make_docs(12, lo=2, hi=8))
    b = source(tmp_path / "p.jsonl", global_batch=2, seq_len=64).batch(0)
    apply = jax.jit(lambda *a: model.apply({"params": params}, *a))
    packed = np.asarray(apply(b["inputs"], b["positions"], b["segment_ids"]))
    # Each document alone, at the start of its own row (what follows it cannot matter: causal).
    pieces = [(row, np.flatnonzero(b["segment_ids"][row] == s))
              for row in range(2) for s in range(1, b["segment_ids"][row].max() + 1)]
    alone_inputs = np.zeros((len(pieces), 64), np.int32)
    for i, (row, where) in enumerate(pieces):
        alone_inputs[i, :len(where)] = b["inputs"][row][where]
    alone = np.asarray(apply(alone_inputs, None, None))
    checked = 0
    for i, (row, where) in enumerate(pieces):
        assert_close(packed[row][where], alone[i, :len(where)])
        checked += 1
    assert checked >= 4


def test_same_seed_same_batches_other_seed_other(tmp_path):
    write_jsonl(tmp_path / "s.jsonl", make_docs(40))
    a = [source(tmp_path / "s.jsonl", seed=1).batch(i)["inputs"] for i in range(3)]
    b = [source(tmp_path / "s.jsonl", seed=1).batch(i)["inputs"] for i in range(3)]
    c = [source(tmp_path / "s.jsonl", seed=2).batch(i)["inputs"] for i in range(3)]
    for x, y in zip(a, b):
        np.testing.assert_array_equal(x, y)
    assert not all(np.array_equal(x, z) for x, z in zip(a, c))


def test_two_processes_read_every_document_once_per_epoch(tmp_path):
    n = 37
    write_jsonl(tmp_path / "e.jsonl", [f"unique-{i:03d}" for i in range(n)])
    docs = Documents(expand_paths(str(tmp_path / "e.jsonl")))
    dataset = tokenized_dataset(docs, TOK, bos=False, eos=False)
    for epoch in range(2):
        seen = []
        for p in range(2):
            stream = DocumentStream(dataset, seed=3, process_index=p, process_count=2)
            packer = RowPacker(stream, seq_len=16, packing="none")  # each (short) document whole, in order
            order = stream.order(epoch)
            seen.append([TOK.decode(dataset[int(i)]) for i in order])
            # The packer reads exactly that share: the targets of one epoch spell it out.
            rows = []
            while packer.epoch == 0:
                rows.append(packer.row())
            if epoch == 0:
                got = [TOK.decode(np.append(r["inputs"][r["segment_ids"] == s][:1], r["targets"][r["segment_ids"] == s]))
                       for r in rows for s in range(1, r["segment_ids"].max() + 1)]
                assert got == seen[-1]
        assert not set(seen[0]) & set(seen[1])
        assert sorted(seen[0] + seen[1]) == [f"unique-{i:03d}" for i in range(n)]
        assert abs(len(seen[0]) - len(seen[1])) <= 1
    # Epochs are reshuffled; global batches split evenly between the processes.
    assert DocumentStream(dataset, 3, 0, 2).order(0).tolist() != DocumentStream(dataset, 3, 0, 2).order(1).tolist()
    parts = [source(tmp_path / "e.jsonl", process_index=p, process_count=2).batch(0) for p in range(2)]
    assert parts[0]["inputs"].shape == (2, 32)


def test_iterator_state_round_trip(tmp_path):
    write_jsonl(tmp_path / "r.jsonl", make_docs(4, lo=5, hi=15))  # several epochs in 12 steps
    whole = source(tmp_path / "r.jsonl")
    expected = [whole.batch(i) for i in range(12)]
    first = source(tmp_path / "r.jsonl")
    for i in range(5):
        first.batch(i)
    state = json.loads(json.dumps(first.state()))  # what a checkpoint keeps
    assert state["step"] == 5 and state["epoch"] >= 1
    first.close()
    resumed = source(tmp_path / "r.jsonl")
    resumed.restore(state)
    for i in range(5, 12):
        got = resumed.batch(i)
        for k in got:
            np.testing.assert_array_equal(got[k], expected[i][k])
    # A state with only the step (an older checkpoint) replays up to it.
    replay = source(tmp_path / "r.jsonl")
    replay.restore({"step": 7})
    np.testing.assert_array_equal(replay.batch(7)["inputs"], expected[7]["inputs"])


def test_trainer_checkpoint_resume_sees_the_same_batches(tmp_path, devices):
    write_jsonl(tmp_path / "k.jsonl", make_docs(40))
    overrides = {"model.vocab_size": 512, "data.source": "files", "data.paths": str(tmp_path / "k.jsonl"),
                 "output_dir": str(tmp_path / "run"), "checkpoint.every": 2, "checkpoint.async_save": False,
                 "train.steps": 3}
    from maxtext_rocm.train import Trainer

    trainer = Trainer(small_config(**overrides), devices=devices, log=lambda *_: None)
    trainer.run()
    reference = [np.asarray(trainer.data.batch(s)["inputs"]) for s in (2, 3)]
    resumed = Trainer(small_config(**overrides), devices=devices, log=lambda *_: None)
    assert resumed.step_count == 3 and resumed.data.state()["step"] == 3
    np.testing.assert_array_equal(resumed.data.batch(3)["inputs"], reference[1])


def test_eval_loss_is_the_token_mean(tmp_path, devices):
    from maxtext_rocm.trainer.step import token_losses
    from maxtext_rocm.train import Trainer

    write_jsonl(tmp_path / "train.jsonl", make_docs(20))
    write_jsonl(tmp_path / "eval.jsonl", make_docs(7, seed=9, lo=1, hi=5))
    cfg = small_config(**{"model.vocab_size": 512, "data.source": "files", "data.paths": str(tmp_path / "train.jsonl"),
                          "data.eval_paths": str(tmp_path / "eval.jsonl"), "train.eval_every": 2,
                          "train.eval_steps": 2, "train.steps": 2, "checkpoint.enabled": False, "output_dir": str(tmp_path / "run"),
                          "data.packing": "best_fit"})  # whole documents: padding, which the mean leaves out
    trainer = Trainer(cfg, devices=devices, log=lambda *_: None)
    got = trainer.evaluate()
    params = jax.device_get(trainer.state.params)
    ce_sum = tokens = 0.0
    for i in range(2):
        b = trainer.eval_data.batch(i)
        logits = jax.jit(trainer.model.apply)({"params": params}, b["inputs"], b["positions"], b["segment_ids"])
        ce, _ = token_losses(logits, b["targets"])
        ce_sum += float(np.sum(np.asarray(ce) * b["weights"]))
        tokens += float(b["weights"].sum())
    assert got["eval_tokens"] == tokens and tokens < 2 * 8 * 32  # padding is not counted
    assert got["eval_loss"] == pytest.approx(ce_sum / tokens, rel=1e-5)
    assert got["eval_perplexity"] == pytest.approx(np.exp(ce_sum / tokens), rel=1e-5)
    assert trainer.evaluate()["eval_loss"] == pytest.approx(got["eval_loss"], rel=1e-6)  # same batches
    trainer.run()
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in rows if "eval_loss" in r]
    assert [r["step"] for r in evals] == [2] and all(r["eval_perplexity"] > 1 for r in evals)


def test_build_source_files_and_describe(tmp_path):
    write_jsonl(tmp_path / "b.jsonl", make_docs(8))
    cfg = data_cfg(tmp_path / "b.jsonl")
    src = build_source(cfg, vocab_size=512, global_batch=2, seq_len=16)
    assert isinstance(src, FilesSource) and "8 documents" in src.describe()


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "maxtext_rocm.train", "configs/tiny_llama.py",
                           "--config.data.source=files", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=120)


def test_bad_inputs_exit_2_with_one_sentence(tmp_path):
    write_jsonl(tmp_path / "good.jsonl", make_docs(3))
    write_jsonl(tmp_path / "other.jsonl", make_docs(3), field="content")
    (tmp_path / "empty.jsonl").write_text("")
    vocab = tmp_path / "vocab.json"
    cases = [
        ([f"--config.data.paths={tmp_path}/missing/*.jsonl"], "matches no file"),
        ([f"--config.data.paths={tmp_path}/empty.jsonl"], "empty.jsonl is empty"),
        ([f"--config.data.paths={tmp_path}/other.jsonl"], "has no field 'text' (data.text_field)"),
        ([f"--config.data.paths={tmp_path}/good.jsonl", "--config.model.vocab_size=200"],
         "model.vocab_size=200"),
    ]
    try:
        from tokenizers import Tokenizer, models

        Tokenizer(models.WordLevel({f"w{i}": i for i in range(600)}, unk_token="w0")).save(str(vocab))
        cases.append(([f"--config.data.paths={tmp_path}/good.jsonl", f"--config.data.tokenizer={vocab}"],
                      "has 600 ids but model.vocab_size=512"))
    except ImportError:
        pass
    for args, message in cases:
        result = _cli(*args)
        assert result.returncode == 2, (args, result.stderr)
        assert message in result.stderr, result.stderr
        assert "Traceback" not in result.stderr
        assert len(result.stderr.strip().splitlines()) == 1, result.stderr
