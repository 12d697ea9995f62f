"""Layers against independent references: RoPE (incl. Llama 3.1 scaling), attention, RMSNorm."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from maxtext_rocm.models.attention import dot_product_attention
from maxtext_rocm.models.blockwise_attention import block_size, blockwise_attention
from maxtext_rocm.models.layers import RMSNorm, apply_rope, rope_inv_frequencies
from maxtext_rocm.numerics.precision import policy_from_config

from helpers import assert_close

LLAMA31 = dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position=8192)


def reference_llama31_frequencies(head_dim, theta, s):
    """Scalar loop over frequencies, as Llama 3.1's reference code describes the scaling."""
    out = []
    low_wavelen = s["original_max_position"] / s["low_freq_factor"]
    high_wavelen = s["original_max_position"] / s["high_freq_factor"]
    for i in range(0, head_dim, 2):
        freq = 1.0 / theta ** (i / head_dim)
        wavelen = 2 * math.pi / freq
        if wavelen < high_wavelen:
            out.append(freq)
        elif wavelen > low_wavelen:
            out.append(freq / s["factor"])
        else:
            smooth = (s["original_max_position"] / wavelen - s["low_freq_factor"]) / (
                s["high_freq_factor"] - s["low_freq_factor"])
            out.append((1 - smooth) * freq / s["factor"] + smooth * freq)
    return np.array(out)


def test_rope_frequencies_without_scaling():
    got = rope_inv_frequencies(8, 10000.0)
    np.testing.assert_allclose(got, [1.0, 0.1, 0.01, 0.001], rtol=1e-6)


def test_llama31_rope_scaling_matches_reference():
    got = rope_inv_frequencies(128, 500000.0, LLAMA31)
    want = reference_llama31_frequencies(128, 500000.0, LLAMA31)
    np.testing.assert_allclose(got, want, rtol=1e-6)
    plain = rope_inv_frequencies(128, 500000.0)
    # High frequencies untouched, the lowest divided by the factor, some in between interpolated.
    assert got[0] == plain[0]
    np.testing.assert_allclose(got[-1], plain[-1] / 8.0, rtol=1e-6)
    ratio = plain / got
    assert np.any((ratio > 1.01) & (ratio < 7.99)), "no frequency fell in the smooth band"


def test_apply_rope_is_a_complex_rotation():
    rng = np.random.default_rng(0)
    b, s, h, d = 2, 7, 3, 16
    x = rng.standard_normal((b, s, h, d)).astype(np.float32)
    positions = np.stack([np.arange(s), np.arange(s) + 5])
    inv = rope_inv_frequencies(d, 10000.0, dict(LLAMA31, original_max_position=16))
    got = np.asarray(apply_rope(jnp.asarray(x), jnp.asarray(positions), inv))
    z = x[..., : d // 2] + 1j * x[..., d // 2:]
    rotated = z * np.exp(1j * positions[:, :, None, None] * inv.astype(np.float64))
    want = np.concatenate([rotated.real, rotated.imag], axis=-1)
    assert_close(got, want)


def naive_attention(q, k, v, segment_ids=None, window=None):
    """softmax(QK^T / sqrt(d) + causal mask) V, with kv heads repeated for each query group; with
    a window W, a query sees the W keys ending at itself."""
    b, s, h, d = q.shape
    groups = h // k.shape[2]
    k, v = np.repeat(k, groups, axis=2), np.repeat(v, groups, axis=2)
    out = np.zeros_like(q, dtype=np.float64)
    for bi in range(b):
        for hi in range(h):
            scores = q[bi, :, hi] @ k[bi, :, hi].T / math.sqrt(d)
            allowed = np.tril(np.ones((s, s), bool))
            if window:
                allowed &= np.subtract.outer(np.arange(s), np.arange(s)) < window
            if segment_ids is not None:
                allowed &= segment_ids[bi][:, None] == segment_ids[bi][None, :]
            scores = np.where(allowed, scores, -np.inf)
            p = np.exp(scores - scores.max(-1, keepdims=True))
            out[bi, :, hi] = (p / p.sum(-1, keepdims=True)) @ v[bi, :, hi]
    return out


@pytest.mark.parametrize("heads, kv_heads", [(4, 4), (4, 2), (6, 1)])
def test_attention_matches_naive_softmax(heads, kv_heads):
    rng = np.random.default_rng(1)
    b, s, d = 2, 9, 8
    q = rng.standard_normal((b, s, heads, d)).astype(np.float32)
    k = rng.standard_normal((b, s, kv_heads, d)).astype(np.float32)
    v = rng.standard_normal((b, s, kv_heads, d)).astype(np.float32)
    got = dot_product_attention(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v))
    assert_close(got, naive_attention(q, k, v))


def test_attention_respects_segments():
    rng = np.random.default_rng(2)
    q = rng.standard_normal((1, 6, 2, 4)).astype(np.float32)
    k = rng.standard_normal((1, 6, 1, 4)).astype(np.float32)
    v = rng.standard_normal((1, 6, 1, 4)).astype(np.float32)
    segments = np.array([[1, 1, 1, 2, 2, 3]])
    got = dot_product_attention(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v),
                                segment_ids=jnp.asarray(segments))
    assert_close(got, naive_attention(q, k, v, segments))
    # The first token of a document sees only itself.
    np.testing.assert_allclose(np.asarray(got)[0, 3, 0], v[0, 3, 0], atol=1e-6)


# (batch, seq, heads, kv_heads, head_dim, block, documents, window): several blocks, GQA down to
# one kv head, document masks whose boundaries fall inside blocks, windows shorter and longer
# than a block, and a single block.
BLOCKWISE_CASES = [
    (2, 64, 4, 2, 16, 16, False, None),
    (1, 96, 6, 1, 8, 32, True, None),
    (2, 96, 4, 2, 16, 32, True, 40),
    (1, 128, 2, 2, 16, 16, False, 20),
    (1, 32, 4, 4, 8, 32, False, None),
]


def _blockwise_inputs(b, s, h, kvh, d, documents, seed):
    rng = np.random.default_rng(seed)
    q, k, v = (rng.standard_normal(shape).astype(np.float32) for shape in ((b, s, h, d), (b, s, kvh, d), (b, s, kvh, d)))
    segments = np.sort(rng.integers(0, 3, (b, s)), axis=1).astype(np.int32) if documents else None
    return q, k, v, segments


@pytest.mark.parametrize("b, s, h, kvh, d, block, documents, window", BLOCKWISE_CASES)
def test_blockwise_attention_matches_naive_softmax(b, s, h, kvh, d, block, documents, window):
    q, k, v, segments = _blockwise_inputs(b, s, h, kvh, d, documents, seed=3)
    got = blockwise_attention(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), block=block, sliding_window=window,
                              segment_ids=None if segments is None else jnp.asarray(segments))
    assert_close(got, naive_attention(q, k, v, segments, window))


@pytest.mark.parametrize("b, s, h, kvh, d, block, documents, window", BLOCKWISE_CASES)
def test_blockwise_attention_gradients_match_autodiff_of_xla(b, s, h, kvh, d, block, documents, window):
    """The hand-written backward pass against JAX's autodiff of the "xla" attention."""
    q, k, v, segments = (None if x is None else jnp.asarray(x)
                         for x in _blockwise_inputs(b, s, h, kvh, d, documents, seed=4))
    cotangent = jnp.asarray(np.random.default_rng(5).standard_normal(q.shape), jnp.float32)

    def loss(implementation):
        def f(q, k, v):
            if implementation == "blockwise":
                out = blockwise_attention(q, k, v, segment_ids=segments, sliding_window=window, block=block)
            else:
                out = dot_product_attention(q, k, v, segment_ids=segments, sliding_window=window)
            return jnp.sum(out * cotangent)
        return jax.jit(jax.grad(f, argnums=(0, 1, 2)))(q, k, v)

    assert_close(loss("blockwise"), loss("xla"))


def test_model_with_blockwise_attention_equals_xla(devices, tmp_path, monkeypatch):
    """The whole model (scanned layers, remat, GQA) trains on the same loss and gradients with
    either attention; 16-position blocks, so the 64-token sequences span four."""
    from conftest import small_config
    from helpers import loss_and_grads
    from maxtext_rocm.models import blockwise_attention as blockwise

    monkeypatch.setattr(blockwise, "block_size", lambda seq_len: min(seq_len, 16))  # init traces 8 tokens
    results = {}
    for implementation in ("xla", "blockwise"):
        cfg = small_config(**{"model.attention": implementation, "model.remat": "full", "train.seq_len": 64,
                              "mesh.ici.fsdp": 1, "output_dir": str(tmp_path / implementation)})
        results[implementation] = loss_and_grads(cfg, devices[:1])[:2]
    assert_close(results["blockwise"][0], results["xla"][0])
    assert_close(results["blockwise"][1], results["xla"][1])


def test_auto_attention_follows_the_device():
    from types import SimpleNamespace

    from maxtext_rocm.models.attention import resolve_implementation

    def device(platform, version):
        return SimpleNamespace(platform=platform, client=SimpleNamespace(platform_version=version))

    assert resolve_implementation("auto", device("gpu", "cuda 13000")) == "cudnn"
    assert resolve_implementation("auto", device("gpu", "cuda 13000"), jnp.float32) == "blockwise"  # no fp32 cuDNN
    assert resolve_implementation("auto", device("gpu", "PJRT C API\nrocm 6.4.1")) == "blockwise"
    assert resolve_implementation("auto", device("cpu", "cpu"), seq_len=256) == "xla"
    assert resolve_implementation("auto", device("cpu", "cpu"), seq_len=4096) == "blockwise"
    assert resolve_implementation("auto") == "xla"  # this machine, no sequence length given
    assert resolve_implementation("blockwise", device("gpu", "cuda 13000")) == "blockwise"


def test_blockwise_block_size_rule():
    assert block_size(8192) == 512 and block_size(256) == 256 and block_size(96) == 32
    assert block_size(100) == 100  # no power-of-two block of 16 or more divides it: one block


def test_rmsnorm_matches_formula():
    import ml_collections

    policy = policy_from_config(ml_collections.ConfigDict({"policy": "fp32"}))
    x = np.random.default_rng(3).standard_normal((2, 5, 16)).astype(np.float32)
    norm = RMSNorm(1e-5, policy)
    params = norm.init(jax.random.key(0), x)
    scale = np.linspace(0.5, 1.5, 16).astype(np.float32)
    got = norm.apply({"params": {"scale": jnp.asarray(scale)}}, x)
    assert jax.tree_util.tree_leaves(params)[0].shape == (16,)
    want = x / np.sqrt((x ** 2).mean(-1, keepdims=True) + 1e-5) * scale
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5)
