"""The CPU's grouped GEMM for the dropless experts, and the row gathers that sort rows by expert.

On the CPU `jax.lax.ragged_dot` becomes a masked dense dot over every expert, so there each
expert's rows are padded to whole blocks of one expert (`blocked_groups`) and a loop runs each
block through its expert's weights (`blocked_swiglu`, with its own backward loop). `take_rows`
is the gather both layouts use, with a gather, not a scatter-add, as its gradient.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp

from maxtext_rocm.models.activations import gated, gated_grads
from maxtext_rocm.numerics import varying

Array = jax.Array


@jax.custom_vjp
def take_rows(x: Array, index: Array, sources: Array) -> Array:
    """x[index] over rows (an index out of range gives a row of zeros) where the inverse is known:
    `sources[r]` lists the rows of the result that row r of x went to, out of range for none.
    The gradient is then the same kind of gather the other way round, each row's cotangents
    summed in fp32. JAX's own transpose of a gather is a scatter-add, whose accumulation order a
    GPU leaves to atomics: not reproducible from run to run."""
    return jnp.take(x, index, axis=0, mode="fill", fill_value=0)


def _take_rows_fwd(x, index, sources):
    return take_rows(x, index, sources), sources


def _take_rows_bwd(sources, d_out):
    d_x = jnp.take(d_out, sources.reshape(-1), axis=0, mode="fill", fill_value=0)
    d_x = d_x.reshape(*sources.shape, *d_out.shape[1:])
    if sources.shape[1] > 1:
        d_x = jnp.sum(d_x, axis=1, dtype=jnp.float32).astype(d_out.dtype)
    else:
        d_x = d_x[:, 0]
    return d_x, None, None


take_rows.defvjp(_take_rows_fwd, _take_rows_bwd)


@dataclasses.dataclass(frozen=True)
class _BlockedGroups:
    """Expert-sorted rows laid out so that each `block` rows belong to one expert."""

    dest: Array  # [rows]: each sorted row's place in the padded layout
    source: Array  # [n_padded]: the sorted row at each place, out of range (n rows) for padding
    block_expert: Array  # [padded rows / block]: the expert of each block
    n_used: Array  # how many leading blocks hold rows (the rest is the static bound's slack)

    def pad(self, rows: Array) -> Array:
        return take_rows(rows, self.source, self.dest[:, None])

    def unpad(self, padded: Array) -> Array:
        return take_rows(padded, self.dest, self.source[:, None])


def blocked_groups(group_sizes: Array, n_rows: int, block: int, row_expert: Array | None = None) -> _BlockedGroups:
    """The padded layout of `n_rows` expert-sorted rows with these group sizes: at most block - 1
    rows of padding per expert. Rows past sum(group_sizes) (an exchange buffer's slack) get no
    place: they are dropped by `pad` and come back as zeros from `unpad`."""
    n_experts = group_sizes.shape[0]
    padded_sizes = (group_sizes + block - 1) // block * block
    padded_ends, ends = jnp.cumsum(padded_sizes), jnp.cumsum(group_sizes)
    padded_starts, starts = padded_ends - padded_sizes, ends - group_sizes
    n_padded = -(-n_rows // block) * block + n_experts * block  # a static bound on sum(padded_sizes)
    row = jnp.arange(n_rows)
    if row_expert is None:
        row_expert = jnp.minimum(jnp.searchsorted(ends, row, side="right", method="compare_all"), n_experts - 1)
    dest = jnp.where(row < ends[-1], padded_starts[row_expert] + row - starts[row_expert], n_padded)
    # A few dozen blocks against a handful of experts: comparing all pairs is one small kernel,
    # where the default binary search is a loop.
    block_expert = jnp.minimum(jnp.searchsorted(padded_ends, jnp.arange(0, n_padded, block), side="right",
                                                method="compare_all"), n_experts - 1)
    # Each place's row, computed from the layout rather than scattered from `dest`: a place holds
    # the rank-th row of its block's expert if that expert has that many rows (past the last
    # expert's blocks the clamped expert has none that far).
    place_expert = jnp.repeat(block_expert, block)
    rank = jnp.arange(n_padded) - padded_starts[place_expert]
    source = jnp.where(rank < group_sizes[place_expert], starts[place_expert] + rank, n_rows)
    return _BlockedGroups(dest, source, block_expert, padded_ends[-1] // block)


def _row_block(a: Array, i: Array, block: int) -> Array:
    return jax.lax.dynamic_slice_in_dim(a, i * block, block)


def _dot_f32(a: Array, b: Array) -> Array:
    """a @ b accumulated and returned in fp32. The blocked loop runs on the CPU only, whose bf16
    dots are fast only with an fp32 result (see precision.f32_accumulating_dot_general)."""
    return jnp.dot(a, b, preferred_element_type=jnp.float32)


def _add_at(acc: Array, e: Array, delta: Array) -> Array:
    """acc[e] += delta, written as an in-place update of the loop's accumulator."""
    current = jax.lax.dynamic_index_in_dim(acc, e, keepdims=False)
    return jax.lax.dynamic_update_index_in_dim(acc, current + delta, e, 0)


def _projected(rows: Array, weight: Array, bias: Array | None, e: Array) -> Array:
    """rows @ weight[e] in fp32, plus bias[e] where the experts have biases (gpt-oss)."""
    out = _dot_f32(rows, weight[e])
    return out if bias is None else out + bias[e].astype(jnp.float32)


@functools.partial(jax.custom_vjp, nondiff_argnums=(8, 9))
def blocked_swiglu(padded: Array, block_expert: Array, n_used: Array, gate: Array, up: Array,
                   down: Array, gate_bias: Array | None, up_bias: Array | None, block: int,
                   activation: str = "silu") -> Array:
    """Gated experts (SwiGLU, or model.mlp_activation's `activation`) over rows laid out in blocks
    of one expert each: [n_padded, d] -> [n_padded, d]. `gate_bias`, `up_bias` [E, f]: the
    projections' biases (gpt-oss), or None.

    A loop over the `n_used` blocks in use, each block through its own expert's weights indexed in
    place: neither a copy of the weights per block nor the blocks of padding that the static bound
    allows are ever made. The backward pass (below) loops the same way, adding each block's weight
    gradients into its expert's fp32 accumulator.
    """

    def body(i, out):
        e, rows = block_expert[i], _row_block(padded, i, block)
        hidden = gated(activation, _projected(rows, gate, gate_bias, e), _projected(rows, up, up_bias, e))
        hidden = hidden.astype(rows.dtype)
        return jax.lax.dynamic_update_slice_in_dim(out, _dot_f32(hidden, down[e]).astype(out.dtype), i * block, 0)

    return jax.lax.fori_loop(0, n_used, body, varying.varying_like(jnp.zeros_like(padded), padded, gate, up, down))


def _blocked_swiglu_fwd(padded, block_expert, n_used, gate, up, down, gate_bias, up_bias, block, activation):
    out = blocked_swiglu(padded, block_expert, n_used, gate, up, down, gate_bias, up_bias, block, activation)
    return out, (padded, block_expert, n_used, gate, up, down, gate_bias, up_bias)


def _blocked_swiglu_bwd(block, activation, residuals, d_out):
    padded, block_expert, n_used, gate, up, down, gate_bias, up_bias = residuals
    f32 = jnp.float32
    biased = gate_bias is not None

    def body(i, carry):
        d_rows, d_gate, d_up, d_down, d_biases = carry
        e, rows, dy = block_expert[i], _row_block(padded, i, block), _row_block(d_out, i, block)
        g, u = _projected(rows, gate, gate_bias, e), _projected(rows, up, up_bias, e)  # recomputed, not stored
        d_down = _add_at(d_down, e, _dot_f32(gated(activation, g, u).astype(dy.dtype).T, dy))
        dh = _dot_f32(dy, down[e].T)
        dg, du = (grad.astype(rows.dtype) for grad in gated_grads(activation, g, u, dh))
        d_gate = _add_at(d_gate, e, _dot_f32(rows.T, dg))
        d_up = _add_at(d_up, e, _dot_f32(rows.T, du))
        if biased:  # a padding row's cotangent is zero, so summing the whole block is exact
            d_biases = (_add_at(d_biases[0], e, jnp.sum(dg, axis=0, dtype=f32)),
                        _add_at(d_biases[1], e, jnp.sum(du, axis=0, dtype=f32)))
        dx = (_dot_f32(dg, gate[e].T) + _dot_f32(du, up[e].T)).astype(d_rows.dtype)
        return jax.lax.dynamic_update_slice_in_dim(d_rows, dx, i * block, 0), d_gate, d_up, d_down, d_biases

    zeros = tuple(varying.varying_like(z, padded, d_out, gate, up, down) for z in
                  (jnp.zeros_like(padded), *(jnp.zeros(w.shape, f32) for w in (gate, up, down))))
    bias_zeros = tuple(varying.varying_like(jnp.zeros(b.shape, f32), padded, d_out, gate, up, down, b)
                       for b in (gate_bias, up_bias)) if biased else ()
    d_rows, d_gate, d_up, d_down, d_biases = jax.lax.fori_loop(0, n_used, body, (*zeros, bias_zeros))
    d_gate_bias, d_up_bias = ((varying.summed_like(d.astype(b.dtype), b) for d, b in zip(d_biases, (gate_bias, up_bias)))
                              if biased else (None, None))
    return (varying.summed_like(d_rows, padded), None, None, varying.summed_like(d_gate.astype(gate.dtype), gate),
            varying.summed_like(d_up.astype(up.dtype), up), varying.summed_like(d_down.astype(down.dtype), down),
            d_gate_bias, d_up_bias)


blocked_swiglu.defvjp(_blocked_swiglu_fwd, _blocked_swiglu_bwd)


def dropless_block(n_rows: int, n_experts: int, backend: str | None = None) -> int:
    """The CPU's block size for dropless_experts (0 elsewhere: ragged_dot): a power of two near half
    an even share of the rows, 8 to 128, so padding stays small against the rows themselves."""
    if (backend or jax.default_backend()) != "cpu":
        return 0
    share = max(1, n_rows // (2 * n_experts))
    return int(min(128, max(8, 2 ** int(math.log2(share)))))
