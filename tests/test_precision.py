"""The CPU's bf16 matmul (precision.f32_accumulating_dot_general): the values of XLA's own dot and
its gradients, only bf16 x bf16 -> fp32 dots in what it lowers to, chosen by the policy for bf16
on the CPU alone, and kept by the remat policies that keep matmul outputs."""

import functools
import re

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

from maxtext_rocm import config as config_lib
from maxtext_rocm.models import build_model
from maxtext_rocm.resolve import resolve_here
from maxtext_rocm.numerics.precision import f32_accumulating_dot_general, named_dot_general, policy_from_config

from helpers import assert_close

# (lhs shape, rhs shape, dimension numbers): a dense layer, a per-expert dot with a batch axis,
# attention's scores and its probabilities x values (two batch axes), a transposed contraction.
CASES = [
    ((2, 8, 16), (16, 4, 5), (((2,), (0,)), ((), ()))),
    ((3, 4, 6, 16), (4, 16, 10), (((3,), (1,)), ((1,), (0,)))),
    ((2, 8, 3, 2, 16), (2, 8, 3, 16), (((4,), (3,)), ((0, 2), (0, 2)))),
    ((2, 3, 2, 8, 8), (2, 8, 3, 16), (((4,), (1,)), ((0, 1), (0, 2)))),
    ((16, 12), (7, 16), (((0,), (1,)), ((), ()))),
]


def _operands(lhs_shape, rhs_shape):
    rng = np.random.default_rng(0)
    return (jnp.asarray(rng.standard_normal(lhs_shape), jnp.bfloat16),
            jnp.asarray(rng.standard_normal(rhs_shape), jnp.bfloat16), rng)


@pytest.mark.parametrize("lhs_shape, rhs_shape, dims", CASES)
def test_values_and_gradients_equal_an_fp32_dot_rounded_to_bf16(lhs_shape, rhs_shape, dims):
    """The reference: XLA's dot over fp32 copies of the operands, rounded to bf16 once, and JAX's
    own transposes of it for a bf16 cotangent. Only the order of the fp32 sums may differ."""
    lhs, rhs, rng = _operands(lhs_shape, rhs_shape)

    def reference(a, b):
        return jax.lax.dot_general(a.astype(jnp.float32), b.astype(jnp.float32), dims).astype(jnp.bfloat16)

    @functools.partial(jax.jit, static_argnums=0)
    def value_and_vjp(fn, cotangent):
        out, vjp = jax.vjp(fn, lhs, rhs)
        return (out, *vjp(cotangent))

    shape = jax.eval_shape(reference, lhs, rhs).shape
    cotangent = jnp.asarray(rng.standard_normal(shape), jnp.bfloat16)
    got = value_and_vjp(lambda a, b: f32_accumulating_dot_general(a, b, dims), cotangent)
    want = value_and_vjp(reference, cotangent)
    for g, w in zip(got, want):
        assert g.dtype == w.dtype == jnp.bfloat16
        # One bf16 rounding apart at most (relative 2^-8), from summing in another order.
        np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(w, np.float32), rtol=2 ** -7, atol=1e-2)


def test_an_fp32_result_is_returned_in_fp32_and_its_cotangent_rounded_to_bf16():
    lhs, rhs, rng = _operands((2, 8, 3, 2, 16), (2, 8, 3, 16))
    dims = CASES[2][2]
    out, vjp = jax.vjp(lambda a, b: f32_accumulating_dot_general(a, b, dims, preferred_element_type=jnp.float32),
                       lhs, rhs)
    assert out.dtype == jnp.float32
    want = jax.lax.dot_general(lhs, rhs, dims, preferred_element_type=jnp.float32)
    assert_close(out, want)
    cotangent = jnp.asarray(rng.standard_normal(out.shape), jnp.float32)
    _, want_vjp = jax.vjp(lambda a, b: jax.lax.dot_general(a.astype(jnp.float32), b.astype(jnp.float32), dims),
                          lhs, rhs)
    for g, w in zip(vjp(cotangent), want_vjp(cotangent.astype(jnp.bfloat16).astype(jnp.float32))):
        np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(w, np.float32), rtol=2 ** -7, atol=1e-2)


def test_forward_and_backward_lower_to_bf16_dots_with_fp32_results_only():
    """What it emits for XLA: every dot (both transposes included) takes bf16 operands and
    returns fp32, the form the CPU backend runs natively; XLA's own bf16 dot returns bf16."""
    lhs, rhs, _ = _operands((4, 8, 16), (16, 32))
    dims = (((2,), (0,)), ((), ()))

    def dot_types(dot):
        """(lhs, rhs, result) element types of each dot in the gradient's StableHLO."""
        loss = lambda a, b: jnp.sum(dot(a, b, dims).astype(jnp.float32) ** 2)  # noqa: E731
        text = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(lhs, rhs).as_text()
        signatures = [line.rsplit(" : ", 1)[1] for line in text.splitlines() if "stablehlo.dot_general" in line]
        return [tuple(re.findall(r"tensor<(?:\d+x)*(\w+)>", signature)) for signature in signatures]

    assert dot_types(f32_accumulating_dot_general) == [("bf16", "bf16", "f32")] * 3
    assert dot_types(jax.lax.dot_general) == [("bf16", "bf16", "bf16")] * 3


def test_other_dtypes_go_to_xlas_dot():
    """fp32 operands (the MoE router's) get XLA's dot itself: no custom VJP, the same values."""
    rng = np.random.default_rng(1)
    a, b = (jnp.asarray(rng.standard_normal(shape), jnp.float32) for shape in ((4, 8), (8, 2)))
    dims = (((1,), (0,)), ((), ()))
    ours = lambda a, b: f32_accumulating_dot_general(a, b, dims)  # noqa: E731
    assert "custom_vjp_call" not in str(jax.make_jaxpr(ours)(a, b))
    assert "custom_vjp_call" in str(jax.make_jaxpr(ours)(a.astype(jnp.bfloat16), b.astype(jnp.bfloat16)))
    np.testing.assert_array_equal(jax.jit(ours)(a, b), jax.jit(jax.lax.dot_general, static_argnums=2)(a, b, dims))


def test_the_policy_chooses_it_for_bf16_on_the_cpu_only():
    cpu = jax.devices()[0]
    for name, want in (("bf16", f32_accumulating_dot_general), ("fp8", f32_accumulating_dot_general),
                       ("fp32", named_dot_general)):
        # fp8_format as the resolve step leaves it (maxtext_rocm/resolve.py)
        cfg = ml_collections.ConfigDict(dict(config_lib.defaults().precision, policy=name, fp8_format="ocp"))
        assert policy_from_config(cfg, cpu).dot_general is want, name
        # The AOT fit check compiles a GPU's step on the CPU: XLA's own dot there (named for remat).
        assert policy_from_config(cfg, cpu, platform="gpu").dot_general is named_dot_general, name


def _dot_count(remat: str, policy: str) -> int:
    """dot_general equations in the gradient of a 1-layer model under this remat policy."""
    cfg = config_lib.load_preset("tiny_llama")
    cfg.model.update(vocab_size=64, d_model=32, n_layers=1, n_heads=2, n_kv_heads=2, head_dim=16, mlp_dim=64,
                     remat=remat, scan_layers=True, loss_chunk_len=0)
    cfg.precision.policy = policy
    cfg = resolve_here(cfg)
    model = build_model(cfg.model, policy_from_config(cfg.precision, jax.devices()[0]))
    tokens = jnp.zeros((1, 8), jnp.int32)
    params = jax.eval_shape(model.init, jax.random.key(0), tokens)["params"]  # shapes suffice
    loss = lambda p: jnp.sum(model.apply({"params": p}, tokens).astype(jnp.float32))  # noqa: E731
    return str(jax.make_jaxpr(jax.grad(loss))(params)).count("dot_general[")


def test_remat_policies_recompute_the_same_matmuls_as_with_xlas_dots():
    """Remat sees each of these dots as one opaque custom-VJP call; the policies that keep matmul
    outputs keep them by name. So under every policy a bf16 model on the CPU recomputes exactly the
    matmuls that an fp32 one (XLA's dots) does: none for "save_dots", attention's two batched ones
    for "minimal", more for "full"."""
    counts = {policy: {remat: _dot_count(remat, policy) for remat in ("none", "save_dots", "minimal", "full")}
              for policy in ("fp32", "bf16")}
    assert counts["bf16"] == counts["fp32"], counts
    bf16 = counts["bf16"]
    assert bf16["save_dots"] == bf16["none"] == bf16["minimal"] - 2 < bf16["full"], counts
