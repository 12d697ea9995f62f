"""FP8: the quantizer against ml_dtypes, GEMM accuracy, parity with Flax's ops, the delayed-scaling
state through training and checkpoints, and the HLO that XLA sees."""

import types

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax.linen import fp8_ops

from maxtext_rocm.numerics import fp8
from maxtext_rocm.trainer import launch
from maxtext_rocm.trainer.step import eval_step
from maxtext_rocm.train import Trainer

from conftest import small_config
from helpers import assert_close

DIMS = (((1,), (0,)), ((), ()))


@pytest.mark.parametrize("fmt", ["ocp", "fnuz"])
def test_quantize_dequantize_matches_ml_dtypes(fmt):
    e4m3, e5m2 = fp8.FORMATS[fmt]
    for q_dtype, reference in ((e4m3, getattr(ml_dtypes, jnp.dtype(e4m3).name)),
                               (e5m2, getattr(ml_dtypes, jnp.dtype(e5m2).name))):
        top = float(ml_dtypes.finfo(reference).max)
        tiny = float(ml_dtypes.finfo(reference).smallest_subnormal)
        x = np.array([0.0, -0.0, 1.0, -3.3, 0.1, top, -top, 2 * top, -1e30, tiny, tiny / 3, 1e-30],
                     np.float32)
        scale = np.float32(1.0)
        got = np.asarray(fp8.quantize_dequantize(jnp.asarray(x), q_dtype, jnp.asarray(scale)))
        want = np.clip(x / scale, -top, top).astype(reference).astype(np.float32) * scale
        np.testing.assert_array_equal(got, want)
        assert got[7] == top and got[8] == -top, "out-of-range values saturate, never inf/NaN"
        assert np.isfinite(got).all()
        if fmt == "fnuz":
            assert not np.signbit(got[1]), "FNUZ has no -0"
        # A scale moves the grid: 1000 with scale 8 lands on 8 * q(125).
        scaled = float(fp8.quantize_dequantize(jnp.float32(1000.0), q_dtype, jnp.float32(8.0)))
        assert scaled == 8 * float(np.float32(125.0).astype(reference).astype(np.float32))


def test_scale_has_a_floor_and_keeps_the_old_one_on_zero_or_inf():
    e4m3 = fp8.FORMATS["ocp"][0]
    old = jnp.float32(0.5)
    assert float(fp8.scale_from_amax(jnp.float32(0.0), e4m3, old)) == 0.5
    assert float(fp8.scale_from_amax(jnp.float32(np.inf), e4m3, old)) == 0.5
    assert float(fp8.scale_from_amax(jnp.float32(np.nan), e4m3, old)) == 0.5
    assert float(fp8.scale_from_amax(jnp.float32(1e-35), e4m3, old)) == fp8.SCALE_FLOOR
    assert float(fp8.scale_from_amax(jnp.float32(448.0), e4m3, old)) == 1.0
    zeros = jnp.zeros((4, 8), jnp.float32)
    for scaling in ("delayed", "current"):
        op = fp8.Fp8DotGeneral(scaling=scaling, amax_history_len=4)
        variables = op.init(jax.random.key(0), zeros, jnp.ones((8, 3)), DIMS)
        y = op.apply(variables, zeros, jnp.ones((8, 3)), DIMS)
        assert np.array_equal(np.asarray(y), np.zeros((4, 3))), "a zero tensor gives a zero result"


def snr_db(reference, approx):
    reference, approx = np.asarray(reference, np.float64), np.asarray(approx, np.float64)
    return 10 * np.log10(np.sum(reference ** 2) / np.sum((reference - approx) ** 2))


@pytest.mark.parametrize("fmt", ["ocp", "fnuz"])
@pytest.mark.parametrize("scaling", ["delayed", "current"])
def test_fp8_gemm_forward_and_backward_snr(fmt, scaling):
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((64, 256)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((256, 128)) * 0.05, jnp.float32)
    cotangent = jnp.asarray(rng.standard_normal((64, 128)) * 1e-3, jnp.float32)
    op = fp8.Fp8DotGeneral(fmt=fmt, scaling=scaling, amax_history_len=8)
    variables = op.init(jax.random.key(0), x, w, DIMS)
    if scaling == "delayed":  # warm the history with one step, as training does
        variables = jax.grad(lambda v: jnp.sum(op.apply(v, x, w, DIMS) * cotangent))(variables)

    def fp8_loss(x, w):
        return jnp.sum(op.apply(variables, x, w, DIMS) * cotangent)

    def exact_loss(x, w):
        return jnp.sum((x @ w) * cotangent)

    assert snr_db(x @ w, op.apply(variables, x, w, DIMS)) >= 25
    for got, want in zip(jax.grad(fp8_loss, (0, 1))(x, w), jax.grad(exact_loss, (0, 1))(x, w)):
        assert snr_db(want, got) >= 20


# (lhs shape, rhs shape, dimension numbers): a Dense layer, the attention output projection
# (two contracting axes), an expert dot with a batch axis (moe.py's capacity path), and contracting
# axes out of order with a batch axis that is not leading.
DOT_LAYOUTS = [
    ((2, 5, 16), (16, 24), (((2,), (0,)), ((), ()))),
    ((2, 5, 4, 8), (4, 8, 16), (((2, 3), (0, 1)), ((), ()))),
    ((3, 4, 5, 16), (4, 16, 8), (((3,), (1,)), ((1,), (0,)))),
    ((6, 3, 4, 5), (5, 2, 3, 4), (((3, 1), (0, 2)), ((2,), (3,)))),
]


@pytest.mark.parametrize("lhs_shape, rhs_shape, dims", DOT_LAYOUTS)
def test_fp8_dot_equals_plain_dots_of_the_quantized_operands(lhs_shape, rhs_shape, dims):
    """The fp8 dot's output and both gradients against jax's own dot_general and its autodiff,
    run in fp32 on the dequantized fp8 values: the same numbers, other code."""
    e4m3, e5m2 = fp8.FORMATS["ocp"]
    keys = jax.random.split(jax.random.key(3), 3)
    x = jax.random.normal(keys[0], lhs_shape, jnp.float32)
    w = jax.random.normal(keys[1], rhs_shape, jnp.float32) * 0.1
    x_scale, w_scale, grad_scale = jnp.float32(0.01), jnp.float32(0.002), jnp.float32(0.5)
    history = jnp.zeros((4,), jnp.float32).at[1].set(1e-3)  # the gradient's scale: 1e-3 / 57344

    def ours(x, w, grad_scale, history):
        return fp8.fp8_dot(x, w, x_scale, w_scale, grad_scale, history, dims, "ocp", True)

    y, vjp = jax.vjp(ours, x, w, grad_scale, history)
    x_q, w_q = fp8.quantize_dequantize(x, e4m3, x_scale), fp8.quantize_dequantize(w, e4m3, w_scale)
    want_y, want_vjp = jax.vjp(lambda a, b: jax.lax.dot_general(a, b, dims, precision="highest"), x_q, w_q)
    assert_close(y, want_y)

    g = jax.random.normal(keys[2], y.shape, jnp.float32) * 1e-4
    dx, dw, new_grad_scale, new_history = vjp(g)
    g_scale = jnp.float32(1e-3 / fp8.fp8_max(e5m2))  # from the history, not from this g
    assert float(new_grad_scale) == pytest.approx(float(g_scale), rel=1e-6)
    assert float(new_history[0]) == pytest.approx(float(jnp.max(jnp.abs(g))), rel=1e-6)
    want_dx, want_dw = want_vjp(fp8.quantize_dequantize(g, e5m2, g_scale))
    assert_close((dx, dw), (want_dx, want_dw))


@pytest.mark.parametrize("lhs_shape, rhs_shape, dims", DOT_LAYOUTS)
def test_transposed_dots_match_autodiff(lhs_shape, rhs_shape, dims):
    keys = jax.random.split(jax.random.key(4), 3)
    x, w = jax.random.normal(keys[0], lhs_shape), jax.random.normal(keys[1], rhs_shape)
    y, vjp = jax.vjp(lambda a, b: jax.lax.dot_general(a, b, dims, precision="highest"), x, w)
    g = jax.random.normal(keys[2], y.shape)
    want_dx, want_dw = vjp(g)
    with jax.default_matmul_precision("highest"):
        assert_close((fp8.transpose_dot_lhs(g, x.ndim, w, dims, jnp.float32),
                      fp8.transpose_dot_rhs(g, x, w.ndim, dims, jnp.float32)), (want_dx, want_dw))


# Flax's direct op also feeds fp8 arrays to the dot and rescales its output: the same arithmetic.
# Its fnuz op dequantizes the operands first, so the rescaling rounds elsewhere (~4e-6 relative).
@pytest.mark.parametrize("fmt, flax_op, rtol", [("ocp", fp8_ops.Fp8DirectDotGeneralOp, 1e-6),
                                                ("fnuz", fp8_ops.NANOOFp8DotGeneralOp, 2e-5)])
def test_parity_with_flax_delayed_scaling(fmt, flax_op, rtol):
    rng = np.random.default_rng(1)
    ours, theirs = fp8.Fp8DotGeneral(fmt=fmt, amax_history_len=16), flax_op(amax_history_length=16)
    k = jnp.asarray(rng.standard_normal((64, 32)) * 0.1, jnp.float32)
    x0 = jnp.asarray(rng.standard_normal((16, 64)), jnp.float32)
    ours_state = ours.init(jax.random.key(0), x0, k, DIMS)
    theirs_state = theirs.init(jax.random.key(0), x0, k, DIMS)
    for step in range(4):
        x = jnp.asarray(rng.standard_normal((16, 64)) * (step + 1), jnp.float32)
        c = jnp.asarray(rng.standard_normal((16, 32)), jnp.float32)
        np.testing.assert_allclose(ours.apply(ours_state, x, k, DIMS), theirs.apply(theirs_state, x, k, DIMS),
                                   rtol=rtol, atol=rtol)
        # Both hand the updated state back as the state's gradient.
        ours_state = jax.grad(lambda v: jnp.sum(ours.apply(v, x, k, DIMS) * c))(ours_state)
        theirs_state = jax.grad(lambda v: jnp.sum(theirs.apply(v, x, k, DIMS) * c))(theirs_state)
    mine, flax_state = ours_state["fp8"], theirs_state["_overwrite_with_gradient"]
    for name in ("input", "kernel", "output_grad"):
        np.testing.assert_allclose(mine[f"{name}_scale"], flax_state[f"{name}_scale"][0], rtol=1e-6)
        np.testing.assert_array_equal(mine[f"{name}_amax_history"], flax_state[f"{name}_amax_history"])
    assert int((mine["input_amax_history"] > 0).sum()) == 4, "four steps of history were recorded"


@pytest.mark.parametrize("kind, capability, expected", [
    ("AMD Instinct MI300X", "", "fnuz"), ("AMD Instinct MI325X", "", "fnuz"),
    ("", "gfx942", "fnuz"), ("AMD Instinct MI355X", "gfx950", "ocp"), ("NVIDIA H100 80GB HBM3", "9.0", "ocp"),
    ("cpu", "", "ocp"),
])
def test_auto_format_follows_the_device(kind, capability, expected):
    device = types.SimpleNamespace(device_kind=kind, compute_capability=capability)
    assert fp8.resolve_format("auto", device) == expected
    assert fp8.resolve_format("ocp", device) == "ocp"


def fp8_config(tmp_path, **overrides):
    return small_config(**{"precision.policy": "fp8", "precision.amax_history_len": 8,
                           "output_dir": str(tmp_path), **overrides})


def test_delayed_state_is_updated_by_the_step_not_the_optimizer(devices, tmp_path):
    cfg = fp8_config(tmp_path, **{"optimizer.weight_decay": 0.5, "optimizer.lr": 1.0, "train.steps": 3})
    trainer = Trainer(cfg, devices=devices[:2], log=lambda *_: None)
    before = jax.tree_util.tree_map(np.asarray, trainer.state.fp8)
    batch = trainer.device_batch(0)
    # What the op alone makes of this batch: the new state is the state's "gradient".
    from maxtext_rocm.trainer.step import summed_loss
    with trainer.sharding_rules():
        _, expected = jax.jit(jax.grad(
            lambda p, f: summed_loss(p, trainer.model, batch, 0.0, f)[0], argnums=(0, 1)))(
            trainer.state.params, trainer.state.fp8)
    trainer.step()
    after = trainer.state.fp8
    q_kernel = after["layers"]["attention"]["q"]["dot"]
    assert q_kernel["input_amax_history"].shape == (2, 8), "one history per scanned layer"
    assert float(q_kernel["input_amax_history"][0, 0]) > 0 and before["layers"]["attention"]["q"]["dot"][
        "input_amax_history"].max() == 0
    for got, want in zip(jax.tree_util.tree_leaves(after), jax.tree_util.tree_leaves(expected)):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    assert "fp8" not in str(jax.tree_util.tree_structure(trainer.state.opt_state)), "the optimizer never sees it"
    assert "lm_head" not in after, "the LM head stays in bf16 by default"


def test_delayed_state_survives_a_checkpoint(devices, tmp_path):
    cfg = fp8_config(tmp_path, **{"train.steps": 3, "checkpoint.every": 3})
    trainer = Trainer(cfg, devices=devices[:2], log=lambda *_: None)
    trainer.run()
    saved = jax.tree_util.tree_map(np.asarray, trainer.state.fp8)
    resumed = Trainer(fp8_config(tmp_path, **{"train.steps": 6}), devices=devices[:2], log=lambda *_: None)
    assert resumed.step_count == 3
    for a, b in zip(jax.tree_util.tree_leaves(resumed.state.fp8), jax.tree_util.tree_leaves(saved)):
        np.testing.assert_array_equal(np.asarray(a), b)


@pytest.mark.parametrize("fmt, types_", [("fnuz", ("f8E4M3FNUZ", "f8E5M2FNUZ")), ("ocp", ("f8E4M3FN", "f8E5M2"))])
def test_train_step_hlo_has_the_fp8_types(fmt, types_, devices, tmp_path):
    trainer = Trainer(fp8_config(tmp_path, **{"precision.fp8_format": fmt}), devices=devices[:1],
                      log=lambda *_: None)
    # The jitted step the Trainer compiled (launch.jit_train_step), lowered again for its text.
    step = launch.jit_train_step(trainer.cfg, trainer.model, trainer.mesh, trainer.state_sharding, trainer.batch_sharding)
    with trainer.sharding_rules():
        hlo = step.lower(trainer.state, trainer.device_batch(0), trainer.hyperparameters).as_text()
    for name in types_:
        assert name.lower() in hlo.lower(), name
    if fmt == "fnuz":
        assert "f8e4m3fn>" not in hlo.lower() and "f8e4m3fn " not in hlo.lower()


@pytest.mark.slow
@pytest.mark.parametrize("fmt, scaling", [("ocp", "delayed"), ("fnuz", "delayed"), ("ocp", "current"),
                                          ("fnuz", "current")])
def test_tiny_model_fp8_loss_tracks_bf16(fmt, scaling, devices, tmp_path):
    def final_loss(policy, **extra):
        cfg = small_config(**{"precision.policy": policy, "data.source": "embedded", "model.vocab_size": 512,
                              "model.d_model": 128, "train.steps": 200, "train.seq_len": 128,
                              "train.per_device_batch_size": 8, "optimizer.lr": 3e-3, "optimizer.warmup_steps": 20,
                              "log.every": 20, "output_dir": str(tmp_path / f"{policy}{fmt}{scaling}"), **extra})
        trainer = Trainer(cfg, devices=devices[:1], log=lambda *_: None)
        trainer.run()
        assert int(trainer.state.nonfinite_steps) == 0
        # The final parameters on 20 batches of the last steps: less noisy than one logged loss.
        loss = jax.jit(lambda params, fp8_state, batch: eval_step(params, batch, model=trainer.model,
                                                                  fp8_state=fp8_state)["loss"])
        with trainer.sharding_rules():
            return np.mean([float(loss(trainer.state.params, trainer.state.fp8, trainer.device_batch(step)))
                            for step in range(180, 200)])

    bf16 = final_loss("bf16")
    fp8_loss = final_loss("fp8", **{"precision.fp8_format": fmt, "precision.fp8_scaling": scaling})
    assert abs(fp8_loss - bf16) / bf16 < 0.015, (fp8_loss, bf16)


# CI budget: the dropless case (Mixtral's default) runs by default; capacity and dense, ~35 s each, in -m slow
@pytest.mark.parametrize("moe_impl, expert_dots", [pytest.param("capacity", True, marks=pytest.mark.slow),
                                                   pytest.param("dense", True, marks=pytest.mark.slow),
                                                   ("dropless", False)])
def test_mixtral_experts_run_in_fp8_except_ragged_dot(moe_impl, expert_dots, devices, tmp_path):
    cfg = fp8_config(tmp_path, **{"model.family": "mixtral", "model.n_experts": 4, "model.experts_per_token": 2,
                                  "model.moe_impl": moe_impl, "model.moe_capacity_factor": 2.0})
    trainer = Trainer(cfg, devices=devices[:1], log=lambda *_: None)
    moe_state = trainer.state.fp8["layers"].get("moe", {})
    assert sorted(moe_state) == (["down_dot", "gate_dot", "up_dot"] if expert_dots else [])
    for _ in range(2):
        metrics = trainer.step()
    assert np.isfinite(float(metrics["loss"])) and int(metrics["nonfinite_steps"]) == 0
    if expert_dots:  # the expert matmuls recorded their own statistics, backward pass included
        down = trainer.state.fp8["layers"]["moe"]["down_dot"]
        assert float(down["input_amax_history"].max()) > 0 and float(down["output_grad_amax_history"].max()) > 0
    assert "router" not in str(jax.tree_util.tree_structure(trainer.state.fp8)), "the router stays out of fp8"


def test_qkv_biases_and_head_norms_stay_outside_the_fp8_dots(devices, tmp_path):
    """Qwen2.5's biases and Qwen3's head norms under fp8: q, k and v keep their own fp8 dots (with
    statistics from both passes), the biases and norm scales are trained in full precision after
    them, and nothing else joins the fp8 state."""
    cfg = fp8_config(tmp_path, **{"model.qkv_bias": True, "model.qk_norm": True, "optimizer.lr": 1e-2,
                                  "optimizer.warmup_steps": 0})
    trainer = Trainer(cfg, devices=devices[:1], log=lambda *_: None)
    attention_state = trainer.state.fp8["layers"]["attention"]
    assert sorted(attention_state) == ["k", "o", "q", "v"]
    before = jax.tree_util.tree_map(np.asarray, trainer.state.params["layers"]["attention"])
    for _ in range(2):
        metrics = trainer.step()
    assert np.isfinite(float(metrics["loss"])) and int(metrics["nonfinite_steps"]) == 0
    after = trainer.state.params["layers"]["attention"]
    for name in ("q_bias", "k_bias", "v_bias"):
        assert np.abs(np.asarray(after[name]) - before[name]).max() > 0, name
    for name in ("q_norm", "k_norm"):
        assert np.abs(np.asarray(after[name]["scale"]) - before[name]["scale"]).max() > 0, name
    q = trainer.state.fp8["layers"]["attention"]["q"]["dot"]
    assert float(q["input_amax_history"].max()) > 0 and float(q["output_grad_amax_history"].max()) > 0
