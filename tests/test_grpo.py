"""GRPO (maxtext_rocm/finetune/grpo/, trainer/grpo_step.py): the objective against TRL's definition
written as a formula, advantages and clipping against a hand computation, the sampler against
generate and against a forward pass, the loss sharded and accumulated against one device, and
runs that learn a verifiable reward (full and LoRA) and resume bit-exactly."""

import json

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

from maxtext_rocm import config as config_lib
from maxtext_rocm.data.prompts import Prompt
from maxtext_rocm.finetune.grpo import objective, rollout
from maxtext_rocm.finetune.grpo.sampler import Sampler
from maxtext_rocm.generate import generate
from maxtext_rocm.trainer import launch, step as step_lib

from conftest import small_config
from helpers import assert_close, initial_run

ONE_DEVICE = {f"mesh.ici.{a}": 1 for a in ("data", "fsdp", "expert", "sequence", "tensor")}


def trl_loss(logps, old, ref, advantages, mask, epsilon, beta, loss_type):
    """TRL's GRPOTrainer._compute_loss in numpy (float64): "grpo" is the per-sequence mean, "bnpo"
    the mean over the batch's completion tokens."""
    ratio = np.exp(logps - old)
    a = advantages[:, None]
    per_token = -np.minimum(ratio * a, np.clip(ratio, 1 - epsilon, 1 + epsilon) * a)
    if beta:
        per_token = per_token + beta * (np.exp(ref - logps) - (ref - logps) - 1)
    if loss_type == "grpo":
        return np.mean((per_token * mask).sum(-1) / np.maximum(mask.sum(-1), 1))
    return (per_token * mask).sum() / max(mask.sum(), 1)


def fixed_terms(seed=0, rows=6, length=7):
    rng = np.random.default_rng(seed)
    logps = rng.normal(-2, 0.5, (rows, length))
    old = logps + rng.normal(0, 0.3, (rows, length))  # ratios around 1, some past 1 +- 0.2
    ref = logps + rng.normal(0, 0.3, (rows, length))
    advantages = rng.normal(0, 1, rows)
    mask = (rng.random((rows, length)) < 0.7).astype(np.float64)
    mask[0] = 0.0  # a row without tokens counts as a row under "sequence", as TRL's clamp(min=1) has it
    return logps, old, ref, advantages, mask


def our_loss(logps, old, ref, advantages, mask, epsilon, beta, normalization):
    per_token_advantages = jnp.broadcast_to(advantages[:, None], logps.shape)
    terms = objective.token_terms(logps, old, per_token_advantages, epsilon, beta, ref if beta else None)
    total, count = objective.summed_and_count(terms.losses, mask, normalization)
    return total / count


@pytest.mark.parametrize("beta", [0.0, 0.04])
@pytest.mark.parametrize("normalization,loss_type", [("token", "bnpo"), ("sequence", "grpo")])
def test_loss_and_gradient_equal_trl_formula_on_fixed_logprobs(beta, normalization, loss_type):
    logps, old, ref, advantages, mask = fixed_terms()
    eps = 0.2
    want = trl_loss(logps, old, ref, advantages, mask, eps, beta, loss_type)
    args = [jnp.asarray(x, jnp.float32) for x in (logps, old, ref, advantages, mask)]
    got = our_loss(*args, eps, beta, normalization)
    assert_close(float(got), want)
    # d loss / d logp: the unclipped branch's r A where min() takes it (zero where the clip holds
    # the ratio), minus beta's k3 gradient, over the normaliser.
    ratio = np.exp(logps - old)
    a = advantages[:, None]
    unclipped = ratio * a <= np.clip(ratio, 1 - eps, 1 + eps) * a
    per_token = -np.where(unclipped, ratio * a, 0.0) + beta * (1 - np.exp(ref - logps))
    if loss_type == "grpo":
        want_grad = per_token * mask / np.maximum(mask.sum(-1, keepdims=True), 1) / len(mask)
    else:
        want_grad = per_token * mask / mask.sum()
    got_grad = jax.grad(lambda lp: our_loss(lp, *args[1:], eps, beta, normalization))(args[0])
    assert_close(np.asarray(got_grad), want_grad)


def test_clipping_kl_and_ratio_against_a_hand_computation():
    logps = jnp.log(jnp.asarray([[1.0, 1.0, 1.0, 1.0]]))
    old = jnp.log(jnp.asarray([[1 / 1.5, 1 / 0.5, 1 / 1.1, 1 / 1.5]]))  # ratios 1.5, 0.5, 1.1, 1.5
    advantages = jnp.asarray([[1.0, -1.0, 1.0, -1.0]])
    terms = objective.token_terms(logps, old, advantages, 0.2, 0.0, jnp.log(jnp.asarray([[0.5, 1.0, 2.0, 1.0]])))
    assert_close(np.asarray(terms.ratio), np.asarray([[1.5, 0.5, 1.1, 1.5]]))
    # Clipped where the ratio passed the bound the advantage pushes it to: 1.5 with A > 0 (held at
    # 1.2), 0.5 with A < 0 (held at 0.8); 1.1 is inside; 1.5 with A < 0 is not held (min takes -1.5).
    np.testing.assert_array_equal(np.asarray(terms.clipped), [[1, 1, 0, 0]])
    assert_close(np.asarray(terms.losses), np.asarray([[-1.2, 0.8, -1.1, 1.5]]))
    k3 = lambda r: r - np.log(r) - 1  # noqa: E731  exp(ref - logp) - (ref - logp) - 1, r = pi_ref / pi
    assert_close(np.asarray(terms.kl), np.asarray([[k3(0.5), 0.0, k3(2.0), 0.0]]), scale=1e-6)


def test_advantages_are_the_groups_standardised_rewards():
    totals = np.asarray([1.0, 0.0, 0.0, 1.0, 2.0, 2.0, 2.0, 2.0, 3.0, 0.0, 0.0, 0.0])
    got = rollout.group_advantages(totals, 4, scale=True)
    std = np.sqrt(4 * 0.25 / 3)  # unbiased, as torch's std
    assert_close(got[:4], np.asarray([0.5, -0.5, -0.5, 0.5]) / (std + 1e-4))
    np.testing.assert_array_equal(got[4:8], 0.0)  # all equal: no signal
    std3 = np.std([3.0, 0, 0, 0], ddof=1)
    assert_close(got[8:], (np.asarray([3.0, 0, 0, 0]) - 0.75) / (std3 + 1e-4))
    assert_close(rollout.group_advantages(totals, 4, scale=False)[8:], np.asarray([2.25, -0.75, -0.75, -0.75]))


def test_rows_train_the_completion_and_its_stop_token_only():
    prompts = [Prompt({}, "p0", np.asarray([5, 6, 7], np.int32)), Prompt({}, "p1", np.asarray([9], np.int32))]
    sampled = np.asarray([[11, 2, 13, 14], [12, 12, 12, 12], [2, 0, 0, 0], [15, 16, 2, 17]], np.int32)
    done = rollout.completions(sampled, (2,))
    assert [list(t) for t in done.tokens] == [[11, 2], [12, 12, 12, 12], [2], [15, 16, 2]]
    np.testing.assert_array_equal(done.stopped, [True, False, True, True])
    batch = rollout.training_rows(prompts, done, np.asarray([1.0, -1.0, 0.5, 0.25], np.float32), 2, seq_len=8)
    np.testing.assert_array_equal(batch["inputs"][0], [5, 6, 7, 11, 2, 0, 0, 0])
    np.testing.assert_array_equal(batch["targets"][0], [6, 7, 11, 2, 0, 0, 0, 0])
    np.testing.assert_array_equal(batch["weights"][0], [0, 0, 1, 1, 0, 0, 0, 0])  # predicts 11 and the stop
    np.testing.assert_array_equal(batch["weights"][1], [0, 0, 1, 1, 1, 1, 0, 0])  # cut at max_new: all 4
    np.testing.assert_array_equal(batch["inputs"][3], [9, 15, 16, 2, 0, 0, 0, 0])
    np.testing.assert_array_equal(batch["weights"][3], [1, 1, 1, 0, 0, 0, 0, 0])
    np.testing.assert_array_equal(batch["segment_ids"][3], [1, 1, 1, 1, 0, 0, 0, 0])
    np.testing.assert_array_equal(batch["positions"][3], [0, 1, 2, 3, 0, 0, 0, 0])
    assert float(batch["advantages"][1, 0]) == -1.0 and float(batch["advantages"][1, -1]) == 0.0


def grpo_cfg(**overrides):
    values = dict(group_size=4, max_new_tokens=6, temperature=1.0, top_p=1.0, top_k=0, epsilon=0.2, beta=0.0,
                  normalization="token", updates_per_batch=1)
    values.update(overrides)
    return ml_collections.FrozenConfigDict(values)


def sampler_run(devices, **overrides):
    """A run at initialisation whose config carries grpo keys for the sampler (its objective stays lm:
    the sampler reads the model, train.seq_len and the grpo group)."""
    cfg = small_config(**{"train.seq_len": 16, "grpo.max_new_tokens": 6, **overrides})
    run = initial_run(cfg, devices)
    layout = launch.stored_state(run.cfg, run.model, run.mesh)
    return run, layout.sharding


def prompt_rows(cfg, rows):
    rng = np.random.default_rng(1)
    prompts = [Prompt({}, f"p{i}", rng.integers(3, cfg.model.vocab_size, rng.integers(2, 10)).astype(np.int32))
               for i in range(rows)]
    return prompts, rollout.left_padded(prompts, 1, cfg.train.seq_len - cfg.grpo.max_new_tokens)


@pytest.mark.parametrize("mesh", ["one device", "fsdp=8"])
def test_sampler_equals_generate_and_its_logprobs_equal_a_forward_pass(mesh, devices):
    from maxtext_rocm.numerics.precision import policy_from_config

    devices = devices[:1] if mesh == "one device" else devices
    run, state_sharding = sampler_run(devices, **(ONE_DEVICE if mesh == "one device" else {}))
    cfg = run.cfg
    rows = 8
    prompts, (tokens, positions) = prompt_rows(cfg, rows)
    stop = (7,)
    policy = policy_from_config(cfg.precision)
    # Greedy on any mesh (the weights gathered once, or read where training keeps them), and sampled
    # (temperature 1, the same key) on one device, as generate does.
    settings = [(0.0, "gathered"), (1.0, "gathered")] if mesh == "one device" else [(0.0, "training"),
                                                                                   (0.0, "gathered")]
    for temperature, weights in settings:
        c = ml_collections.ConfigDict(cfg)
        c.grpo.temperature, c.grpo.sampler_weights = temperature, weights
        sampler = Sampler(ml_collections.FrozenConfigDict(c), policy, run.mesh, state_sharding, rows, stop)
        out, _, logps = sampler(run.state, tokens, positions, jax.random.key(3))
        want = generate(cfg, run.state.params, [p.tokens for p in prompts], max_new_tokens=6,
                        temperature=temperature, seed=3, eos_id=stop, pad_to=tokens.shape[1])
        done = rollout.completions(np.asarray(out), stop)
        for got_row, want_row in zip(done.tokens, want):
            np.testing.assert_array_equal(got_row, want_row)
    # Each sampled token's log-probability equals a forward pass's over the laid-out row.
    batch = rollout.training_rows(prompts, done, np.zeros(rows, np.float32), 1, cfg.train.seq_len)
    forward, _ = jax.jit(lambda p, b: objective.token_logprobs(p, run.model, b, fused=True))(
        run.state.params, {k: jnp.asarray(v) for k, v in batch.items()})
    forward = np.asarray(forward)
    for row, prompt in enumerate(prompts):
        n = len(done.tokens[row])
        got = np.asarray(logps)[row, :n]
        assert_close(got, forward[row, len(prompt.tokens) - 1:len(prompt.tokens) - 1 + n], scale=1e-4)


def grpo_batch(cfg, rows, seed=0):
    """Scored samples as the train step takes them: random prompts and completions, advantages,
    and the sampling policy's log-probabilities near the current ones."""
    rng = np.random.default_rng(seed)
    prompts, _ = prompt_rows(cfg, rows // 4)
    sampled = rng.integers(3, cfg.model.vocab_size, (rows, cfg.grpo.max_new_tokens)).astype(np.int32)
    sampled[::3, 2] = 7  # some stop early
    done = rollout.completions(sampled, (7,))
    batch = rollout.training_rows(prompts, done, rng.normal(0, 1, rows).astype(np.float32), 4, cfg.train.seq_len)
    batch[objective.OLD_LOGPS] = rng.normal(-5, 0.2, (rows, cfg.train.seq_len)).astype(np.float32)
    batch[objective.REF_LOGPS] = rng.normal(-5, 0.2, (rows, cfg.train.seq_len)).astype(np.float32)
    return batch


def grpo_gradients(run, batch, grad_accum, g, fused=True):
    obj = step_lib.grpo_objective(run.model, g)
    if not fused:
        obj = obj._replace(summed_loss=lambda p, b, f, k: objective.summed_loss(p, run.model, b, g, fused=False))
    fn = jax.jit(lambda p, b: step_lib.gradients(p, run.model, b, grad_accum, 0.0, objective=obj))
    with run.sharding_rules():
        return fn(run.state.params, {k: jax.device_put(v, jax.sharding.NamedSharding(
            run.mesh, jax.sharding.PartitionSpec(("data", "fsdp")))) for k, v in batch.items()})


@pytest.mark.parametrize("normalization", ["token", "sequence"])
def test_loss_is_the_same_fused_unfused_sharded_and_accumulated(normalization, devices):
    g = grpo_cfg(beta=0.04, normalization=normalization)
    single, _ = sampler_run(devices[:1], **ONE_DEVICE, **{"model.loss_chunk_len": 8})
    batch = grpo_batch(single.cfg, 8)
    want_grads, _, want = grpo_gradients(single, batch, 1, g, fused=False)
    assert float(want["grpo_clip_fraction"]) > 0  # the ratios of this batch reach the clip
    cases = [(single, 1), (single, 2)]
    if normalization == "token":  # the mesh is the same for both: one normalisation is enough there
        cases.append((sampler_run(devices, **{"mesh.ici.fsdp": 4, "mesh.ici.tensor": 2,
                                              "model.loss_chunk_len": 8})[0], 2))
    for run, accum in cases:
        grads, _, got = grpo_gradients(run, batch, accum, g)
        for key in ("loss", "grpo_kl", "grpo_clip_fraction", "grpo_ratio"):
            assert_close(float(got[key]), float(want[key]), scale=1e-5, err_msg=key)
        assert_close(jax.tree_util.tree_map(np.asarray, grads), jax.tree_util.tree_map(np.asarray, want_grads),
                     scale=2e-5)


# ---------------------------------------------------------------------------------------------
# Runs: a verifiable reward learnt from scratch, with LoRA, and a resume that equals the whole run

def write_prompts(folder, n=32):
    path = folder / "prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"Q{i}: a digit, please. A:", "answer": str(i % 10)}) + "\n"
                            for i in range(n)))
    return path


def grpo_run_config(tmp_path, **overrides):
    """Completions of 4 byte tokens; the reward: 1 where the completion starts with a digit (about
    1 in 26 completions of the untrained model)."""
    cfg = small_config(**ONE_DEVICE, **{
        "model.vocab_size": 512, "train.objective": "grpo", "data.source": "files", "data.format": "prompt",
        "data.paths": str(write_prompts(tmp_path)), "grpo.rewards": ("format",), "grpo.format_pattern": "[0-9].*",
        "grpo.group_size": 8, "grpo.max_new_tokens": 4, "train.seq_len": 32, "train.per_device_batch_size": 32,
        "precision.policy": "bf16", "optimizer.lr": 3e-3, "optimizer.warmup_steps": 2, "optimizer.schedule": "constant",
        "log.every": 1, "checkpoint.enabled": False, "output_dir": str(tmp_path / "run"), **overrides})
    return cfg


def run_rows(cfg, steps=None):
    from maxtext_rocm.train import Trainer

    trainer = Trainer(cfg, devices=jax.devices()[:1], log=lambda *_: None)
    trainer.run(steps)
    trainer.close()
    return [json.loads(line) for line in open(f"{cfg.output_dir}/metrics.jsonl")]


def learns(rows, at_least=0.8):
    rewards = [row["grpo_reward"] for row in rows]
    assert rewards[0] < 0.3, rewards
    assert np.mean(rewards[-3:]) >= at_least, rewards


def test_a_tiny_model_learns_a_verifiable_reward(tmp_path):
    rows = run_rows(grpo_run_config(tmp_path, **{"train.steps": 25}))
    learns(rows)
    assert all(row["grpo_completion_length"] == 4 for row in rows)  # nothing stops: byte EOS is never drawn
    assert {"grpo_kl", "grpo_clip_fraction", "grpo_zero_signal", "grpo_sampling_s", "grpo_scoring_s",
            "grpo_reward/format", "grpo_reward_std/format"} <= set(rows[-1])


def test_a_lora_run_learns_the_same_reward(tmp_path):
    rows = run_rows(grpo_run_config(tmp_path, **{"train.steps": 30, "lora.rank": 8, "lora.alpha": 16.0,
                                                 "optimizer.lr": 1e-2}))
    learns(rows)


def test_a_resumed_run_equals_the_uninterrupted_one_bit_for_bit(tmp_path):
    common = {"train.steps": 6, "grpo.beta": 0.05, "grpo.updates_per_batch": 2, "grpo.group_size": 4,
              "train.per_device_batch_size": 8, "checkpoint.enabled": True, "checkpoint.every": 3,
              "checkpoint.async_save": False}
    for name in ("whole", "stopped"):
        (tmp_path / name).mkdir()
    whole = run_rows(grpo_run_config(tmp_path / "whole", **common))
    cfg = grpo_run_config(tmp_path / "stopped", **common)
    first = run_rows(cfg, 3)
    resumed = run_rows(cfg)  # a new trainer: resumes from the checkpoint at step 3, appends to the rows
    assert len(first) == 3 and [row["step"] for row in resumed] == [1, 2, 3, 4, 5, 6]
    keys = ("loss", "grpo_reward", "grpo_kl", "grpo_clip_fraction", "grpo_ratio", "grad_norm", "lr")
    for got, want in zip(resumed, whole):
        assert {k: got[k] for k in keys} == {k: want[k] for k in keys}
    assert whole[-1]["grpo_kl"] > 0 and whole[-1]["grpo_ratio"] != 1.0  # the reference and the old policy acted


def test_prompts_render_with_the_chat_template_and_stop_at_its_end_of_turn(tmp_path):
    """Messages and plain strings both become the template's rendering with its generation prompt,
    as transformers' apply_chat_template(add_generation_prompt=True) tokenizes it; completions stop
    at <|eot_id|> and EOS. The byte tokenizer, which has no template, takes the string as text."""
    pytest.importorskip("tokenizers")
    transformers = pytest.importorskip("transformers")
    from chat_helpers import make_chat_tokenizer, write_jsonl
    from maxtext_rocm.data.prompts import load_prompts
    from maxtext_rocm.data.tokenizer import ByteTokenizer, load_tokenizer

    folder = make_chat_tokenizer(tmp_path / "tok")
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"}]
    path = write_jsonl(tmp_path / "prompts.jsonl", [{"prompt": messages, "answer": "4"}, {"prompt": "Say hi."}])
    data = ml_collections.ConfigDict({"paths": str(path), "chat_template": "", "add_bos": True, "seed": 0})
    tokenizer = load_tokenizer(str(folder / "tokenizer.json"))
    prompts = load_prompts(data, tokenizer, max_prompt_len=200)
    reference = transformers.AutoTokenizer.from_pretrained(str(folder))
    for prompt, conversation in zip(prompts.prompts, (messages, [{"role": "user", "content": "Say hi."}])):
        want = reference.apply_chat_template(conversation, add_generation_prompt=True, tokenize=True)
        want = want["input_ids"] if isinstance(want, dict) or hasattr(want, "keys") else want
        assert list(prompt.tokens) == list(want)
    assert prompts.prompts[0].record["answer"] == "4"
    assert prompts.stop_ids == (reference.convert_tokens_to_ids("<|eot_id|>"), tokenizer.eos_id)
    plain = load_prompts(ml_collections.ConfigDict(dict(data, paths=str(write_jsonl(
        tmp_path / "plain.jsonl", [{"prompt": "Say hi."}])))), ByteTokenizer(), max_prompt_len=200)
    assert list(plain.prompts[0].tokens) == list(ByteTokenizer().encode("Say hi.", bos=True))
    assert plain.stop_ids == (ByteTokenizer.eos_id,)


def test_each_step_takes_its_own_prompts_in_an_order_of_its_pass():
    from maxtext_rocm.data.prompts import Prompts

    prompts = Prompts(tuple(Prompt({"i": i}, str(i), np.asarray([i], np.int32)) for i in range(10)), (), seed=3)
    steps = [[p.record["i"] for p in prompts.for_step(s, 4)] for s in range(5)]
    assert sorted(sum(steps[:2], []) + steps[2][:2]) == list(range(10))  # the first pass: every prompt once
    assert steps[2][:2] + steps[3] != steps[0] + steps[1][:2]  # the second pass in another order
    assert steps == [[p.record["i"] for p in prompts.for_step(s, 4)] for s in range(5)]  # a function of the step


def test_bucket_lengths_are_quarters_of_the_row_rounded_to_tiles():
    from maxtext_rocm.data.buckets import bucket_lengths, bucket_of

    assert bucket_lengths(2048) == (512, 1024, 1536, 2048)
    assert bucket_lengths(1000) == (256, 504, 752, 1000)  # not a multiple of 128: multiples of 8
    assert bucket_lengths(32) == (8, 16, 24, 32)
    assert [bucket_of(n, 2048) for n in (1, 512, 513, 2048)] == [512, 512, 1024, 2048]


def test_a_bucket_gives_the_loss_and_gradient_of_rows_padded_to_seq_len(devices):
    """The same scored samples laid out at their bucket's length and at train.seq_len: the padding
    after every row is never attended to and weighs 0, so loss and gradient agree to fp32."""
    g = grpo_cfg(beta=0.04)
    single, _ = sampler_run(devices[:1], **ONE_DEVICE, **{"model.loss_chunk_len": 8, "train.seq_len": 32})
    rng = np.random.default_rng(2)
    prompts, _ = prompt_rows(single.cfg, 2)
    sampled = rng.integers(3, single.cfg.model.vocab_size, (8, single.cfg.grpo.max_new_tokens)).astype(np.int32)
    done = rollout.completions(sampled, ())
    longest = rollout.longest_row(prompts, done, 4)
    short = rollout.training_rows(prompts, done, rng.normal(0, 1, 8).astype(np.float32), 4, 16)
    assert longest <= 16
    full = {k: np.pad(v, ((0, 0), (0, 32 - 16))) for k, v in short.items()}
    for batch in (short, full):
        batch[objective.REF_LOGPS] = np.full(batch["inputs"].shape, -5.0, np.float32)
    want_grads, _, want = grpo_gradients(single, full, 1, g)
    grads, _, got = grpo_gradients(single, short, 1, g)
    for key in ("loss", "grpo_kl", "tokens"):
        assert_close(float(got[key]), float(want[key]), scale=1e-6, err_msg=key)
    assert_close(jax.tree_util.tree_map(np.asarray, grads), jax.tree_util.tree_map(np.asarray, want_grads),
                 scale=1e-6)


def test_a_run_compiles_one_step_per_bucket_its_rows_need(tmp_path):
    """Rows of 29 positions in a run of train.seq_len=128: every step in the 32 bucket, one program,
    and the full-length step never compiled."""
    from maxtext_rocm.train import Trainer

    cfg = grpo_run_config(tmp_path, **{"train.steps": 3, "train.seq_len": 128})
    trainer = Trainer(cfg, devices=jax.devices()[:1], log=lambda *_: None)
    trainer.run()
    trainer.close()
    assert sorted(trainer._steps_by_length) == [32] and not trainer._compiled_step.done()
    rows = [json.loads(line) for line in open(f"{cfg.output_dir}/metrics.jsonl")]
    # Positions per second count the bucket's 32 a row, not 128: padding is what the bucket left.
    assert all(row["padding_fraction"] < 0.2 for row in rows)


def test_an_fp8_run_samples_with_its_scales_and_trains(tmp_path):
    """precision.policy=fp8 (delayed scaling): the sampler decodes with the state's fp8 scales, the
    steps stay finite and the reward moves off its start."""
    rows = run_rows(grpo_run_config(tmp_path, **{"train.steps": 8, "precision.policy": "fp8"}))
    assert all(np.isfinite(row["loss"]) and np.isfinite(row["grad_norm"]) for row in rows)
    assert rows[-1]["nonfinite_steps"] == 0 and max(row["grpo_reward"] for row in rows) > rows[0]["grpo_reward"]
