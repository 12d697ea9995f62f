"""FP8 matmuls: quantize -> dot -> dequantize, in the pattern XLA's GEMM rewriter turns into an
fp8 GEMM on ROCm (hipBLASLt) and CUDA (cuBLASLt).

Activations and weights are quantized to e4m3, output gradients to e5m2; the dot itself and the
accumulation run in the compute dtype. Two formats:

- "ocp":  float8_e4m3fn (max 448) / float8_e5m2 (max 57344): gfx950 (MI350X/MI355X), Hopper,
          Blackwell, and the CPU (emulated);
- "fnuz": float8_e4m3fnuz (max 240) / float8_e5m2fnuz (max 57344), no -0 and no inf: gfx942
          (MI300X/MI325X), whose matrix cores have only these.

Two scalings, each a per-tensor scale s with x ~= s * q(x / s):

- "delayed": s comes from the largest |x| over the last `amax_history_len` steps, kept in the
  "fp8" variable collection (TransformerEngine's and Flax's recipe). The state is updated by
  this step's values; backward-pass statistics (output gradients) reach it as the *gradient* of
  the state variables, which the train step takes as the new state (never as a gradient step).
- "current": s comes from this step's |x| alone; no state.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import linen as nn

FP8_COLLECTION = "fp8"
SCALE_FLOOR = 2.0 ** -100  # scales never reach 0 (or, inverted, inf), whatever the amax

FORMATS = {
    "ocp": (jnp.float8_e4m3fn, jnp.float8_e5m2),
    "fnuz": (jnp.float8_e4m3fnuz, jnp.float8_e5m2fnuz),
}


def fp8_max(dtype) -> float:
    return float(jnp.finfo(dtype).max)


def quantize_dequantize(x, q_dtype, scale):
    """x rounded to the fp8 grid of `q_dtype` scaled by `scale`, saturating at the format's max.

    Clipping before the cast matters: an fp8 cast of an out-of-range value gives NaN (fnuz,
    e4m3fn) or inf (e5m2), not the max.
    """
    scale = scale.astype(x.dtype)
    bound = jnp.asarray(fp8_max(q_dtype), x.dtype)
    q = jnp.clip(x / scale, -bound, bound).astype(q_dtype)
    return q.astype(x.dtype) * scale


def scale_from_amax(amax, q_dtype, previous_scale):
    """The scale that maps `amax` to the format's max; the previous scale when amax is 0 or not
    finite (a zero tensor then quantizes to zero, and one bad step cannot poison the state)."""
    usable = (amax > 0) & jnp.isfinite(amax)
    scale = jnp.maximum(amax / fp8_max(q_dtype), SCALE_FLOOR)
    return jnp.where(usable, scale, previous_scale).astype(jnp.float32)


def amax(x):
    return jnp.max(jnp.abs(x)).astype(jnp.float32)


def delayed_update(x, q_dtype, scale, history):
    """(new scale from the history *before* this step, history with this step's amax in front)."""
    new_scale = scale_from_amax(jnp.max(history), q_dtype, scale)
    new_history = jnp.roll(history, -1).at[0].set(amax(x))
    return new_scale, new_history


# ------------------------------------------------------------------------------------------
# Delayed scaling: custom VJPs that hand the updated state back as the state's "gradient".


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def qdq_input(x, q_dtype, scale, history):
    new_scale, _ = delayed_update(x, q_dtype, scale, history)
    return quantize_dequantize(x, q_dtype, new_scale)


def _qdq_input_fwd(x, q_dtype, scale, history):
    new_scale, new_history = delayed_update(x, q_dtype, scale, history)
    return quantize_dequantize(x, q_dtype, new_scale), (new_scale, new_history)


def _qdq_input_bwd(q_dtype, updated, g):
    return (g, *updated)  # straight-through for x; the new state for (scale, history)


qdq_input.defvjp(_qdq_input_fwd, _qdq_input_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def qdq_output_grad(y, q_dtype, scale, history):
    return y


def _qdq_output_grad_fwd(y, q_dtype, scale, history):
    return y, (scale, history)


def _qdq_output_grad_bwd(q_dtype, state, g):
    new_scale, new_history = delayed_update(g, q_dtype, *state)
    return quantize_dequantize(g, q_dtype, new_scale), new_scale, new_history


qdq_output_grad.defvjp(_qdq_output_grad_fwd, _qdq_output_grad_bwd)


# ------------------------------------------------------------------------------------------
# Current scaling: the scale of this very tensor, no state.


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def qdq_current(x, q_dtype):
    return quantize_dequantize(x, q_dtype, scale_from_amax(amax(x), q_dtype, jnp.ones((), jnp.float32)))


# Straight-through: differentiating the fp8 cast itself would round the gradient to e4m3.
qdq_current.defvjp(lambda x, q_dtype: (qdq_current(x, q_dtype), None), lambda q_dtype, _, g: (g,))


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def qdq_output_grad_current(y, q_dtype):
    return y


qdq_output_grad_current.defvjp(lambda y, q_dtype: (y, None),
                               lambda q_dtype, _, g: (qdq_current(g, q_dtype),))


class Fp8DotGeneral(nn.Module):
    """Called like `lax.dot_general(x, kernel, dimension_numbers)`; x is the activation."""

    fmt: str = "ocp"
    scaling: str = "delayed"
    amax_history_len: int = 1024

    @nn.compact
    def __call__(self, x, kernel, dimension_numbers, precision=None, preferred_element_type=None):
        e4m3, e5m2 = FORMATS[self.fmt]
        if self.scaling == "current":
            y = jax.lax.dot_general(qdq_current(x, e4m3), qdq_current(kernel, e4m3), dimension_numbers,
                                    preferred_element_type=x.dtype)
            return qdq_output_grad_current(y, e5m2)

        def state(name):
            scale = self.variable(FP8_COLLECTION, f"{name}_scale", jnp.ones, (), jnp.float32)
            history = self.variable(FP8_COLLECTION, f"{name}_amax_history", jnp.zeros,
                                    (self.amax_history_len,), jnp.float32)
            return scale.value, history.value

        x = qdq_input(x, e4m3, *state("input"))
        kernel = qdq_input(kernel, e4m3, *state("kernel"))
        y = jax.lax.dot_general(x, kernel, dimension_numbers, preferred_element_type=x.dtype)
        return qdq_output_grad(y, e5m2, *state("output_grad"))


def _is_scale(path) -> bool:
    return path[-1].key.endswith("_scale")


def combine_updates(a, b):
    """Merges the state updates of two micro-batches of one step as one larger batch would have
    made them: the larger amax wins, and with it the smaller scale."""
    def merge(path, x, y):
        return jnp.minimum(x, y) if _is_scale(path) else jnp.maximum(x, y)
    return jax.tree_util.tree_map_with_path(merge, a, b)


def merge_identity(state):
    """The start of a `combine_updates` fold: +inf scales, -inf histories."""
    return jax.tree_util.tree_map_with_path(
        lambda path, x: jnp.full_like(x, jnp.inf if _is_scale(path) else -jnp.inf), state)


# gfx942 products: the generation of AMD Instinct whose matrix cores know only FNUZ fp8.
_FNUZ_KINDS = ("gfx942", "mi300", "mi325", "mi308")


def resolve_format(requested: str, device) -> str:
    """"auto" -> "fnuz" on gfx942-class AMD GPUs, else "ocp" (gfx950, NVIDIA, the CPU)."""
    if requested != "auto":
        return requested
    kind = f"{getattr(device, 'device_kind', '')} {getattr(device, 'compute_capability', '')}".lower()
    return "fnuz" if any(key in kind for key in _FNUZ_KINDS) else "ocp"
