"""The fused, chunked LM-head cross-entropy (maxtext_rocm/numerics/cross_entropy.py) against the plain one:
full logits, log-softmax and autodiff, written independently here."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from maxtext_rocm.numerics import cross_entropy

from conftest import small_config
from helpers import assert_close, loss_and_grads


def reference(hidden, weight, targets, weights, vocab_axis, z_loss_weight):
    """Materialised fp32 logits, naive log-softmax."""
    w = weight if vocab_axis == 1 else weight.T
    logits = (hidden.astype(jnp.float32) @ w.astype(jnp.float32))
    log_z = jnp.log(jnp.sum(jnp.exp(logits - logits.max(-1, keepdims=True)), -1)) + logits.max(-1)
    target_logit = jnp.take_along_axis(logits, targets[..., None], -1)[..., 0]
    ce = jnp.sum((log_z - target_logit) * weights)
    z = jnp.sum(log_z ** 2 * weights)
    return ce + z_loss_weight * z, {"ce": ce, "z_loss": z}


def inputs(vocab_axis, seed=0, batch=3, seq=12, d=16, vocab=50):
    ks = jax.random.split(jax.random.key(seed), 4)
    hidden = jax.random.normal(ks[0], (batch, seq, d), jnp.float32)
    shape = (vocab, d) if vocab_axis == 0 else (d, vocab)
    weight = jax.random.normal(ks[1], shape, jnp.float32) * 0.3
    targets = jax.random.randint(ks[2], (batch, seq), 0, vocab)
    weights = (jax.random.uniform(ks[3], (batch, seq)) > 0.25).astype(jnp.float32)  # some masked
    return hidden, weight, targets, weights


@pytest.mark.parametrize("vocab_axis, chunk, z_loss_weight", [
    (0, 1, 0.0), (1, 4, 1e-2), (0, 12, 1e-2), (1, 12, 0.0)])  # each axis, chunk and z-loss at least twice
def test_values_and_gradients_match_full_logits(vocab_axis, chunk, z_loss_weight):
    hidden, weight, targets, weights = inputs(vocab_axis)

    def fused(h, w):
        return cross_entropy.head_loss(h, w, targets, weights, vocab_axis=vocab_axis,
                              z_loss_weight=z_loss_weight, chunk=chunk)

    def plain(h, w):
        return reference(h, w, targets, weights, vocab_axis, z_loss_weight)

    (value, sums), grads = jax.jit(jax.value_and_grad(fused, argnums=(0, 1), has_aux=True))(hidden, weight)
    (ref_value, ref_sums), ref_grads = jax.value_and_grad(plain, argnums=(0, 1), has_aux=True)(hidden, weight)
    np.testing.assert_allclose(value, ref_value, rtol=1e-5)
    for key in ("ce", "z_loss"):
        np.testing.assert_allclose(sums[key], ref_sums[key], rtol=1e-5)
    assert_close(grads, ref_grads)
    # Undifferentiated (evaluation) path: the same numbers.
    eval_value, eval_sums = jax.jit(fused)(hidden, weight)
    np.testing.assert_allclose(eval_value, ref_value, rtol=1e-5)
    np.testing.assert_allclose(eval_sums["ce"], ref_sums["ce"], rtol=1e-5)


def test_cotangent_scales_gradients_and_metric_sums_carry_none():
    hidden, weight, targets, weights = inputs(1, seed=1)

    def scaled(h, w):
        objective, sums = cross_entropy.head_loss(h, w, targets, weights, vocab_axis=1, z_loss_weight=0.1, chunk=3)
        return -2.5 * objective + 7.0 * sums["ce"]  # the metric sum must contribute no gradient

    def ref(h, w):
        return -2.5 * reference(h, w, targets, weights, 1, 0.1)[0]

    assert_close(jax.grad(scaled, argnums=(0, 1))(hidden, weight), jax.grad(ref, argnums=(0, 1))(hidden, weight))


def test_bf16_hidden_is_close_to_fp32():
    hidden, weight, targets, weights = inputs(1, seed=2, vocab=300)
    value, _ = cross_entropy.head_loss(hidden.astype(jnp.bfloat16), weight, targets, weights, vocab_axis=1, chunk=4)
    ref, _ = reference(hidden, weight, targets, weights, 1, 0.0)
    np.testing.assert_allclose(value, ref, rtol=1e-2)
    grad = jax.grad(lambda h: cross_entropy.head_loss(h, weight, targets, weights, vocab_axis=1, chunk=4)[0])(
        hidden.astype(jnp.bfloat16))
    assert grad.dtype == jnp.bfloat16


def test_chunk_length_divides_sequence():
    assert cross_entropy.chunk_length(256, 64) == 64
    assert cross_entropy.chunk_length(100, 64) == 50
    assert cross_entropy.chunk_length(97, 64) == 1
    assert cross_entropy.chunk_length(16, 64) == 16
    with pytest.raises(ValueError, match="does not divide"):
        cross_entropy.head_loss(*inputs(1), vocab_axis=1, chunk=5)


@pytest.mark.parametrize("tie", [False, True])
def test_train_step_gradients_equal_unchunked(tie, tmp_path):
    """The model's loss with the fused head equals the model's own logits path (fp32), with z-loss."""
    cfgs = [small_config(**{"model.tie_embeddings": tie, "model.loss_chunk_len": chunk,
                            "precision.policy": "fp32", "train.z_loss_weight": 1e-3,
                            "output_dir": str(tmp_path / str(chunk))})
            for chunk in (0, 4)]
    (_, g0, run0), (_, g1, run1) = (loss_and_grads(cfg, jax.devices()[:1]) for cfg in cfgs)
    m0, m1 = run0.sums, run1.sums
    for key in ("loss", "z_loss"):
        np.testing.assert_allclose(m1[key], m0[key], rtol=1e-5)
    assert_close(g1, g0)
