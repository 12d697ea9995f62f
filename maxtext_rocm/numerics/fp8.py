"""FP8 matmuls: activations and weights quantized to e4m3, output gradients to e5m2, and each
GEMM fed the fp8 arrays themselves (an fp8 GEMM on ROCm's hipBLASLt, CUDA's cuBLASLt or Triton;
emulated on the CPU), its output in the compute dtype and rescaled after it. Two formats:

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


def quantize(x, q_dtype, scale):
    """x / scale on the fp8 grid of `q_dtype`, saturating at the format's max. The division runs
    in fp32 whatever x's dtype: a bf16 quotient (and a bf16-rounded scale) rounds twice, which
    gave a bf16 GEMM's output 2.6% relative error against fp32 dots of exactly quantized
    operands; quantizing in fp32 gave 0.17%."""
    bound = fp8_max(q_dtype)
    return jnp.clip(x.astype(jnp.float32) / scale.astype(jnp.float32), -bound, bound).astype(q_dtype)


def _scaled(y, scale):
    """A GEMM's output times its operands' scales, multiplied in fp32 (a bf16 scale is off by up
    to 0.4%), in y's dtype."""
    return (y.astype(jnp.float32) * scale.astype(jnp.float32)).astype(y.dtype)


def quantize_dequantize(x, q_dtype, scale):
    """x rounded to the fp8 grid of `q_dtype` scaled by `scale`, saturating at the format's max:
    what an fp8 GEMM sees of x (the tests' reference).

    Clipping before the cast matters: an fp8 cast of an out-of-range value gives NaN (fnuz,
    e4m3fn) or inf (e5m2), not the max.
    """
    return _scaled(quantize(x, q_dtype, scale).astype(x.dtype), scale)


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
# The fp8 dot: both operands cast to fp8 and handed to dot_general as fp8 arrays, so every backend
# runs an fp8 GEMM (cuBLASLt, hipBLASLt, Triton) rather than depending on XLA to recognise a
# quantize-dequantize pattern around a bf16 dot, which XLA did not always recognise
# (docs/figures.md#the-quantize-dequantize-fp8-pattern-on-a-gpu).


def _kept_axes(ndim, *removed):
    removed = {axis for axes in removed for axis in axes}
    return [axis for axis in range(ndim) if axis not in removed]


def transpose_dot_lhs(g, lhs_ndim, rhs, dimension_numbers, out_dtype, out_is_rhs_first=False):
    """The gradient of `dot_general(lhs, rhs, dimension_numbers)` w.r.t. lhs, given the output's
    cotangent g: g contracted with rhs over rhs's free axes, then laid out like lhs. The output's
    axes are [batch, lhs free, rhs free], or [batch, rhs free, lhs free] with `out_is_rhs_first`
    (how transpose_dot_rhs reuses this with the operands swapped)."""
    (lhs_contract, rhs_contract), (lhs_batch, rhs_batch) = dimension_numbers
    lhs_free = _kept_axes(lhs_ndim, lhs_contract, lhs_batch)
    rhs_free = _kept_axes(rhs.ndim, rhs_contract, rhs_batch)
    n_batch = len(lhs_batch)
    first_rhs_free = n_batch if out_is_rhs_first else n_batch + len(lhs_free)
    g_rhs_free = list(range(first_rhs_free, first_rhs_free + len(rhs_free)))
    grad = jax.lax.dot_general(g, rhs, ((g_rhs_free, rhs_free), (list(range(n_batch)), list(rhs_batch))),
                               preferred_element_type=out_dtype)
    # grad's axes: [batch, lhs free, rhs's contracting axes in rhs's order]; back to lhs's order.
    source = {axis: i for i, axis in enumerate(lhs_batch)}
    source.update({axis: n_batch + i for i, axis in enumerate(lhs_free)})
    rhs_order = sorted(rhs_contract)
    source.update({l: n_batch + len(lhs_free) + rhs_order.index(r) for l, r in zip(lhs_contract, rhs_contract)})
    return jax.lax.transpose(grad, [source[axis] for axis in range(lhs_ndim)])


def transpose_dot_rhs(g, lhs, rhs_ndim, dimension_numbers, out_dtype):
    """The gradient of `dot_general(lhs, rhs, dimension_numbers)` w.r.t. rhs (see transpose_dot_lhs)."""
    (lhs_contract, rhs_contract), (lhs_batch, rhs_batch) = dimension_numbers
    swapped = ((rhs_contract, lhs_contract), (rhs_batch, lhs_batch))
    return transpose_dot_lhs(g, rhs_ndim, lhs, swapped, out_dtype, out_is_rhs_first=True)


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7, 8))
def fp8_dot(x, w, x_scale, w_scale, grad_scale, grad_history, dimension_numbers, fmt, delayed):
    """dot_general(x, w) through fp8: x and w (of one dtype, the output's) quantized to e4m3 with
    their scales, the output's gradient to e5m2 in the backward pass, each GEMM's output rescaled
    after it. With `delayed` the gradient's scale comes from `grad_history`, and the updated
    (scale, history) are returned as their cotangents; otherwise from the gradient itself."""
    return _fp8_dot_fwd(x, w, x_scale, w_scale, grad_scale, grad_history, dimension_numbers, fmt, delayed)[0]


def _fp8_dot_fwd(x, w, x_scale, w_scale, grad_scale, grad_history, dimension_numbers, fmt, delayed):
    e4m3, _ = FORMATS[fmt]
    q_x, q_w = quantize(x, e4m3, x_scale), quantize(w, e4m3, w_scale)
    y = jax.lax.dot_general(q_x, q_w, dimension_numbers, preferred_element_type=x.dtype)
    # The residuals are the fp8 operands: half the memory that bf16 copies would hold.
    return _scaled(y, x_scale * w_scale), (q_x, q_w, x_scale, w_scale, grad_scale, grad_history)


def _fp8_dot_bwd(dimension_numbers, fmt, delayed, residuals, g):
    q_x, q_w, x_scale, w_scale, grad_scale, grad_history = residuals
    _, e5m2 = FORMATS[fmt]
    if delayed:
        new_scale, new_history = delayed_update(g, e5m2, grad_scale, grad_history)
    else:
        new_scale, new_history = scale_from_amax(amax(g), e5m2, grad_scale), jnp.zeros_like(grad_history)
    q_g = quantize(g, e5m2, new_scale)
    dx = transpose_dot_lhs(q_g, q_x.ndim, q_w, dimension_numbers, g.dtype)
    dw = transpose_dot_rhs(q_g, q_x, q_w.ndim, dimension_numbers, g.dtype)
    return (_scaled(dx, new_scale * w_scale), _scaled(dw, new_scale * x_scale),
            jnp.zeros_like(x_scale), jnp.zeros_like(w_scale), new_scale, new_history)


fp8_dot.defvjp(_fp8_dot_fwd, _fp8_dot_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def delayed_scale(x, q_dtype, scale, history):
    """The scale for x from the amax history *before* this step; the backward pass hands the
    updated (scale, history) back as their cotangents and nothing to x (fp8_dot carries x's)."""
    return delayed_update(x, q_dtype, scale, history)[0]


def _delayed_scale_fwd(x, q_dtype, scale, history):
    new_scale, new_history = delayed_update(x, q_dtype, scale, history)
    return new_scale, (new_scale, new_history)


def _delayed_scale_bwd(q_dtype, updated, _):
    return (None, *updated)


delayed_scale.defvjp(_delayed_scale_fwd, _delayed_scale_bwd)


def current_scale(x, q_dtype):
    """The scale that maps this tensor's own amax to the format's max (no gradient flows through)."""
    return jax.lax.stop_gradient(scale_from_amax(amax(x), q_dtype, jnp.ones((), jnp.float32)))


class Fp8DotGeneral(nn.Module):
    """Called like `lax.dot_general(x, kernel, dimension_numbers)`; x is the activation."""

    fmt: str = "ocp"
    scaling: str = "delayed"
    amax_history_len: int = 1024

    @nn.compact
    def __call__(self, x, kernel, dimension_numbers, precision=None, preferred_element_type=None):
        e4m3 = FORMATS[self.fmt][0]
        kernel = kernel.astype(x.dtype)  # fp8_dot's gradients come out in the output's dtype
        if self.scaling == "current":
            no_state = jnp.ones((), jnp.float32), jnp.zeros((1,), jnp.float32)
            return fp8_dot(x, kernel, current_scale(x, e4m3), current_scale(kernel, e4m3), *no_state,
                           dimension_numbers, self.fmt, False)

        def state(name):
            scale = self.variable(FP8_COLLECTION, f"{name}_scale", jnp.ones, (), jnp.float32)
            history = self.variable(FP8_COLLECTION, f"{name}_amax_history", jnp.zeros,
                                    (self.amax_history_len,), jnp.float32)
            return scale.value, history.value

        x_scale = delayed_scale(x, e4m3, *state("input"))
        w_scale = delayed_scale(kernel, e4m3, *state("kernel"))
        return fp8_dot(x, kernel, x_scale, w_scale, *state("output_grad"), dimension_numbers, self.fmt, True)


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
    return format_for(requested, is_fnuz_device(device))


def is_fnuz_device(device) -> bool:
    """Whether `device`'s matrix cores know only the FNUZ formats (gfx942-class AMD GPUs)."""
    kind = f"{getattr(device, 'device_kind', '')} {getattr(device, 'compute_capability', '')}".lower()
    return any(key in kind for key in _FNUZ_KINDS)


def format_for(requested: str, fnuz: bool) -> str:
    """precision.fp8_format with "auto" decided: "fnuz" where the target knows only FNUZ, else "ocp"."""
    if requested != "auto":
        return requested
    return "fnuz" if fnuz else "ocp"
