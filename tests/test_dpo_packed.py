"""Preference pairs packed into rows (data.format='preference', data.packing='best_fit';
data/packed_pairs.py, finetune/dpo.py): every pair once per epoch, each process its own; each
pair's loss and gradient as the same pair has in its two unpacked rows of train.seq_len
(data/preference.py, the reference); a pair that cannot fit a row refused in one sentence."""
from __future__ import annotations

import collections
import json

import jax
import ml_collections
import numpy as np
import pytest

from conftest import small_config
from helpers import assert_close, initial_run
from maxtext_rocm import config as config_lib
from maxtext_rocm.data import kept
from maxtext_rocm.data.checks import DataError
from maxtext_rocm.data.files import FilesSource, check_inputs
from maxtext_rocm.data.packed_pairs import packed_row
from maxtext_rocm.data.preference import pair_row, truncate_pair
from maxtext_rocm.finetune import dpo
from maxtext_rocm.trainer import step as step_lib

ONE_DEVICE = {f"mesh.ici.{a}": 1 for a in ("data", "fsdp", "expert", "sequence", "tensor")}
SEQ_LEN = 64
DPO_CFG = {"beta": 0.5, "label_smoothing": 0.0}


@pytest.fixture(autouse=True)
def own_kept_examples(monkeypatch):
    """What a start-up check keeps for a source (data/kept.py) stays in this module."""
    monkeypatch.setattr(kept, "_WAITING", collections.OrderedDict())


def write_pairs(path, count: int, seed: int = 0, longest: int = 24):
    """Byte-tokenized pairs of many lengths, each told apart by its number."""
    rng = np.random.default_rng(seed)
    with open(path, "w") as f:
        for i in range(count):
            f.write(json.dumps({"prompt": f"{i}:" + "q" * int(rng.integers(0, 8)),
                                "chosen": "a" * int(rng.integers(1, longest)),
                                "rejected": "b" * int(rng.integers(1, longest))}) + "\n")
    return path


def packed_cfg(path, **keys):
    cfg = config_lib.defaults().data
    cfg.update(source="files", paths=str(path), format="preference", packing="best_fit", packing_window=16, **keys)
    return cfg


def pair_of_chosen(source) -> dict:
    """Each pair's chosen token ids -> its record index."""
    return {tuple(int(t) for t in source.dataset[i].chosen.tokens[:-1]): i for i in range(len(source.dataset))}


def test_every_pair_is_packed_whole_once_per_epoch_by_each_process_its_own(tmp_path):
    cfg = packed_cfg(write_pairs(tmp_path / "pairs.jsonl", 45))
    check_inputs(cfg, 512, SEQ_LEN)
    shares = [FilesSource(cfg, vocab_size=512, global_batch=4, seq_len=SEQ_LEN, process_index=p, process_count=2)
              for p in range(2)]
    chosen = pair_of_chosen(shares[0])
    assert shares[0].batch(0)["inputs"].shape == (2, SEQ_LEN)  # this process's rows of 4
    seen = []
    for share in shares:  # each process's rows, one at a time, to the end of its epoch
        packer = share._make_packer()
        while packer.epoch == 0:
            row = packer.row()
            segments, pairs = row["segment_ids"], row["pair_ids"]
            for k in range(1, pairs.max() + 1):
                first = np.flatnonzero(segments == 2 * k - 1)  # the chosen sequence: positions 0, 1, ...
                assert np.array_equal(row["positions"][first], np.arange(len(first)))
                assert set(np.flatnonzero(pairs == k)) == set(first) | set(np.flatnonzero(segments == 2 * k))
                seen.append(chosen[tuple(int(t) for t in row["inputs"][first])])
    assert sorted(seen) == list(range(45))
    assert all(share.describe().count("whole pairs best-fit into rows") for share in shares)


def test_a_pair_longer_than_a_packed_row_is_refused_in_one_sentence(tmp_path, capsys):
    from test_bad_inputs import assert_one_sentence, run_main

    path = write_pairs(tmp_path / "pairs.jsonl", 3, longest=60)
    with pytest.raises(DataError, match=r"pairs\.jsonl line \d+: .*train\.seq_len=64; raise train\.seq_len .*"
                                        r"data\.packing='none'"):
        check_inputs(packed_cfg(path), 512, SEQ_LEN)
    status, err = run_main(capsys, "configs/tiny_llama.py", "--config.train.objective=dpo", "--config.train.seq_len=64",
                           "--config.data.source=files", "--config.data.format=preference", f"--config.data.paths={path}",
                           "--config.data.packing=best_fit", f"--config.output_dir={tmp_path}/run")
    assert_one_sentence(status, err, "pairs.jsonl line ", "more than a packed row of train.seq_len=64")
    assert not (tmp_path / "run").exists() or not any((tmp_path / "run").iterdir())


def test_packed_logprobs_sum_each_sequence_over_its_own_positions():
    pairs = [truncate_pair(*p, 16) for p in _toy_pairs()]
    row = packed_row(pairs, 16)
    rng = np.random.default_rng(0)
    token_logps = rng.normal(size=(1, 16)).astype(np.float32)
    got = np.asarray(dpo.packed_logprobs(token_logps * row["weights"], {k: v[None] for k, v in row.items()}))
    want = np.zeros(2 * 16, np.float32)
    for slot in range(2 * len(pairs)):
        want[slot] = (token_logps[0] * row["weights"])[row["segment_ids"] == slot + 1].sum()
    assert_close(got, want, scale=1e-6)
    real = np.asarray(dpo.real_pairs({k: v[None] for k, v in row.items()}, 16))
    assert real.tolist() == [1.0] * len(pairs) + [0.0] * (16 - len(pairs))


def _toy_pairs():
    from maxtext_rocm.data.example import TokenizedExample

    def ex(tokens, prompt):
        return TokenizedExample(np.array(tokens, np.int32), np.arange(len(tokens)) >= prompt)

    return [(ex([1, 2, 3, 4], 2), ex([1, 2, 5], 2)), (ex([7, 8, 9], 1), ex([7, 6, 6, 6], 1))]


# ------------------------------------------------------------------------------------------------
# Each pair's loss and gradient, packed against its two unpacked rows of train.seq_len


def unpacked_and_packed(source, indices, seq_len: int):
    """The pairs `indices` as unpacked rows (pair i: rows 2i, 2i+1) and packed two rows' worth
    (first half of the pairs in row 0, the rest in row 1), with each packed pair's place."""
    pairs = [truncate_pair(*source.dataset[i], seq_len) for i in indices]
    rows = [pair_row(e, seq_len) for pair in pairs for e in pair]
    unpacked = {k: np.stack([r[k] for r in rows]) for k in rows[0]}
    half = len(pairs) // 2
    packed_rows = [packed_row(pairs[:half], seq_len), packed_row(pairs[half:], seq_len)]
    packed = {k: np.stack([r[k] for r in packed_rows]) for k in packed_rows[0]}
    places = [(0, k) for k in range(half)] + [(1, k) for k in range(len(pairs) - half)]
    return unpacked, packed, places


def only_pair(batch, pair: int, place=None) -> dict:
    """`batch` with every pair but one emptied (no weight, no segment, no pair id: padding)."""
    if place is None:
        keep = np.zeros(batch["inputs"].shape, bool)
        keep[2 * pair:2 * pair + 2] = True
    else:
        row, k = place
        keep = np.zeros(batch["inputs"].shape, bool)
        keep[row] = batch["pair_ids"][row] == k + 1
    return {key: np.where(keep, v, 0) if key in ("weights", "segment_ids", "pair_ids") else v
            for key, v in batch.items()}


@pytest.mark.slow  # 4 compiled programs (2 layouts x loss and step): 10-25 s on a shared 2-core machine
def test_packed_pairs_have_the_losses_and_gradients_they_have_unpacked(tmp_path):
    path = write_pairs(tmp_path / "pairs.jsonl", 12, seed=3)
    cfg = small_config(**ONE_DEVICE, **{
        "model.vocab_size": 512, "train.seq_len": SEQ_LEN, "train.per_device_batch_size": 2,
        "model.loss_chunk_len": 8, "data.source": "files", "data.format": "preference", "data.paths": str(path),
        "data.packing": "best_fit", "train.objective": "dpo", "output_dir": str(tmp_path / "run")})
    run = initial_run(cfg, jax.devices()[:1])
    assert "pair_ids" in jax.device_get(run.batch(0))
    source = FilesSource(packed_cfg(path), vocab_size=512, global_batch=2, seq_len=SEQ_LEN)
    unpacked, packed, places = unpacked_and_packed(source, [0, 1, 2, 3], SEQ_LEN)
    rng = np.random.default_rng(1)
    params = jax.tree_util.tree_map(lambda x: x + rng.normal(0, 0.02, x.shape).astype(x.dtype),
                                    jax.device_get(run.state.params))
    reference = run.state.reference
    frozen = ml_collections.FrozenConfigDict(DPO_CFG)

    def pair_losses(params, batch, fused):  # each pair slot's DPO loss, the slots no pair fills at 0
        policy = dpo.sequence_logprobs(params, run.model, batch, fused=fused).logps
        ref = dpo.sequence_logprobs(reference, run.model, batch, fused=fused).logps
        return dpo.pair_terms(policy, ref, DPO_CFG["beta"]).losses * dpo.real_pairs(batch, policy.shape[0] // 2)

    with run.sharding_rules():
        for fused in (False, True):
            losses = jax.jit(lambda p, b, fused=fused: pair_losses(p, b, fused))
            want = np.asarray(losses(params, unpacked))
            got = np.asarray(losses(params, packed)).reshape(2, SEQ_LEN)
            assert_close(np.array([got[row, k] for row, k in places]), want, scale=1e-6, err_msg=f"fused {fused}")
            assert np.count_nonzero(got) == len(places)
        logp_scale = float(np.abs(jax.jit(lambda p, b: dpo.sequence_logprobs(p, run.model, b, fused=False).logps)(
            params, unpacked)).max())
        objective = step_lib.dpo_objective(run.model, reference, frozen)
        step = jax.jit(lambda p, b: step_lib.gradients(p, run.model, b, 1, 0.0, objective=objective))
        for pair in [None, *range(len(places))]:
            a = unpacked if pair is None else only_pair(unpacked, pair)
            b = packed if pair is None else only_pair(packed, pair, places[pair])
            got, want = step(params, b), step(params, a)
            assert float(got.metrics["pairs"]) == float(want.metrics["pairs"]) == (4 if pair is None else 1)
            for key in ("loss", "dpo_accuracy", "tokens"):
                assert_close(float(got.metrics[key]), float(want.metrics[key]), scale=1e-6, err_msg=f"{pair} {key}")
            # A reward is beta x the difference of two sums of ~100 log-probabilities: its fp32
            # rounding is at the scale of those sums, not of the (small) difference.
            for key in ("dpo_reward_margin", "dpo_chosen_reward", "dpo_rejected_reward"):
                np.testing.assert_allclose(float(got.metrics[key]), float(want.metrics[key]), rtol=0,
                                           atol=1e-6 * DPO_CFG["beta"] * logp_scale, err_msg=f"{pair} {key}")
            assert_close(jax.device_get(got.grads), jax.device_get(want.grads), scale=1e-6, err_msg=str(pair))


@pytest.mark.slow  # a DPO run through the CLI on 2 devices (data=2): ~15 s on a shared 2-core machine
def test_a_packed_dpo_run_trains_through_the_cli(tmp_path):
    import subprocess
    import sys

    from test_dpo import CLI_ENV, LN2, REPO, TINY_MESH, TINY_MODEL

    path = write_pairs(tmp_path / "pairs.jsonl", 40, longest=10)
    result = subprocess.run(
        [sys.executable, "-m", "maxtext_rocm.train", "configs/tiny_llama.py", *TINY_MODEL, *TINY_MESH,
         "--config.mesh.ici.data=2", "--config.train.steps=3", "--config.train.objective=dpo",
         "--config.train.seq_len=64", "--config.data.source=files", f"--config.data.paths={path}",
         "--config.data.format=preference", "--config.data.packing=best_fit", f"--config.output_dir={tmp_path}/run"],
        cwd=REPO, env=CLI_ENV, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    rows = [row for row in rows if "loss" in row]
    assert rows[0]["loss"] == pytest.approx(LN2, abs=1e-6)  # the policy is its reference at the first step
    assert all(row["padding_fraction"] < 0.5 for row in rows)  # 4 rows of 64 positions, several pairs each
