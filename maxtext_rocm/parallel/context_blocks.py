"""Blockwise attention between two contiguous ranges of a sequence: the pieces that context
parallelism (context.py) assembles into ring and all-gather attention.

models/blockwise_attention.py attends a whole sequence to itself. Under `sequence` a device
holds one or two contiguous ranges (chunks) of each sequence and meets the keys of the other
ranges one at a time, so the pieces here take a query range starting at global token index
`q_start` and a key range starting at `k_start` (traced scalars: they depend on the device and
on the ring step). The mask is computed from those true indices (causal, the sliding window)
and from the segment ids (packed documents), which is exactly the 1-device mask. Block pairs
that the mask hides wholly are never computed: the loops' bounds come from the indices, so a
key range entirely after a query range costs nothing.

The forward keeps the online softmax's running (max, sum, unnormalised output) as a carry that
the caller threads through every key range, so no [seq, seq] scores exist and the ranges may
arrive in any order (a ring). The backward takes the final log-sum-exp and D = rowsum(dO * O),
as FlashAttention-2's does, and returns this pair's dq, dk, dv contributions.

Shapes: q [b, Tq, kv_heads, groups, d]; k, v [b, Tk, kv_heads, d]; segment ids [b, T] or None;
statistics [b, kv_heads, groups, Tq] fp32; the output accumulator [b, kv_heads, groups, Tq, d].
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from maxtext_rocm.numerics import varying
from maxtext_rocm.models.blockwise_attention import NEG

Array = jax.Array


def _slice(x, index, block, axis=1):
    return jax.lax.dynamic_slice_in_dim(x, index * block, block, axis=axis)


def _scores(q_i, k_j, qa, kb, q_seg, k_seg, window, scale):
    """(fp32 scores masked to NEG, the mask) of the query block starting at global index `qa`
    against the key block starting at `kb`; [b, kv_heads, groups, Bq, Bk]."""
    block_q, block_k = q_i.shape[1], k_j.shape[1]
    s = jnp.einsum("bqkgd,bskd->bkgqs", q_i, k_j, preferred_element_type=jnp.float32) * scale
    q_pos = qa + jnp.arange(block_q)
    k_pos = kb + jnp.arange(block_k)
    mask = k_pos[None, :] <= q_pos[:, None]
    if window:
        mask &= q_pos[:, None] - k_pos[None, :] < window
    mask = mask[None, None, None]
    if q_seg is not None:
        mask = mask & (q_seg[:, None, None, :, None] == k_seg[:, None, None, None, :])
    return jnp.where(mask, s, NEG), mask


def _key_blocks(qa, k_start, block, n_blocks, window):
    """[first, last) key blocks of the range at `k_start` that the query block at `qa` can see."""
    x = qa - k_start
    last = jnp.clip((x + block - 1) // block + 1, 0, n_blocks)
    first = jnp.clip((x - window + 1) // block, 0, last) if window else jnp.zeros_like(last)
    return first, last


def _query_blocks(kb, q_start, block, n_blocks, window):
    """[first, last) query blocks of the range at `q_start` that can see the key block at `kb`."""
    y = kb - q_start
    first = jnp.clip(y // block, 0, n_blocks)
    last = jnp.clip((y + block - 2 + window) // block + 1, first, n_blocks) if window else n_blocks + 0 * first
    return first, last


def initial_carry(q: Array, *operands: Array) -> tuple[Array, Array, Array]:
    """(running max, running sum, unnormalised output) before any key: fp32, typed as varying
    like q and the other `operands` (a loop carry must keep its type)."""
    batch, seq, kv_heads, groups, head_dim = q.shape
    stats = (batch, kv_heads, groups, seq)
    carry = (jnp.full(stats, NEG, jnp.float32), jnp.zeros(stats, jnp.float32),
             jnp.zeros((*stats, head_dim), jnp.float32))
    return tuple(varying.varying_like(x, q, *operands) for x in carry)


def forward(q, k, v, q_start, k_start, q_seg, k_seg, carry, block: int, window: int):
    """The carry after the keys k[:, :] (global indices k_start...) have been seen by the queries
    q (global indices q_start...)."""
    batch, seq_q, kv_heads, groups, head_dim = q.shape
    n_q, n_k = seq_q // block, k.shape[1] // block
    scale = head_dim ** -0.5

    def by_block(x, axis):  # [.., Tq, ..] -> [n_q, .., block, ..]
        x = x.reshape(*x.shape[:axis], n_q, block, *x.shape[axis + 1:])
        return jnp.moveaxis(x, axis, 0)

    def query_block(args):
        i, m, l, acc = args
        qa = q_start + i * block
        q_i = _slice(q, i, block)
        q_seg_i = None if q_seg is None else _slice(q_seg, i, block)

        def step(j, inner):
            m, l, acc = inner
            k_seg_j = None if k_seg is None else _slice(k_seg, j, block)
            s, mask = _scores(q_i, _slice(k, j, block), qa, k_start + j * block, q_seg_i, k_seg_j, window, scale)
            m_new = jnp.maximum(m, s.max(-1))
            # A row that has seen no key yet (m = NEG) would count every masked key once as
            # exp(NEG - NEG) = 1; the first real key's correction would wipe that again, but with
            # the where the carry is right after every block, whatever order the ranges arrive in.
            p = jnp.where(mask, jnp.exp(s - m_new[..., None]), 0.0)
            correction = jnp.exp(m - m_new)
            pv = jnp.einsum("bkgqs,bskd->bkgqd", p.astype(v.dtype), _slice(v, j, block),
                            preferred_element_type=jnp.float32)
            return m_new, l * correction + p.sum(-1), acc * correction[..., None] + pv

        return jax.lax.fori_loop(*_key_blocks(qa, k_start, block, n_k, window), step, (m, l, acc))

    m, l, acc = carry
    xs = (jnp.arange(n_q), by_block(m, 3), by_block(l, 3), by_block(acc, 3))
    m, l, acc = jax.lax.map(query_block, xs)

    def back(x):  # [n_q, b, k, g, block, ..] -> [b, k, g, Tq, ..]
        x = jnp.moveaxis(x, 0, 3)
        return x.reshape(*x.shape[:3], seq_q, *x.shape[5:])

    return back(m), back(l), back(acc)


def finish(carry, dtype) -> tuple[Array, Array]:
    """(output [b, Tq, kv_heads, groups, d] in `dtype`, log-sum-exp [b, kv_heads, groups, Tq])."""
    m, l, acc = carry
    out = acc / l[..., None]  # every query sees at least itself: l > 0
    return jnp.moveaxis(out, 3, 1).astype(dtype), m + jnp.log(l)


def backward(q, k, v, q_start, k_start, q_seg, k_seg, lse, delta, d_out, block: int, window: int):
    """(dq [b, Tq, kv_heads, groups, d], dk, dv [b, Tk, kv_heads, d]), fp32, of this pair of
    ranges. `lse`, `delta` [b, kv_heads, groups, Tq]: the queries' final statistics."""
    batch, seq_q, kv_heads, groups, head_dim = q.shape
    n_q, n_k = seq_q // block, k.shape[1] // block
    scale = head_dim ** -0.5

    def key_block(j, carry):
        dq, dk, dv = carry
        kb = k_start + j * block
        k_j, v_j = _slice(k, j, block), _slice(v, j, block)
        k_seg_j = None if k_seg is None else _slice(k_seg, j, block)

        def step(i, inner):
            dq, dk_j, dv_j = inner
            q_i, do_i = _slice(q, i, block), _slice(d_out, i, block)
            q_seg_i = None if q_seg is None else _slice(q_seg, i, block)
            s, mask = _scores(q_i, k_j, q_start + i * block, kb, q_seg_i, k_seg_j, window, scale)
            p = jnp.where(mask, jnp.exp(s - _slice(lse, i, block, axis=3)[..., None]), 0.0)
            dv_j += jnp.einsum("bkgqs,bqkgd->bskd", p.astype(do_i.dtype), do_i, preferred_element_type=jnp.float32)
            dp = jnp.einsum("bqkgd,bskd->bkgqs", do_i, v_j, preferred_element_type=jnp.float32)
            ds = (p * (dp - _slice(delta, i, block, axis=3)[..., None]) * scale).astype(q.dtype)
            dk_j += jnp.einsum("bkgqs,bqkgd->bskd", ds, q_i, preferred_element_type=jnp.float32)
            dq_i = _slice(dq, i, block) + jnp.einsum("bkgqs,bskd->bqkgd", ds, k_j, preferred_element_type=jnp.float32)
            return jax.lax.dynamic_update_slice_in_dim(dq, dq_i, i * block, axis=1), dk_j, dv_j

        zeros = varying.varying_like(jnp.zeros((batch, block, kv_heads, head_dim), jnp.float32), dk)
        dq, dk_j, dv_j = jax.lax.fori_loop(*_query_blocks(kb, q_start, block, n_q, window), step, (dq, zeros, zeros))
        dk = jax.lax.dynamic_update_slice_in_dim(dk, dk_j, j * block, axis=1)
        dv = jax.lax.dynamic_update_slice_in_dim(dv, dv_j, j * block, axis=1)
        return dq, dk, dv

    operands = (q, k, v, d_out, lse, delta, q_start, k_start)
    init = tuple(varying.varying_like(jnp.zeros(x.shape, jnp.float32), *operands) for x in (q, k, v))
    return jax.lax.fori_loop(0, n_k, key_block, init)
