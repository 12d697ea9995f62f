"""Rows of one example padded to buckets (data/bucketed.py), not to train.seq_len: SFT records under
data.packing='none' and DPO's preference pairs. An epoch's plan holds every record once, in
batches of one bucket that every process agrees on; a bucketed batch gives each example the loss
and gradient it has padded to train.seq_len; a run compiles one step per bucket it uses and resumes
mid-epoch bit for bit."""
import json
from concurrent.futures import Future

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

from conftest import small_config
from helpers import assert_close, initial_run
from maxtext_rocm import config as config_lib
from maxtext_rocm.data import resume
from maxtext_rocm.data.bucketed import EMPTY, plan_epoch
from maxtext_rocm.data.buckets import bucket_of
from maxtext_rocm.data.checks import DataError
from maxtext_rocm.data.files import FilesSource, check_inputs
from maxtext_rocm.errors import ConfigError
from maxtext_rocm.finetune import dpo
from maxtext_rocm.trainer import step as step_lib

ONE_DEVICE = {f"mesh.ici.{a}": 1 for a in ("data", "fsdp", "expert", "sequence", "tensor")}
SEQ_LEN, BUCKETS = 64, (16, 32, 48, 64)  # bucket_lengths(64): quarters, multiples of 8
DPO_CFG = {"beta": 0.5, "label_smoothing": 0.0}


@pytest.fixture(autouse=True)
def own_kept_examples(monkeypatch):
    """What the start-up checks here keep for a source (data/kept.py) stays in this module: the byte
    tokenizer is made anew for each reader, so a source never takes what a check of it kept, and a
    later test of the cache (test_tokenize_once.py) would find it there."""
    import collections

    from maxtext_rocm.data import kept

    monkeypatch.setattr(kept, "_WAITING", collections.OrderedDict())


def write_records(path, fmt: str, count: int, seed: int = 0):
    """Byte-tokenized records of many lengths (all within SEQ_LEN), each told apart by its number."""
    rng = np.random.default_rng(seed)
    with open(path, "w") as f:
        for i in range(count):
            prompt = f"{i}:" + "q" * int(rng.integers(0, 12))
            if fmt == "preference":
                record = {"prompt": prompt, "chosen": "a" * int(rng.integers(1, 45)),
                          "rejected": "b" * int(rng.integers(1, 40))}
            else:
                record = {"prompt": prompt, "completion": "a" * int(rng.integers(1, 45))}
            f.write(json.dumps(record) + "\n")
    return path


def data_cfg(path, fmt: str, **keys):
    cfg = config_lib.defaults().data
    cfg.update(source="files", paths=str(path), format=fmt, packing="none", **keys)
    return cfg


def test_an_epochs_plan_holds_every_record_once_in_batches_of_one_bucket():
    lengths = np.random.default_rng(1).integers(1, SEQ_LEN + 1, 203)
    plan = plan_epoch(lengths, BUCKETS, 8, seed=3, epoch=0)
    records = np.concatenate([b.records for b in plan])
    assert sorted(records[records != EMPTY]) == list(range(203))  # every record once, none dropped
    assert len(plan) == -(-203 // 8) and sum((b.records == EMPTY).any() for b in plan) == 1  # one partial batch
    for b in plan:  # each batch as long as the bucket of its longest row
        assert b.length == bucket_of(int(lengths[b.records[b.records != EMPTY]].max()), SEQ_LEN, BUCKETS)
    # Leftovers of a bucket join the next one: batches of the 64 bucket hold shorter rows, the rest
    # of every batch lies in its own bucket.
    assert sum(b.length == 16 for b in plan) == np.sum(lengths <= 16) // 8
    # A pure function of (seed, epoch): the same plan again, another one for the next epoch.
    again = plan_epoch(lengths, BUCKETS, 8, seed=3, epoch=0)
    assert all(a.length == b.length and np.array_equal(a.records, b.records) for a, b in zip(plan, again))
    other = np.concatenate([b.records for b in plan_epoch(lengths, BUCKETS, 8, seed=3, epoch=1)])
    assert not np.array_equal(other, records)
    # An evaluation split keeps the file order, each batch padded to its longest row's bucket.
    unshuffled = plan_epoch(lengths, BUCKETS, 8, seed=3, epoch=0, shuffle=False)
    assert list(unshuffled[0].records) == list(range(8))


def source_records(source) -> dict:
    """Each record's token ids (a preference pair: its chosen row's) -> its index."""
    out = {}
    for index in range(len(source.dataset)):
        item = source.dataset[index]
        tokens = (item.chosen if source.format == "preference" else item).tokens
        out[tuple(int(t) for t in tokens[:-1])] = index
    return out


@pytest.mark.parametrize("fmt", ["prompt_completion", "preference"])
def test_processes_agree_on_each_steps_bucket_and_read_every_record_once_per_epoch(tmp_path, fmt):
    path = write_records(tmp_path / "records.jsonl", fmt, 37)
    cfg = data_cfg(path, fmt)
    check_inputs(cfg, 512, SEQ_LEN)
    shares = [FilesSource(cfg, vocab_size=512, global_batch=8, seq_len=SEQ_LEN, process_index=p, process_count=2)
              for p in range(2)]
    records = source_records(shares[0])
    rows_per_record = 2 if fmt == "preference" else 1
    steps = -(-37 * rows_per_record // 8)
    seen, lengths = [], set()
    for step in range(steps):
        batches = [share.batch(step) for share in shares]
        assert batches[0]["inputs"].shape == batches[1]["inputs"].shape  # one bucket for every process
        lengths.add(batches[0]["inputs"].shape[1])
        for batch in batches:
            for row in range(0, len(batch["inputs"]), rows_per_record):
                n = int((batch["segment_ids"][row] > 0).sum())
                if n:  # not an empty row completing the epoch's last batch
                    seen.append(records[tuple(int(t) for t in batch["inputs"][row, :n])])
        if fmt == "preference":  # a pair's rows share the batch's length and lie side by side
            assert np.array_equal(batches[0]["inputs"][0::2, :3], batches[0]["inputs"][1::2, :3])
    assert sorted(seen) == list(range(37)) and lengths <= set(BUCKETS) and len(lengths) > 1
    assert shares[0].state()["epoch"] == 1 and shares[0].state() == shares[1].state()


def test_a_bucket_list_that_is_not_ascending_lengths_up_to_seq_len_is_refused(tmp_path, capsys):
    from test_bad_inputs import assert_one_sentence, run_main

    status, err = run_main(capsys, "configs/tiny_llama.py", "--config.data.buckets=512,128",
                           f"--config.output_dir={tmp_path}/run")
    assert_one_sentence(status, err, "data.buckets='512,128' is not valid for train.seq_len=", "ascending row lengths")
    for bad in ("64,32", "0,32", "16,128", "short", "16,16,32"):
        with pytest.raises(ConfigError, match=r"data\.buckets=.* is not valid"):
            config_lib.validate(small_config(**{"data.buckets": bad}))
    with pytest.raises(ConfigError, match=r"pads rows that hold one example"):  # packed rows have no buckets
        config_lib.validate(small_config(**{"data.buckets": "16,32"}))
    cfg = small_config(**{"data.buckets": "16,32"})
    cfg.data.update(source="files", paths="x.jsonl", format="chat", packing="none")
    config_lib.validate(cfg)


def test_a_checkpoint_of_other_batches_is_refused_mid_epoch_and_continued_at_an_epoch_boundary():
    plan = {"buckets": [16, 32, 64], "rows": 8}
    saved = {"step": 5, "shards": 2, "positions": [{"epoch": 1, "cursor": 3, "offset": 0}] * 2, "plan": plan}
    assert resume.planned_position(saved, plan, 5, False) == {"epoch": 1, "cursor": 3, "offset": 0}
    with pytest.raises(DataError, match="middle of epoch 1 .* data.buckets=16,32,64 and a global batch of 8 rows"):
        resume.planned_position(saved, {**plan, "rows": 16}, 5, False)
    unplanned = {**saved, "plan": None}
    with pytest.raises(DataError, match=r"rows of train.seq_len \(no data.buckets\)"):
        resume.planned_position(unplanned, plan, 5, False)
    boundary = {**unplanned, "positions": [{"epoch": 2, "cursor": 0, "offset": 0}]}
    assert resume.planned_position(boundary, plan, 5, False) == {"epoch": 2, "cursor": 0, "offset": 0}


# ------------------------------------------------------------------------------------------------
# Losses and gradients: a bucketed batch against the same examples padded to train.seq_len


def run_on(tmp_path, fmt: str):
    path = write_records(tmp_path / f"{fmt}.jsonl", fmt, 24, seed=5)
    cfg = small_config(**ONE_DEVICE, **{
        "model.vocab_size": 512, "train.seq_len": SEQ_LEN, "train.per_device_batch_size": 8,
        "model.loss_chunk_len": 8, "data.source": "files", "data.format": fmt, "data.paths": str(path),
        "data.packing": "none", "train.objective": "dpo" if fmt == "preference" else "lm",
        "output_dir": str(tmp_path / "run")})
    run = initial_run(cfg, jax.devices()[:1])
    assert run.cfg.data.buckets == "16,32,48,64"  # 'auto', resolved
    batch = next(b for b in (jax.device_get(run.batch(s)) for s in range(6)) if b["inputs"].shape[1] < SEQ_LEN)
    padded = {k: np.pad(v, ((0, 0), (0, SEQ_LEN - v.shape[1]))) for k, v in batch.items()}
    return run, batch, padded


def moved(params, scale=0.02):
    """`params` plus noise (drawn on the host: no program compiled per leaf shape)."""
    rng = np.random.default_rng(1)
    return jax.tree_util.tree_map(lambda x: x + rng.normal(0, scale, x.shape).astype(x.dtype), jax.device_get(params))


def row_logps(model, params, rows):
    """Each row's summed log-probability of its weighted targets, from the model's full logits."""
    logits = model.apply({"params": params}, rows["inputs"], rows["positions"], rows["segment_ids"])
    logits = logits[0] if isinstance(logits, tuple) else logits
    lp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    return jnp.sum(jnp.take_along_axis(lp, rows["targets"][..., None], -1)[..., 0] * rows["weights"], axis=-1)


def only(batch, example: int, rows_per_example: int) -> dict:
    """`batch` with every other example emptied (weight 0, segment 0: no token, no DPO pair), so
    the step's mean loss and gradient are this example's alone, from the same compiled program."""
    keep = np.zeros(len(batch["inputs"]), bool)
    keep[example * rows_per_example:(example + 1) * rows_per_example] = True
    return {k: np.where(keep[:, None], v, 0) if k in ("weights", "segment_ids") else v for k, v in batch.items()}


def assert_same_examples_and_step(run, batch, padded, example_losses, rows_per_example, objective):
    """Each example's loss (from the model's full logits) and its gradient (the train step's, on
    the batch with the other examples emptied), and the whole batch's step, bucketed and padded."""
    params = moved(run.state.params)
    with run.sharding_rules():
        losses = jax.jit(example_losses)
        assert_close(np.asarray(losses(params, batch)), np.asarray(losses(params, padded)), scale=1e-6)
        step = jax.jit(lambda p, b: step_lib.gradients(p, run.model, b, 1, 0.0, objective=objective))
        for example in [None, *range(len(batch["inputs"]) // rows_per_example)]:
            pick = (lambda b: b) if example is None else (lambda b: only(b, example, rows_per_example))
            got, want = step(params, pick(batch)), step(params, pick(padded))
            assert_close(float(got.metrics["loss"]), float(want.metrics["loss"]), scale=1e-6, err_msg=str(example))
            assert_close(jax.device_get(got.grads), jax.device_get(want.grads), scale=1e-6, err_msg=str(example))
    return params, step


@pytest.mark.slow  # 4 compiled programs: 20-50 s on a shared 2-core machine
def test_sft_examples_in_a_bucket_have_the_loss_and_gradient_they_have_padded_to_seq_len(tmp_path):
    run, batch, padded = run_on(tmp_path, "prompt_completion")

    def nll(params, rows):  # each row's summed negative log-likelihood
        return -row_logps(run.model, params, rows)

    assert_same_examples_and_step(run, batch, padded, nll, 1, step_lib.lm_objective(run.model, 0.0))


@pytest.mark.slow  # 4 compiled programs: 20-50 s on a shared 2-core machine
def test_dpo_pairs_in_a_bucket_have_the_loss_and_gradient_they_have_padded_to_seq_len(tmp_path):
    run, batch, padded = run_on(tmp_path, "preference")
    reference = run.state.reference

    def pair_losses(params, rows):  # each pair's DPO loss
        policy = row_logps(run.model, params, rows)
        ref = jax.lax.stop_gradient(row_logps(run.model, reference, rows))
        return dpo.pair_terms(policy, ref, DPO_CFG["beta"]).losses

    objective = step_lib.dpo_objective(run.model, reference, ml_collections.FrozenConfigDict(DPO_CFG))
    params, step = assert_same_examples_and_step(run, batch, padded, pair_losses, 2, objective)
    # The empty pair that completes an epoch's last batch counts in no mean: a batch whose last pair
    # is empty trains as the batch of its other pairs.
    emptied = {k: v.copy() for k, v in batch.items()}
    for v in emptied.values():
        v[-2:] = 0
    fewer = {k: v[:-2] for k, v in batch.items()}
    with run.sharding_rules():
        got, want = step(params, emptied), step(params, fewer)
    assert float(got.metrics["pairs"]) == len(batch["inputs"]) // 2 - 1
    assert_close(float(got.metrics["loss"]), float(want.metrics["loss"]), scale=1e-6)
    assert_close(jax.device_get(got.grads), jax.device_get(want.grads), scale=1e-6)


# ------------------------------------------------------------------------------------------------
# Runs: one compiled step per bucket used, bit-exact resume mid-epoch


def sft_run_config(tmp_path, fmt: str = "prompt_completion", **overrides):
    tmp_path.mkdir(parents=True, exist_ok=True)
    path = write_records(tmp_path / f"{fmt}.jsonl", fmt, 28, seed=7)
    return small_config(**ONE_DEVICE, **{
        "model.vocab_size": 512, "train.seq_len": SEQ_LEN, "train.per_device_batch_size": 4, "train.steps": 8,
        "data.source": "files", "data.format": fmt, "data.paths": str(path), "data.packing": "none",
        "train.objective": "dpo" if fmt == "preference" else "lm", "log.every": 1, "checkpoint.every": 4,
        "checkpoint.async_save": False, "optimizer.warmup_steps": 0, "optimizer.lr": 1e-3,
        "output_dir": str(tmp_path / "run"), **overrides})


def trained(cfg, steps=None):
    """(the row length of each step, metrics.jsonl's rows, the final parameters, the trainer)."""
    from maxtext_rocm.train import Trainer

    trainer = Trainer(cfg, devices=jax.devices()[:1], log=lambda *_: None)
    lengths = []
    trainer.on_step = lambda step, metrics: lengths.append(metrics["row_length"])
    trainer.run(steps)
    params = jax.device_get(trainer.state.params)
    trainer.close()
    rows = [json.loads(line) for line in open(f"{cfg.output_dir}/metrics.jsonl")]
    return lengths, rows, params, trainer


@pytest.mark.slow  # three short runs compiling 3-4 buckets each: ~40 s on a shared 2-core machine
def test_a_bucketed_run_compiles_one_step_per_bucket_and_resumes_mid_epoch_bit_for_bit(tmp_path):
    whole = sft_run_config(tmp_path / "whole")
    lengths, rows, params, trainer = trained(whole)
    # One compiled program per bucket the steps used; the full-length step only if a batch needed it.
    full = trainer._compiled_step  # a Future until a batch of train.seq_len asks for it (launch.CompiledOnFirstUse)
    compiled = set(trainer._steps_by_length) | ({SEQ_LEN} if not isinstance(full, Future) or full.done() else set())
    assert compiled == set(lengths) and len(set(lengths)) > 1 and set(lengths) <= set(BUCKETS)
    # Positions per second count each step's bucket (log.every=1: each row times its own step), and
    # real tokens those positions less the bucket's padding.
    for row, length in list(zip(rows, lengths))[1:]:
        assert row["tokens_per_s_per_device"] * row["step_time_s"] == pytest.approx(4 * length)
        assert row["real_tokens_per_s_per_device"] == pytest.approx(
            row["tokens_per_s_per_device"] * (1 - row["padding_fraction"]))
    assert trainer.data.state()["epoch"] == 1  # 8 steps of 4 rows crossed the epoch of 28 records
    interrupted = sft_run_config(tmp_path / "parts")
    first, _, _, _ = trained(interrupted, 4)
    second, both, resumed, again = trained(interrupted)  # resumes from step 4's checkpoint, mid-epoch
    assert again.data._start == {"step": 4, "epoch": 0, "cursor": 4, "offset": 0}  # restored, not replayed
    assert first + second == lengths
    # metrics.jsonl holds both launches' rows: the same losses and norms as the uninterrupted run's
    assert [(r["step"], r["loss"], r["grad_norm"]) for r in both] == \
        [(r["step"], r["loss"], r["grad_norm"]) for r in rows]
    assert jax.tree_util.tree_all(jax.tree_util.tree_map(np.array_equal, resumed, params))


@pytest.mark.slow  # a DPO run compiling 2-3 buckets: ~20 s on a shared 2-core machine
def test_a_bucketed_dpo_run_trains_its_pairs_in_buckets(tmp_path):
    cfg = sft_run_config(tmp_path, "preference", **{"train.steps": 6, "train.eval_every": 6, "train.eval_steps": 2,
                                                    "data.eval_paths": str(tmp_path / "preference.jsonl")})
    lengths, rows, _, trainer = trained(cfg)
    assert set(lengths) <= set(BUCKETS) and len(set(lengths)) > 1
    train = [row for row in rows if "eval_loss" not in row]
    assert train[0]["loss"] == pytest.approx(np.log(2.0), abs=1e-6) and np.isfinite(train[-1]["loss"])
    assert [row for row in rows if "eval_loss" in row][0]["eval_pairs"] == 4


def test_pairs_planned_over_buckets_are_tokenized_once_at_start_up(tmp_path, monkeypatch):
    """The plan needs every pair's length: the start-up check tokenizes every pair (not only the
    first, as without buckets), and the source trains on those examples, tokenizing none again."""
    import collections

    from chat_helpers import make_chat_tokenizer
    from maxtext_rocm.data import formats, kept

    pytest.importorskip("tokenizers")  # a tokenizer loaded once per file: the check's and the source's are one
    tokenizer = make_chat_tokenizer(tmp_path / "tok") / "tokenizer.json"
    path = write_records(tmp_path / "pairs.jsonl", "preference", 20)
    calls = collections.Counter()
    tokenize = formats.Tokenize.__call__

    def counting(self, item):
        calls[item[1]] += 1  # item: (record, "FILE line N")
        return tokenize(self, item)

    monkeypatch.setattr(formats.Tokenize, "__call__", counting)
    cfg = data_cfg(path, "preference", epochs=1, tokenizer=str(tokenizer))
    check_inputs(cfg, 320, SEQ_LEN)
    assert len(calls) == 20 and kept._WAITING  # every pair, kept for the source
    source = FilesSource(cfg, vocab_size=320, global_batch=8, seq_len=SEQ_LEN)
    assert not kept._WAITING  # the source took what the check kept
    for step in range(5):  # 20 pairs, 4 a batch: the whole (and only) epoch
        source.batch(step)
    source.close()
    assert len(calls) == 20 and set(calls.values()) == {1}


@pytest.mark.slow  # two 2-process launches: ~1-2 min on a shared 2-core machine
def test_two_processes_agree_on_the_buckets_and_resume_mid_epoch_bit_for_bit(tmp_path):
    """2 processes x 4 devices, 8 rows a step over a plan of 28 records: each step's positions are
    its planned bucket's on both processes, each checkpoint holds one position for both, and a run
    resumed from step 3 trains steps 4-6 as the uninterrupted run did, bit for bit."""
    from test_multihost_data import FILES, SAVING, TWO, assert_bit_for_bit, two_processes
    from test_distributed import SMALL, read_rows

    data = write_records(tmp_path / "records.jsonl", "prompt_completion", 28, seed=7)
    args = [*SMALL, *TWO, *FILES, *SAVING, f"--config.data.paths={data}", "--config.data.format=prompt_completion",
            "--config.data.packing=none", f"--config.train.seq_len={SEQ_LEN}", "--config.train.steps=6"]
    two_processes(tmp_path, "logs_whole", *args, "--config.checkpoint.every=3", f"--config.output_dir={tmp_path}/whole")
    whole = read_rows(tmp_path / "whole" / "metrics.jsonl")
    planned = FilesSource(data_cfg(data, "prompt_completion"), vocab_size=512, global_batch=8, seq_len=SEQ_LEN)
    lengths = [planned.batch(step)["inputs"].shape[1] for step in range(6)]
    assert len(set(lengths)) > 1
    for row, length in list(zip(whole, lengths))[1:]:  # positions a second: 8 rows of the step's bucket, 8 devices
        assert row["tokens_per_s_per_device"] * row["step_time_s"] == pytest.approx(length)
    saved = json.loads((tmp_path / "whole" / "checkpoints" / "3" / "data" / "metadata").read_text())
    assert saved["positions"] == [{"epoch": 0, "cursor": 3, "offset": 0}] * 2
    assert saved["plan"] == {"buckets": list(BUCKETS), "rows": 8}
    log0 = two_processes(tmp_path, "logs_resumed", *args, f"--config.checkpoint.resume={tmp_path}/whole/checkpoints/3",
                         f"--config.output_dir={tmp_path}/resumed")
    assert "resumed from" in log0
    assert_bit_for_bit(read_rows(tmp_path / "resumed" / "metrics.jsonl"), whole, [4, 5, 6])


def test_the_key_decides_which_rows_are_bucketed_and_resolves_to_lengths():
    """'auto' gives quarters to rows of one example (packing 'none' records, pairs, GRPO's prompts)
    and nothing to packed rows; 'none' and a list say so everywhere; the resolve step writes lengths."""
    from maxtext_rocm.data.buckets import resolved, row_buckets

    def data(fmt, packing="concat", buckets="auto"):
        return {"source": "files", "format": fmt, "packing": packing, "buckets": buckets}

    assert row_buckets(data("chat", "none"), SEQ_LEN) == BUCKETS
    assert row_buckets(data("preference"), SEQ_LEN) == row_buckets(data("prompt"), SEQ_LEN) == BUCKETS
    assert row_buckets(data("chat"), SEQ_LEN) is None and row_buckets(data("text", "none"), SEQ_LEN) is None
    assert row_buckets(data("prompt", buckets="none"), SEQ_LEN) is None  # GRPO's rows then all train.seq_len
    assert row_buckets(data("preference", buckets="24, 40"), SEQ_LEN) == (24, 40, SEQ_LEN)
    assert row_buckets({"source": "files", "format": "preference"}, SEQ_LEN) is None  # a config without the key
    assert resolved(data("preference"), SEQ_LEN) == "16,32,48,64" and resolved(data("text"), SEQ_LEN) == "none"
    assert resolved(data("preference"), SEQ_LEN, divisor=32) == "32,64"  # each splits over 32 sequence chunks
