"""The DPO objective (maxtext_rocm/finetune/dpo.py) against TRL's definition written as a formula:
its loss and gradient on fixed log-probabilities, on a model's full logits, sharded, accumulated,
and in a short training run that learns a preference."""

import math
import os
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

from maxtext_rocm.finetune import dpo
from maxtext_rocm.trainer import step as step_lib

from conftest import small_config
from helpers import assert_close, initial_run

ONE_DEVICE = {f"mesh.ici.{a}": 1 for a in ("data", "fsdp", "expert", "sequence", "tensor")}
LN2 = math.log(2.0)
REPO = Path(__file__).resolve().parent.parent
CLI_ENV = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2")  # the CLI on 2 devices


def trl_losses(policy_chosen, policy_rejected, ref_chosen, ref_rejected, beta, label_smoothing=0.0):
    """TRL's DPOTrainer, loss_type="sigmoid", in numpy (float64)."""
    logits = (policy_chosen - policy_rejected) - (ref_chosen - ref_rejected)
    log_sigmoid = lambda x: -np.logaddexp(0.0, -x)  # noqa: E731
    return -log_sigmoid(beta * logits) * (1 - label_smoothing) - log_sigmoid(-beta * logits) * label_smoothing


@pytest.mark.parametrize("label_smoothing", [0.0, 0.2])
def test_loss_and_gradient_equal_trl_formula_on_fixed_logprobs(label_smoothing):
    rng = np.random.default_rng(0)
    policy, ref = rng.normal(-40, 5, 8), rng.normal(-40, 5, 8)  # 4 pairs: chosen, rejected, ...
    beta = 0.3
    terms = dpo.pair_terms(jnp.asarray(policy), jnp.asarray(ref), beta, label_smoothing)
    want = trl_losses(policy[0::2], policy[1::2], ref[0::2], ref[1::2], beta, label_smoothing)
    assert_close(np.asarray(terms.losses), want)
    assert_close(np.asarray(terms.chosen_rewards), beta * (policy[0::2] - ref[0::2]))
    assert_close(np.asarray(terms.rejected_rewards), beta * (policy[1::2] - ref[1::2]))
    # d(mean loss)/d(policy logp): with x = beta (margin of log-ratios) and s = sigmoid,
    # dl/dx = -(1 - eps) s(-x) + eps s(x); chosen gets +beta dl/dx, rejected -beta dl/dx.
    x = beta * ((policy[0::2] - policy[1::2]) - (ref[0::2] - ref[1::2]))
    sig = lambda v: 1 / (1 + np.exp(-v))  # noqa: E731
    dl_dx = (-(1 - label_smoothing) * sig(-x) + label_smoothing * sig(x)) / len(x)
    want_grad = np.stack([beta * dl_dx, -beta * dl_dx], axis=1).reshape(-1)
    got_grad = jax.grad(lambda p: jnp.mean(dpo.pair_terms(p, jnp.asarray(ref), beta, label_smoothing).losses))(
        jnp.asarray(policy))
    assert_close(np.asarray(got_grad), want_grad)


def preference_batch(pairs: int, seq_len: int, vocab: int, seed: int = 0) -> dict:
    """The batch contract with data.format="preference": rows 2i (chosen) and 2i+1 (rejected) share
    a prompt; weights are 1 on the response's targets only; one document per row, then padding."""
    rng = np.random.default_rng(seed)
    rows = 2 * pairs
    tokens = np.zeros((rows, seq_len + 1), np.int32)
    weights = np.zeros((rows, seq_len), np.float32)
    segment_ids = np.zeros((rows, seq_len), np.int32)
    positions = np.zeros((rows, seq_len), np.int32)
    for p in range(pairs):
        prompt = rng.integers(1, vocab, rng.integers(3, seq_len // 2))
        for r in (2 * p, 2 * p + 1):
            response = rng.integers(1, vocab, rng.integers(2, seq_len - len(prompt)))
            doc = np.concatenate([prompt, response])
            tokens[r, :len(doc)] = doc
            # targets are tokens[1:]: target t predicts doc[t + 1]; the response's targets carry weight
            weights[r, len(prompt) - 1:len(doc) - 1] = 1.0
            segment_ids[r, :len(doc) - 1] = 1
            positions[r, :len(doc) - 1] = np.arange(len(doc) - 1)
    return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "weights": weights,
            "positions": positions, "segment_ids": segment_ids}


DPO_CFG = ml_collections.FrozenConfigDict({"beta": 0.5, "label_smoothing": 0.0})


def naive_dpo_loss(params, reference, model, batch, beta):
    """The DPO mean loss straight from the model's full logits (no fused head, no chunks)."""
    def logps(p):
        logits = model.apply({"params": p}, batch["inputs"], batch["positions"], batch["segment_ids"])
        logits = logits[0] if isinstance(logits, tuple) else logits
        lp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
        return jnp.sum(jnp.take_along_axis(lp, batch["targets"][..., None], -1)[..., 0] * batch["weights"], axis=1)

    pi, ref = logps(params), jax.lax.stop_gradient(logps(reference))
    x = beta * ((pi[0::2] - pi[1::2]) - (ref[0::2] - ref[1::2]))
    return jnp.mean(-jax.nn.log_sigmoid(x))


def moved(params, seed=1, scale=0.02):
    """`params` plus noise: a policy that is no longer its reference."""
    leaves, tree = jax.tree_util.tree_flatten(params)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    return jax.tree_util.tree_unflatten(tree, [x + scale * jax.random.normal(k, x.shape, x.dtype)
                                               for x, k in zip(leaves, keys)])


def dpo_gradients(run, params, batch, grad_accum=1):
    objective = step_lib.dpo_objective(run.model, run.state.reference, DPO_CFG)
    fn = jax.jit(lambda p, b: step_lib.gradients(p, run.model, b, grad_accum, 0.0, objective=objective))
    with run.sharding_rules():
        return fn(params, batch)


def on_mesh(run, host_batch):
    from maxtext_rocm.parallel import sharding
    return {k: jax.device_put(v, sharding.batch_sharding(run.mesh)) for k, v in host_batch.items()}


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    """A one-device DPO run at initialisation, its moved policy and the naive loss and gradient."""
    cfg = small_config(**ONE_DEVICE, **{"train.objective": "dpo", "train.per_device_batch_size": 8,
                                        "model.loss_chunk_len": 8, "output_dir": str(tmp_path_factory.mktemp("d"))})
    run = initial_run(cfg, jax.devices()[:1])
    batch = preference_batch(4, cfg.train.seq_len, cfg.model.vocab_size)
    params = moved(run.state.params)
    loss, grads = jax.jit(jax.value_and_grad(naive_dpo_loss), static_argnums=2)(
        params, run.state.reference, run.model, batch, DPO_CFG.beta)
    return run, batch, params, float(loss), grads


def test_reference_is_the_start_so_the_first_loss_is_ln2(single):
    run, batch, *_ = single
    ref_leaves = jax.tree_util.tree_leaves(run.state.reference)
    assert all(r.dtype == jnp.float32 for r in ref_leaves)  # fp32 policy: its compute dtype
    _, _, m = dpo_gradients(run, run.state.params, batch)
    assert float(m["loss"]) == pytest.approx(LN2, abs=1e-6)
    assert float(m["dpo_reward_margin"]) == 0.0 and float(m["dpo_accuracy"]) == 0.0
    assert float(m["pairs"]) == 4 and float(m["tokens"]) == float(batch["weights"].sum())


@pytest.mark.slow  # a pipelined model compiled (~15 s)
def test_a_pipeline_with_its_table_on_the_first_stage_gives_one_devices_dpo_gradient(single, tmp_path):
    """stage=2 x fsdp=4 (gpipe; DPO keeps the head on every stage): the policy's and the
    reference's tables are stored on the first stage (parallel/pipeline/layout.py), and the loss
    and gradient in model order are one device's."""
    run1, batch, params, _, _ = single
    want, _, want_metrics = dpo_gradients(run1, params, batch)
    cfg = small_config(**{**ONE_DEVICE, "mesh.ici.stage": 2, "mesh.ici.fsdp": 4, "train.objective": "dpo",
                          "train.per_device_batch_size": 1, "model.loss_chunk_len": 8, "output_dir": str(tmp_path)})
    run = initial_run(cfg, jax.devices())
    for tree in (run.state.params, run.state.reference):
        assert tree["embed"]["embedding"].shape[0] == 2 and tree["lm_head"]["kernel"].ndim == 2
    canonical = run.storage_order.canonical_abstract.params
    stored = run.storage_order.params_to_storage(
        jax.tree_util.tree_map(lambda a, like: jax.device_put(a, like.sharding), params, canonical))
    got, _, got_metrics = dpo_gradients(run, stored, on_mesh(run, batch))
    assert_close(float(got_metrics["loss"]), float(want_metrics["loss"]))
    assert_close(jax.tree_util.tree_map(np.asarray, run.storage_order.params_to_canonical(got)),
                 jax.tree_util.tree_map(np.asarray, want), scale=1e-4)


def test_gradient_equals_naive_formula_on_full_logits(single):
    run, batch, params, loss, grads = single
    got, _, m = dpo_gradients(run, params, batch)
    assert float(m["loss"]) != pytest.approx(LN2, abs=1e-3)  # the policy moved: a real test
    assert_close(float(m["loss"]), loss)
    assert_close(got, grads, scale=1e-4)


@pytest.mark.slow  # ~35 s on 2 busy cores; the fused head is the default path
def test_unfused_head_gives_the_same_gradient(single, tmp_path):
    run, batch, params, loss, grads = single
    cfg = small_config(**ONE_DEVICE, **{"train.objective": "dpo", "train.per_device_batch_size": 8,
                                        "model.loss_chunk_len": 0, "output_dir": str(tmp_path)})
    unfused = initial_run(cfg, jax.devices()[:1])
    got, _, m = dpo_gradients(unfused, params, batch)
    assert_close(float(m["loss"]), loss)
    assert_close(got, grads, scale=1e-4)


# 8 rows on 4 batch shards, under grad_accum=2 one per device: every pair straddles two devices.
@pytest.mark.parametrize("mesh", [
    {"mesh.ici.fsdp": 4},
    pytest.param({"mesh.ici.data": 2, "mesh.ici.fsdp": 2, "mesh.ici.tensor": 2}, marks=pytest.mark.slow),
])
def test_sharded_and_accumulated_equal_one_device(single, mesh, tmp_path):
    _, batch, params, loss, grads = single
    devices = jax.devices()[:4] if "mesh.ici.tensor" not in mesh else jax.devices()
    cfg = small_config(**{"train.objective": "dpo", "model.loss_chunk_len": 8, "output_dir": str(tmp_path),
                          "train.per_device_batch_size": 8 / len(devices), **mesh})
    run = initial_run(cfg, devices)
    params = jax.device_put(params, jax.tree_util.tree_map(lambda x: x.sharding, run.state.params))
    # Sharded and accumulated at once (one compilation in the default run): each alone is a special case.
    got, _, m = dpo_gradients(run, params, on_mesh(run, batch), grad_accum=2)
    assert_close(float(m["loss"]), loss)
    assert_close(jax.tree_util.tree_map(np.asarray, got), grads, scale=1e-4)


def test_micro_batches_keep_pairs_whole():
    rows = jnp.arange(16)[:, None]
    micro = step_lib.split_micro_batches({"x": rows}, 4, rows_together=2)["x"][..., 0]
    assert micro.shape == (4, 4)
    assert np.asarray(micro).tolist()[0] == [0, 1, 8, 9]  # pairs (0, 1) and (8, 9): every 4th pair
    assert sorted(np.asarray(micro).reshape(-1).tolist()) == list(range(16))
    assert all(int(m[i]) % 2 == 0 and int(m[i + 1]) == int(m[i]) + 1 for m in micro for i in (0, 2))


def test_odd_batches_are_refused(tmp_path):
    from maxtext_rocm.config import ConfigError
    from maxtext_rocm.trainer.preflight import check_run

    cfg = small_config(**ONE_DEVICE, **{"train.objective": "dpo", "train.per_device_batch_size": 6,
                                        "train.grad_accum": 2, "output_dir": str(tmp_path)})
    with pytest.raises(ConfigError, match="whole preference pairs .* multiple of 4"):
        check_run(cfg, 1, 1)
    cfg = small_config(**{"train.objective": "dpo", "train.per_device_batch_size": 2, "train.grad_accum": 2,
                          "mesh.dcn.fsdp": -1, "output_dir": str(tmp_path)})
    check_run(cfg, 2, 1)
    with pytest.raises(ConfigError, match="multiple of 8"):
        check_run(cfg, 2, 2)  # two processes of 2 rows each cannot each hold a pair per micro-batch
    for key, value, words in [("train.objective", "ppo", "choose one of 'lm', 'dpo'"),
                              ("dpo.beta", 0.0, "dpo.beta=0.0 is not valid"),
                              ("train.z_loss_weight", 1e-4, "set it to 0")]:
        bad = small_config(**ONE_DEVICE, **{"train.objective": "dpo", key: value, "output_dir": str(tmp_path)})
        with pytest.raises(ConfigError, match=words):
            check_run(bad, 1, 1)


class LearnablePreferences:
    """A data source of preference pairs with a rule to learn: chosen responses use the lower half
    of the vocabulary, rejected ones the upper half (inputs, targets and weights: the synthetic
    source's arrays)."""

    def __init__(self, rows, seq_len, vocab, seed=1000):
        self.rows, self.seq_len, self.vocab, self.seed = rows, seq_len, vocab, seed

    def batch(self, step):
        b = preference_batch(self.rows // 2, self.seq_len, self.vocab, seed=self.seed + step)
        half = self.vocab // 2
        chosen = np.arange(b["targets"].shape[0])[:, None] % 2 == 0
        # Response tokens (weight 1) remapped into their half; inputs are the targets shifted right.
        tokens = np.concatenate([b["inputs"][:, :1], b["targets"]], axis=1)
        response = np.concatenate([np.zeros_like(b["weights"][:, :1]), b["weights"]], axis=1) > 0
        tokens = np.where(response, np.where(chosen, tokens % half, half + tokens % half), tokens)
        return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "weights": b["weights"]}

    def describe(self):
        return "learnable preference pairs (tests/test_dpo.py)"


@pytest.mark.slow  # two trainer launches: ~35 s of CPU; the default run tests the numerics above
def test_training_learns_preferences_held_out_and_resume_keeps_the_reference(tmp_path):
    import json

    from maxtext_rocm.train import Trainer

    cfg = small_config(**ONE_DEVICE, **{
        "train.objective": "dpo", "dpo.beta": 0.1, "precision.policy": "bf16", "train.steps": 12,
        "train.per_device_batch_size": 8, "optimizer.lr": 3e-3, "optimizer.warmup_steps": 0,
        "optimizer.schedule": "constant", "log.every": 1, "checkpoint.every": 0, "checkpoint.async_save": False,
        "train.eval_every": 12, "train.eval_steps": 2, "output_dir": str(tmp_path / "run")})
    trainer = Trainer(cfg, devices=jax.devices()[:1], log=lambda *_: None)
    assert "objective dpo (beta 0.1" in trainer.describe().splitlines()[0]
    start = jax.tree_util.tree_map(np.asarray, trainer.state.params)
    trainer.data = LearnablePreferences(8, cfg.train.seq_len, cfg.model.vocab_size)
    trainer.eval_data = LearnablePreferences(8, cfg.train.seq_len, cfg.model.vocab_size, seed=0)  # held out
    trainer.run()
    reference = jax.tree_util.tree_map(np.asarray, trainer.state.reference)
    trainer.close()
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    evaluated = [row for row in rows if "eval_loss" in row]
    rows = [row for row in rows if "eval_loss" not in row]
    assert len(evaluated) == 1 and evaluated[0]["eval_pairs"] == 8  # 2 batches of 4 pairs
    assert evaluated[0]["eval_loss"] < LN2 - 0.05 and evaluated[0]["eval_dpo_accuracy"] >= 0.75
    # bf16 policy: the reference holds the matrices in bf16, which is what the model computes with.
    assert rows[0]["loss"] == pytest.approx(LN2, abs=1e-6) and rows[0]["dpo_accuracy"] == 0.0
    last = rows[-1]
    assert last["loss"] < LN2 - 0.05 and last["dpo_accuracy"] >= 0.75 and last["dpo_reward_margin"] > 0
    assert last["dpo_chosen_reward"] - last["dpo_rejected_reward"] == pytest.approx(last["dpo_reward_margin"], abs=1e-5)
    # The reference did not train: it is the starting point, matrices in bf16.
    assert_close(jax.tree_util.tree_map(lambda x: np.asarray(x, np.float32), reference),
                 dpo.make_reference(start, jnp.bfloat16), scale=0, rtol=0)

    resumed = Trainer(cfg, devices=jax.devices()[:1], log=lambda *_: None)  # resumes from step 12
    assert resumed.step_count == 12
    assert_close(jax.tree_util.tree_map(lambda x: np.asarray(x, np.float32), resumed.state.reference),
                 jax.tree_util.tree_map(lambda x: np.asarray(x, np.float32), reference), scale=0, rtol=0)
    resumed.close()


def test_reference_holds_matrices_in_the_compute_dtype_and_follows_loaded_params():
    params = {"dense": {"kernel": jnp.ones((3, 4))}, "norm": {"scale": jnp.full((4,), 1.001)}}
    reference = dpo.make_reference(params, jnp.bfloat16)
    assert reference["dense"]["kernel"].dtype == jnp.bfloat16 and reference["norm"]["scale"].dtype == jnp.float32
    loaded = {"dense": {"kernel": jnp.full((3, 4), 2.5)}, "norm": {"scale": jnp.full((4,), 0.5)}}
    refreshed = dpo.refreshed_reference(reference, loaded)  # checkpoint.load_params_from's starting point
    assert refreshed["dense"]["kernel"].dtype == jnp.bfloat16 and float(refreshed["dense"]["kernel"][0, 0]) == 2.5
    assert refreshed["norm"]["scale"].dtype == jnp.float32 and float(refreshed["norm"]["scale"][0]) == 0.5
    # Its own buffer where the dtype matches (the step donates both), laid out like the parameter.
    scale, loaded_scale = refreshed["norm"]["scale"], loaded["norm"]["scale"]
    assert scale.unsafe_buffer_pointer() != loaded_scale.unsafe_buffer_pointer()
    assert scale.sharding == loaded_scale.sharding


def test_lora_dpo_uses_the_base_without_adapters_as_its_reference(tmp_path):
    """Under LoRA the reference is the frozen base applied without adapters: no second copy in the
    state, ln 2 at step 1 (B starts at zero), and the adapters alone learn the preference."""
    import json

    from maxtext_rocm.train import Trainer

    cfg = small_config(**ONE_DEVICE, **{
        "train.objective": "dpo", "dpo.beta": 0.1, "lora.rank": 4, "lora.alpha": 8.0, "train.steps": 8,
        "train.per_device_batch_size": 8, "optimizer.lr": 1e-2, "optimizer.warmup_steps": 0,
        "optimizer.schedule": "constant", "log.every": 1, "checkpoint.every": 0, "checkpoint.async_save": False,
        "output_dir": str(tmp_path / "run")})
    trainer = Trainer(cfg, devices=jax.devices()[:1], log=lambda *_: None)
    assert not trainer.state.reference and trainer.state.frozen
    base = jax.tree_util.tree_map(np.asarray, trainer.state.frozen)
    trainer.data = LearnablePreferences(8, cfg.train.seq_len, cfg.model.vocab_size)
    trainer.run()
    after = jax.tree_util.tree_map(np.asarray, trainer.state.frozen)
    trainer.close()
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert rows[0]["loss"] == pytest.approx(LN2, abs=1e-6)
    assert rows[-1]["loss"] < LN2 - 0.02 and rows[-1]["dpo_reward_margin"] > 0
    assert_close(after, base, scale=0, rtol=0)  # the base (and so the reference) never moved


TINY_MODEL = ["--config.model.vocab_size=512", "--config.model.d_model=64", "--config.model.n_layers=2",
              "--config.model.n_heads=4", "--config.model.n_kv_heads=2", "--config.model.head_dim=16",
              "--config.model.mlp_dim=128", "--config.model.scan_layers=true", "--config.train.seq_len=32", "--config.train.per_device_batch_size=2",
              "--config.precision.policy=bf16", "--config.checkpoint.every=0", "--config.log.every=1",
              "--config.log.tensorboard=false", "--config.optimizer.warmup_steps=0"]
TINY_MESH = [f"--config.mesh.ici.{a}=1" for a in ("fsdp", "expert", "sequence", "tensor")]


def test_full_dpo_from_a_params_export_trains_through_the_cli(tmp_path):
    """A params export (as `convert from-hf` and `checkpoint export` write) as DPO's starting point,
    through `python -m maxtext_rocm.train`: the reference is remade from the loaded parameters, and
    the fp32 norm scales, whose dtype already matches, must be copies, not the parameters' own
    buffers (the donated step was handed one buffer twice: INVALID_ARGUMENT before the fix)."""
    import json
    import subprocess
    import sys

    from chat_helpers import write_jsonl
    from maxtext_rocm import api, config as config_lib
    from maxtext_rocm.checkpoint.params import write_params

    cfg = small_config(**{"model.vocab_size": 512})  # TINY_MODEL's model
    export = tmp_path / "export"
    write_params(export, api.init_params(cfg, seed=3))
    pairs = write_jsonl(tmp_path / "pairs.jsonl", [{"prompt": f"what is {i} plus {i}?", "chosen": " the answer is four.",
                                                   "rejected": " no"} for i in range(8)])
    run = tmp_path / "run"
    result = subprocess.run(
        [sys.executable, "-m", "maxtext_rocm.train", "configs/tiny_llama.py", *TINY_MODEL, *TINY_MESH,
         "--config.mesh.ici.data=2", "--config.train.steps=2", "--config.train.objective=dpo",
         "--config.data.source=files", f"--config.data.paths={pairs}", "--config.data.format=preference",
         f"--config.checkpoint.load_params_from={export}",
         f"--config.output_dir={run}"],
        cwd=REPO, env=CLI_ENV, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert rows[0]["loss"] == pytest.approx(LN2, abs=1e-6)  # the reference is the loaded start
    assert len(rows) == 2 and all(math.isfinite(r["loss"]) for r in rows)
