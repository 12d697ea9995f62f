"""The train step: gradient accumulation, rematerialisation, the optimizer, and learning."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from maxtext_rocm import config as config_lib
from maxtext_rocm.trainer.optimizer import build_optimizer, decay_mask, hyperparameters, learning_rate
from maxtext_rocm.train import Trainer

from conftest import small_config
from helpers import assert_close, assert_trees_close, initial_run, loss_and_grads

ONE_DEVICE = {f"mesh.ici.{a}": 1 for a in ("data", "fsdp", "expert", "sequence", "tensor")}


def test_grad_accum_equals_one_large_batch(devices, tmp_path):
    base = {"mesh.ici.fsdp": 8, "train.per_device_batch_size": 4, "output_dir": str(tmp_path)}
    loss1, grads1, _ = loss_and_grads(small_config(**base), devices)
    loss4, grads4, _ = loss_and_grads(small_config(**base, **{"train.grad_accum": 4}), devices)
    assert_close(loss4, loss1)
    assert_close(grads4, grads1)


def test_grad_accum_weights_tokens_not_micro_batches(devices, tmp_path):
    """With padding, accumulation must average over tokens of the whole batch (not per micro-batch)."""
    from maxtext_rocm.trainer.step import gradients

    cfg = small_config(**ONE_DEVICE, **{"train.per_device_batch_size": 4, "output_dir": str(tmp_path)})
    run = initial_run(cfg, devices[:1])
    batch = dict(run.batch(0))
    weights = np.ones((4, 32), np.float32)
    weights[0, 5:] = 0  # the first row is mostly padding
    batch["weights"] = jax.numpy.asarray(weights)
    with run.sharding_rules():
        g1, _, s1 = jax.jit(lambda p, b: gradients(p, run.model, b, 1, 0.0))(run.state.params, batch)
        g2, _, s2 = jax.jit(lambda p, b: gradients(p, run.model, b, 2, 0.0))(run.state.params, batch)
    assert float(s1["tokens"]) == float(s2["tokens"]) == 3 * 32 + 5
    assert_close(float(s2["loss"]), float(s1["loss"]))
    assert_close(g2, g1)


# CI budget: the unrolled stack (~40 s) runs with -m slow; remat wraps each layer the same way in both.
@pytest.mark.parametrize("scan", [True, pytest.param(False, marks=pytest.mark.slow)])
def test_every_remat_policy_gives_the_same_gradients(scan, devices, tmp_path):
    results = {}
    for remat in config_lib.REMAT_POLICIES:
        cfg = small_config(**ONE_DEVICE, **{"model.remat": remat, "model.scan_layers": scan,
                                            "train.per_device_batch_size": 2, "output_dir": str(tmp_path)})
        results[remat] = loss_and_grads(cfg, devices[:1])[:2]
    ref_loss, ref_grads = results["none"]
    for remat, (loss, grads) in results.items():
        assert_close(loss, ref_loss, err_msg=remat)
        assert_close(grads, ref_grads, err_msg=remat)


def expected_step_decision(finite, on_nonfinite, nonfinite_steps, skipped_in_a_row, limit):
    """The skip/halt rule as docs/checkpoints.md states it, written independently of trainer/step.py:
    (apply, step_increment, nonfinite_steps, skipped_in_a_row) after one step."""
    if on_nonfinite == "stop":
        if nonfinite_steps > 0:  # halted since the first bad step: nothing moves any more
            return False, 0, nonfinite_steps, skipped_in_a_row
        if finite:
            return True, 1, nonfinite_steps, 0
        return False, 0, nonfinite_steps + 1, skipped_in_a_row + 1  # the first bad step halts
    if skipped_in_a_row >= limit:  # "skip", frozen after `limit` bad steps in a row
        return False, 0, nonfinite_steps, skipped_in_a_row
    if finite:
        return True, 1, nonfinite_steps, 0
    return False, 1, nonfinite_steps + 1, skipped_in_a_row + 1  # skipped, but the schedule moves on


def test_skip_halt_rule_truth_table():
    from maxtext_rocm.trainer.step import decide_step

    limit = 3
    decide = jax.jit(decide_step, static_argnames=("halting", "max_skipped_steps"))
    cases = [(finite, mode, bad, in_a_row) for finite in (True, False) for mode in ("skip", "stop")
             for bad in (0, 1, 4) for in_a_row in (0, 1, limit - 1, limit, limit + 1)]
    assert len(cases) == 60
    for finite, mode, bad, in_a_row in cases:
        got = decide(jnp.asarray(finite), halting=mode == "stop", nonfinite_steps=jnp.int32(bad),
                     skipped_in_a_row=jnp.int32(in_a_row), max_skipped_steps=limit)
        assert tuple(got._fields) == ("apply", "step_increment", "nonfinite_steps", "skipped_in_a_row")
        got = (bool(got.apply), int(got.step_increment), int(got.nonfinite_steps), int(got.skipped_in_a_row))
        assert got == expected_step_decision(finite, mode, bad, in_a_row, limit), (finite, mode, bad, in_a_row)


def test_weight_decay_skips_norm_scales(devices, tmp_path):
    cfg = small_config(**ONE_DEVICE, **{"output_dir": str(tmp_path)})
    mask = decay_mask(initial_run(cfg, devices[:1]).state.params)
    assert mask["final_norm"]["scale"] is False
    assert mask["layers"]["attention_norm"]["scale"] is False  # stacked [layers, d] but still a norm
    assert mask["layers"]["mlp"]["up"]["kernel"] is True
    assert mask["embed"]["embedding"] is True


def optax_schedule(opt, total_steps):
    """The schedule as optax composes it, the reference for optim.learning_rate."""
    warmup = min(opt.warmup_steps, total_steps)
    after = (optax.constant_schedule(opt.lr) if opt.schedule == "constant" else
             optax.cosine_decay_schedule(opt.lr, max(total_steps - warmup, 1), alpha=opt.min_lr_ratio))
    return optax.join_schedules([optax.linear_schedule(0.0, opt.lr, max(warmup, 1)), after], [warmup])


def test_schedule_warms_up_then_decays_to_floor():
    opt = config_lib.defaults().optimizer
    opt.update(lr=1e-3, warmup_steps=10, min_lr_ratio=0.1)
    hp = hyperparameters(opt, total_steps=110)
    assert float(learning_rate(0, hp)) == 0.0
    np.testing.assert_allclose(float(learning_rate(5, hp)), 5e-4, rtol=1e-6)
    np.testing.assert_allclose(float(learning_rate(10, hp)), 1e-3, rtol=1e-6)
    np.testing.assert_allclose(float(learning_rate(60, hp)), 1e-3 * (0.1 + 0.9 * 0.5), rtol=1e-5)
    np.testing.assert_allclose(float(learning_rate(110, hp)), 1e-4, rtol=1e-5)
    opt.schedule = "constant"
    assert float(learning_rate(100, hyperparameters(opt, total_steps=110))) == pytest.approx(1e-3)


@pytest.mark.parametrize("schedule, warmup, total", [
    ("cosine", 10, 110), ("cosine", 0, 50), ("cosine", 30, 20), ("cosine", 1, 2), ("constant", 7, 40),
    ("constant", 0, 5)])
def test_learning_rate_equals_optax_schedules(schedule, warmup, total):
    """Every step's rate, and past the end, as optax's own warmup + cosine/constant schedules give it."""
    opt = config_lib.defaults().optimizer
    opt.update(lr=3e-4, warmup_steps=warmup, schedule=schedule, min_lr_ratio=0.05)
    steps = np.arange(total + 5)
    got = jax.jit(learning_rate)(steps, hyperparameters(opt, total))
    want = [float(optax_schedule(opt, total)(s)) for s in steps]
    np.testing.assert_allclose(got, want, rtol=2e-6, atol=1e-12)


@pytest.mark.parametrize("clip_norm", [0.0, 0.5, 100.0])
def test_optimizer_with_the_given_norm_equals_optax_clipping(clip_norm):
    """The update, with its numbers traced arrays as in the train step and reading the step's
    grad_norm, equals optax's own clip_by_global_norm + AdamW built from the config's numbers,
    and keeps the same state layout (checkpoints written before the change still restore)."""
    opt = config_lib.defaults().optimizer
    opt.update(clip_norm=clip_norm, weight_decay=0.1)
    hp = hyperparameters(opt, total_steps=100)
    adamw = optax.adamw(optax_schedule(opt, 100), b1=opt.b1, b2=opt.b2, eps=opt.eps,
                        weight_decay=opt.weight_decay, mask=decay_mask)
    reference = optax.chain(optax.clip_by_global_norm(clip_norm), adamw) if clip_norm else adamw
    keys = jax.random.split(jax.random.key(5), 4)
    params = {"w": {"kernel": jax.random.normal(keys[0], (8, 4))}, "norm": {"scale": jnp.ones((4,))}}
    grads = {"w": {"kernel": jax.random.normal(keys[1], (8, 4))}, "norm": {"scale": jax.random.normal(keys[2], (4,))}}

    @jax.jit
    def update(grads, state, params, hp):
        return build_optimizer(hp, clip=clip_norm > 0).update(grads, state, params, grad_norm=optax.tree.norm(grads))

    state, want_state = build_optimizer(hp, clip=clip_norm > 0).init(params), reference.init(params)
    assert jax.tree_util.tree_structure(state) == jax.tree_util.tree_structure(want_state)
    for _ in range(3):  # past the first step, so the schedule's learning rate is not zero
        updates, state = update(grads, state, params, hp)
        want, want_state = reference.update(grads, want_state, params)
        assert_close(updates, want)


def test_tiny_llama_loss_falls_on_embedded_corpus(devices, tmp_path):
    cfg = config_lib.load("tiny_llama", overrides=dict(
        ONE_DEVICE, **{"train.steps": 60, "log.every": 10,
                       "log.tensorboard": False, "output_dir": str(tmp_path)}))
    trainer = Trainer(cfg, devices=devices[:1], log=lambda *_: None)
    trainer.run()
    losses = [json.loads(line)["loss"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert len(losses) == 6
    # ln(512) = 6.24 at random init; byte-level Python source is far more predictable than that.
    assert losses[0] > losses[-1] + 1.0, losses
    assert losses[-1] < 3.0, losses
    assert int(trainer.state.step) == 60


def test_step_compiled_in_the_background_trains_identically(devices, tmp_path, monkeypatch):
    """Off the CPU the Trainer compiles the step in a thread while the state initialises; forcing
    that path here, the run must match the synchronous one exactly."""
    from maxtext_rocm.trainer import compilation

    losses = {}
    for background in (False, True):
        monkeypatch.setattr(compilation, "compile_overlaps_init", lambda b=background: b)
        cfg = small_config(**{"mesh.ici.fsdp": 8, "output_dir": str(tmp_path / str(background))})
        trainer = Trainer(cfg, devices=devices, log=lambda *_: None)
        assert (type(trainer._compiled_step).__name__ == "Future") == background
        losses[background] = [float(trainer.step()["loss"]) for _ in range(3)]
        params = jax.device_get(trainer.state.params)
        if not background:
            reference_params = params
    assert losses[True] == losses[False]
    assert_trees_close(params, reference_params, atol=0)


def test_unrolled_threefry_draws_the_same_bits():
    """The init program's Threefry, unrolled on the CPU, draws exactly the bits of JAX's own
    (rolled) CPU rule, and JAX's rule is back once the context ends."""
    from maxtext_rocm.trainer import compilation

    def draws(k):
        return jax.random.truncated_normal(k, -2.0, 2.0, (64, 48)), jax.random.bits(jax.random.fold_in(k, 3), (1000,))

    key = jax.random.key(11)
    rolled = jax.jit(lambda k: draws(k)).lower(key)
    with compilation.unrolled_threefry_on_cpu():
        unrolled = jax.jit(lambda k: draws(k)).lower(key)
    after = jax.jit(lambda k: draws(k)).lower(key)
    assert "stablehlo.while" in rolled.as_text() and "stablehlo.while" in after.as_text()
    assert "stablehlo.while" not in unrolled.as_text()
    for got, want in zip(unrolled.compile()(key), rolled.compile()(key)):
        np.testing.assert_array_equal(got, want)


def test_fp8_steps_compile_without_triton_gemms_on_gpus(monkeypatch):
    """fp8 on a GPU: cuBLASLt/hipBLASLt fp8 GEMMs, not Triton's (whose autotuning outlasted a
    150 s compile on an H200); other policies and the CPU keep XLA's defaults; XLA_FLAGS wins."""
    from maxtext_rocm.trainer import compilation

    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    assert compilation.step_compiler_options("fp8", "cpu") is None
    assert compilation.step_compiler_options("fp8", "gpu") == {"xla_gpu_enable_triton_gemm": False}
    assert compilation.step_compiler_options("bf16", "gpu") is None
    monkeypatch.setenv("XLA_FLAGS", "--xla_gpu_enable_triton_gemm=true")
    assert compilation.step_compiler_options("fp8", "gpu") is None
