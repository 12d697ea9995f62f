"""Precision policies: which dtype the parameters are kept in, which the math runs in, and
which dot_general the dense layers use.

Parameters always stay in fp32 (the optimizer's update is too small for bf16 to hold); the
policy decides the compute dtype. Dense layers take their dot from `Policy.dot_general_cls` so
that an fp8 quantize-dot-dequantize op slots in without touching the models, and otherwise from
`Policy.dot_general`: XLA's own with its result named for remat, except for bf16 on the CPU
(`f32_accumulating_dot_general`, named likewise).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from maxtext_rocm.numerics import fp8

Array = jax.Array


@dataclasses.dataclass(frozen=True)
class Policy:
    name: str
    compute_dtype: Any
    param_dtype: Any = jnp.float32
    # A Flax module class whose instances are called like lax.dot_general; None means
    # lax.dot_general itself.
    dot_general_cls: Callable[..., Any] | None = None
    fp8_format: str | None = None  # "ocp" or "fnuz" under the fp8 policy
    fp8_lm_head: bool = False  # whether the LM head's matmul goes to fp8 too
    # The dot of every matmul in compute_dtype that dot_general_cls does not take.
    dot_general: Callable[..., Any] = jax.lax.dot_general


_COMPUTE_DTYPES = {"fp32": jnp.float32, "bf16": jnp.bfloat16, "fp8": jnp.bfloat16}


def compute_dtype(policy_name: str):
    """The dtype the math runs in under precision.policy `policy_name`."""
    return _COMPUTE_DTYPES[policy_name]


def policy_from_config(precision_cfg, device=None, platform: str | None = None) -> Policy:
    """The policy named by `cfg.precision.policy` (validated by config.validate) for `device`
    (default: the first device). Under fp8, `precision.fp8_format` must be resolved already
    (maxtext_rocm/resolve.py): "auto" here is a programming error. `platform` names the platform the model will run on when that is not the device's (the AOT
    fit check compiles a GPU's step on the CPU)."""
    device = device or jax.devices()[0]
    name = precision_cfg.policy
    dtype = _COMPUTE_DTYPES[name]
    on_cpu = (platform or device.platform) == "cpu"
    dot = f32_accumulating_dot_general if dtype == jnp.bfloat16 and on_cpu else named_dot_general
    if name != "fp8":
        return Policy(name, dtype, dot_general=dot)
    fmt = precision_cfg.fp8_format
    if fmt == "auto":
        raise ValueError("precision.fp8_format='auto' reached the precision policy: the config was not resolved "
                         "(maxtext_rocm.resolve.resolve() was skipped)")
    op = functools.partial(fp8.Fp8DotGeneral, fmt=fmt, scaling=precision_cfg.fp8_scaling,
                           amax_history_len=precision_cfg.amax_history_len)
    return Policy(name, dtype, dot_general_cls=op, fp8_format=fmt, fp8_lm_head=precision_cfg.fp8_lm_head,
                  dot_general=dot)


def _subscripts(lhs_ndim: int, rhs_ndim: int, dimension_numbers) -> tuple[str, str, str]:
    """The einsum subscripts (lhs, rhs, result) of a dot_general with these dimension numbers."""
    (lhs_contract, rhs_contract), (lhs_batch, rhs_batch) = dimension_numbers
    letters = iter("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ")
    lhs = [next(letters) for _ in range(lhs_ndim)]
    rhs = [None] * rhs_ndim
    for i, j in zip((*lhs_contract, *lhs_batch), (*rhs_contract, *rhs_batch)):
        rhs[j] = lhs[i]
    rhs = [name or next(letters) for name in rhs]
    lhs_free = [lhs[i] for i in range(lhs_ndim) if i not in lhs_contract and i not in lhs_batch]
    rhs_free = [rhs[j] for j in range(rhs_ndim) if j not in rhs_contract and j not in rhs_batch]
    return "".join(lhs), "".join(rhs), "".join([lhs[i] for i in lhs_batch] + lhs_free + rhs_free)


def _einsum_f32(lhs_subscripts: str, rhs_subscripts: str, out_subscripts: str, lhs: Array, rhs: Array) -> Array:
    return jnp.einsum(f"{lhs_subscripts},{rhs_subscripts}->{out_subscripts}", lhs, rhs,
                      preferred_element_type=jnp.float32)


# Names of Policy.dot_general's results, for the remat policies that keep matmul outputs
# (models/llama.py): remat sees the CPU's bf16 custom VJP below as one opaque call, not a dot, and
# under a pipeline (parallel/pipeline/ vmaps the stages) every dot has the stage as a batch axis,
# so dots_with_no_batch_dims_saveable would keep none. The name is chosen from the model's own
# dimension numbers, which vmap does not change.
DOT_WITHOUT_BATCH_AXES = "f32_accumulated_dot"
DOT_WITH_BATCH_AXES = "f32_accumulated_batched_dot"


def named_dot_general(lhs: Array, rhs: Array, dimension_numbers, precision=None,
                      preferred_element_type=None) -> Array:
    """lax.dot_general, its result named by whether the model's dot has batch axes."""
    out = jax.lax.dot_general(lhs, rhs, dimension_numbers, precision, preferred_element_type)
    return checkpoint_name(out, DOT_WITH_BATCH_AXES if dimension_numbers[1][0] else DOT_WITHOUT_BATCH_AXES)


def f32_accumulating_dot_general(lhs: Array, rhs: Array, dimension_numbers, precision=None,
                                 preferred_element_type=None) -> Array:
    """lax.dot_general for bf16 on the CPU: each product, forward and backward (both transposes),
    is a bf16 x bf16 dot with an fp32 result, rounded to the operands' dtype after (or returned
    as `preferred_element_type`). XLA's CPU backend computes a dot with a bf16 result as an fp32
    dot over upcast copies of its operands, but one with an fp32 result natively (YNNPACK): the
    same single rounding at the end, several times faster (scripts/bench_dots.py;
    docs/figures.md#bf16-matmuls-on-the-cpu). JAX's own transposes
    would receive an fp32 cotangent from that rounding and take the slow path again, hence the
    custom VJP; an fp32 result's cotangent is rounded to bf16 for its transposes, as flash
    attention's kernels do. Other backends accumulate bf16 dots in fp32 anyway and keep
    lax.dot_general. Operands other than two bf16 ones (the router's fp32) go to lax.dot_general;
    `precision` is accepted for its signature and not used here."""
    if not lhs.dtype == rhs.dtype == jnp.bfloat16:
        return jax.lax.dot_general(lhs, rhs, dimension_numbers, precision, preferred_element_type)
    out = _f32_accumulating_dot(lhs, rhs, dimension_numbers, preferred_element_type)
    batched = bool(dimension_numbers[1][0])
    return checkpoint_name(out, DOT_WITH_BATCH_AXES if batched else DOT_WITHOUT_BATCH_AXES)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _f32_accumulating_dot(lhs: Array, rhs: Array, dimension_numbers, preferred_element_type) -> Array:
    out = _einsum_f32(*_subscripts(lhs.ndim, rhs.ndim, dimension_numbers), lhs, rhs)
    return out.astype(preferred_element_type or jnp.result_type(lhs, rhs))


def _f32_accumulating_forward(lhs, rhs, dimension_numbers, preferred_element_type):
    return _f32_accumulating_dot(lhs, rhs, dimension_numbers, preferred_element_type), (lhs, rhs)


def _f32_accumulating_backward(dimension_numbers, preferred_element_type, residuals, d_out):
    del preferred_element_type
    lhs, rhs = residuals
    lhs_subscripts, rhs_subscripts, out_subscripts = _subscripts(lhs.ndim, rhs.ndim, dimension_numbers)
    d_out = d_out.astype(lhs.dtype)
    d_lhs = _einsum_f32(out_subscripts, rhs_subscripts, lhs_subscripts, d_out, rhs).astype(lhs.dtype)
    d_rhs = _einsum_f32(lhs_subscripts, out_subscripts, rhs_subscripts, lhs, d_out).astype(rhs.dtype)
    return d_lhs, d_rhs


_f32_accumulating_dot.defvjp(_f32_accumulating_forward, _f32_accumulating_backward)


def without_fp8(policy: Policy) -> Policy:
    """The same dtypes with a plain dot: for matmuls kept out of fp8 (LM head, router)."""
    return dataclasses.replace(policy, dot_general_cls=None)
