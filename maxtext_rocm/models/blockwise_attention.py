"""Causal attention in blocks with an online softmax (FlashAttention's algorithm) in plain XLA ops.

The "xla" attention holds every [q_len, kv_len] score matrix, fp32, per head and layer: 64 heads x
8192 x 8192 for Llama 3 70B, which is what keeps 70B from fitting a GPU without a fused kernel.
This one walks key/value blocks with a running max and sum, keeps only the output and each row's
log-sum-exp for the backward pass, and recomputes the probabilities there block by block. It runs
on every backend (ROCm and the CPU included), so it is the memory-bounded choice where cuDNN's
fused attention is not available. Blocks above the causal diagonal (and, with a sliding window,
below it) are never computed. Attention sinks (gpt-oss: a logit per head that joins each row's
softmax and attends to nothing) start each row's running max and sum, and get their gradient from
the same log-sum-exp.

Shapes as in attention.py: q [batch, seq, heads, head_dim]; k, v [batch, seq, kv_heads, head_dim].
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

NEG = float(jnp.finfo(jnp.float32).min)  # a masked score; finite, so a masked row never makes NaN


def block_size(seq_len: int, preferred: int = 512) -> int:
    """The largest power of two <= `preferred` dividing seq_len (the whole sequence if none does)."""
    block = preferred
    while block > 1 and seq_len % block:
        block //= 2
    return block if block >= 16 else seq_len


def _kv_range(i, block, window):
    """[first, last) key blocks that query block i can see (causal, optionally windowed)."""
    last = i + 1  # query and key blocks have the same size: block i ends on the diagonal
    first = jnp.maximum(0, (i * block - window + 1) // block) if window else 0
    return first, last


def _q_range(j, n_blocks, block, window):
    """[first, last) query blocks that can see key block j."""
    last = jnp.minimum(n_blocks, ((j + 1) * block - 1 + window - 1) // block + 1) if window else n_blocks
    return j, last


def _block_scores(q_i, k_j, i, j, block, segments, window, scale):
    """fp32 scores [b, kv_heads, groups, Bq, Bk] of query block i against key block j, masked."""
    s = jnp.einsum("bqkgd,bskd->bkgqs", q_i, k_j, preferred_element_type=jnp.float32) * scale
    q_pos = i * block + jnp.arange(block)
    k_pos = j * block + jnp.arange(block)
    mask = k_pos[None, :] <= q_pos[:, None]
    if window:
        mask &= q_pos[:, None] - k_pos[None, :] < window
    mask = mask[None, None, None]
    if segments is not None:
        seg_q = jax.lax.dynamic_slice_in_dim(segments, i * block, block, axis=1)
        seg_k = jax.lax.dynamic_slice_in_dim(segments, j * block, block, axis=1)
        mask = mask & (seg_q[:, None, None, :, None] == seg_k[:, None, None, None, :])
    return jnp.where(mask, s, NEG)


def _slice(x, index, block):
    return jax.lax.dynamic_slice_in_dim(x, index * block, block, axis=1)


def _forward(q, k, v, segments, sinks, block, window):
    """(out [b, s, kv_heads, groups, d] in q's dtype, lse [b, kv_heads, groups, s] fp32). `sinks`
    [kv_heads, groups] fp32 or None."""
    batch, seq, kv_heads, groups, head_dim = q.shape
    n_blocks = seq // block
    scale = head_dim ** -0.5

    def query_block(i):
        q_i = _slice(q, i, block)

        def step(j, carry):
            m, l, acc = carry
            s = _block_scores(q_i, _slice(k, j, block), i, j, block, segments, window, scale)
            m_new = jnp.maximum(m, s.max(-1))
            p = jnp.exp(s - m_new[..., None])
            correction = jnp.exp(m - m_new)
            pv = jnp.einsum("bkgqs,bskd->bkgqd", p.astype(v.dtype), _slice(v, j, block),
                            preferred_element_type=jnp.float32)
            return m_new, l * correction + p.sum(-1), acc * correction[..., None] + pv

        stats = (batch, kv_heads, groups, block)
        if sinks is None:
            init = (jnp.full(stats, NEG, jnp.float32), jnp.zeros(stats, jnp.float32),
                    jnp.zeros((*stats, head_dim), jnp.float32))
        else:  # the sink as a score seen first: max = sink, sum = exp(0), nothing added to the output
            init = (jnp.broadcast_to(sinks[None, :, :, None], stats), jnp.ones(stats, jnp.float32),
                    jnp.zeros((*stats, head_dim), jnp.float32))
        m, l, acc = jax.lax.fori_loop(*_kv_range(i, block, window), step, init)
        out = (acc / l[..., None]).astype(q.dtype)  # every row sees at least itself: l > 0
        return jnp.moveaxis(out, 3, 1), m + jnp.log(l)  # [b, Bq, kv_heads, groups, d], [b, k, g, Bq]

    out, lse = jax.lax.map(query_block, jnp.arange(n_blocks))
    out = jnp.moveaxis(out, 0, 1).reshape(batch, seq, kv_heads, groups, head_dim)
    lse = jnp.moveaxis(lse, 0, 3).reshape(batch, kv_heads, groups, seq)
    return out, lse


def _backward(q, k, v, segments, out, lse, d_out, block, window):
    batch, seq, kv_heads, groups, head_dim = q.shape
    n_blocks = seq // block
    scale = head_dim ** -0.5
    # D_i = rowsum(dO * O): the softmax backward's correction term, [b, kv_heads, groups, s].
    delta = jnp.einsum("bqkgd,bqkgd->bkgq", d_out.astype(jnp.float32), out.astype(jnp.float32))

    def key_block(j, carry):
        dq, dk, dv = carry
        k_j, v_j = _slice(k, j, block), _slice(v, j, block)

        def step(i, inner):
            dq, dk_j, dv_j = inner
            q_i, do_i = _slice(q, i, block), _slice(d_out, i, block)
            s = _block_scores(q_i, k_j, i, j, block, segments, window, scale)
            p = jnp.exp(s - jax.lax.dynamic_slice_in_dim(lse, i * block, block, axis=3)[..., None])
            dv_j += jnp.einsum("bkgqs,bqkgd->bskd", p.astype(do_i.dtype), do_i, preferred_element_type=jnp.float32)
            dp = jnp.einsum("bqkgd,bskd->bkgqs", do_i, v_j, preferred_element_type=jnp.float32)
            ds = p * (dp - jax.lax.dynamic_slice_in_dim(delta, i * block, block, axis=3)[..., None]) * scale
            ds = ds.astype(q.dtype)
            dk_j += jnp.einsum("bkgqs,bqkgd->bskd", ds, q_i, preferred_element_type=jnp.float32)
            dq_i = _slice(dq, i, block) + jnp.einsum("bkgqs,bskd->bqkgd", ds, k_j, preferred_element_type=jnp.float32)
            return jax.lax.dynamic_update_slice_in_dim(dq, dq_i, i * block, axis=1), dk_j, dv_j

        zeros = jnp.zeros((batch, block, kv_heads, head_dim), jnp.float32)
        dq, dk_j, dv_j = jax.lax.fori_loop(*_q_range(j, n_blocks, block, window), step, (dq, zeros, zeros))
        dk = jax.lax.dynamic_update_slice_in_dim(dk, dk_j, j * block, axis=1)
        dv = jax.lax.dynamic_update_slice_in_dim(dv, dv_j, j * block, axis=1)
        return dq, dk, dv

    init = (jnp.zeros(q.shape, jnp.float32), jnp.zeros(k.shape, jnp.float32), jnp.zeros(v.shape, jnp.float32))
    dq, dk, dv = jax.lax.fori_loop(0, n_blocks, key_block, init)
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _attention(q, k, v, segments, block, window):
    return _forward(q, k, v, segments, None, block, window)[0]


def _attention_fwd(q, k, v, segments, block, window):
    out, lse = _forward(q, k, v, segments, None, block, window)
    return out, (q, k, v, segments, out, lse)


def _attention_bwd(block, window, residuals, d_out):
    q, k, v, segments, out, lse = residuals
    dq, dk, dv = _backward(q, k, v, segments, out, lse, d_out, block, window)
    return dq, dk, dv, None


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6))
def _attention_with_sinks(q, k, v, segments, sinks, block, window):
    return _forward(q, k, v, segments, sinks, block, window)[0]


def _sinks_fwd(q, k, v, segments, sinks, block, window):
    out, lse = _forward(q, k, v, segments, sinks, block, window)
    return out, (q, k, v, segments, sinks, out, lse)


def _sinks_bwd(block, window, residuals, d_out):
    """The keys' gradients as without sinks (the row's lse holds the sink; the sink's value is
    zero, so rowsum(dO * O) is still the softmax's correction term); the sink's own, a score with
    dP = 0: -sum over rows of P(sink) * rowsum(dO * O)."""
    q, k, v, segments, sinks, out, lse = residuals
    dq, dk, dv = _backward(q, k, v, segments, out, lse, d_out, block, window)
    delta = jnp.einsum("bqkgd,bqkgd->bkgq", d_out.astype(jnp.float32), out.astype(jnp.float32))
    d_sinks = -jnp.sum(jnp.exp(sinks[None, :, :, None] - lse) * delta, axis=(0, 3))
    return dq, dk, dv, None, d_sinks


_attention.defvjp(_attention_fwd, _attention_bwd)
_attention_with_sinks.defvjp(_sinks_fwd, _sinks_bwd)


def blockwise_attention(q, k, v, *, segment_ids=None, sliding_window: int | None = None,
                        block: int | None = None, sinks=None):
    """Causal (optionally windowed, optionally per-document) attention, O(seq x block) memory;
    `sinks` [heads]: each head's attention sink logit, or None."""
    batch, seq, heads, head_dim = q.shape
    kv_heads = k.shape[2]
    block = block or block_size(seq)
    if seq % block:
        raise ValueError(f"block {block} does not divide the sequence length {seq}")
    q = q.reshape(batch, seq, kv_heads, heads // kv_heads, head_dim)
    if sinks is None:
        out = _attention(q, k, v, segment_ids, block, sliding_window or 0)
    else:
        sinks = sinks.astype(jnp.float32).reshape(kv_heads, heads // kv_heads)
        out = _attention_with_sinks(q, k, v, segment_ids, sinks, block, sliding_window or 0)
    return out.reshape(batch, seq, heads, head_dim)
