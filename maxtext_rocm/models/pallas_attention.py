"""Causal flash attention as Pallas kernels (FlashAttention-2): one forward kernel, and a backward
pass of two kernels, one for dK/dV (a key block walks the query blocks that see it) and one for dQ
(a query block walks the key blocks it sees), so neither needs atomics or a [seq, seq] buffer.

On GPUs Pallas lowers the kernels to Triton (CUDA, and ROCm where jax routes Pallas to Triton); on
the CPU they run in Pallas' interpreter, which is slow but exact, so CI checks the very kernels a
GPU compiles. The choice is made when XLA lowers for its platform (`lax.platform_dependent`), not
from the default backend at trace time, so a CPU run in a GPU process still interprets.

Grouped-query attention never repeats K/V: the BlockSpec index maps pick query head h's key/value
head h // groups, and the dK/dV kernel sums over a kv head's query heads in its loop. Segment ids
(packed documents) and a sliding window mask inside the blocks; blocks that the causal diagonal or
the window excludes are skipped, and blocks they leave whole are computed without a mask. Softmax
statistics (running max and sum, log-sum-exp) stay fp32 whatever the inputs' dtype.

Over several devices the kernels split by batch and kv head, without communication
(pallas_sharding.py); the sequence and head_dim stay whole on each device.

Shapes as in attention.py: q [batch, seq, heads, head_dim]; k, v [batch, seq, kv_heads, head_dim],
heads ordered kv head major (head h uses kv head h // (heads // kv_heads)).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from maxtext_rocm.models.pallas_sharding import KV, Q, SEGMENTS, STATS, split_by_batch_and_heads

NEG = float(jnp.finfo(jnp.float32).min)  # a masked score: finite, so no inf - inf makes NaN
# The smallest block: Triton's dot wants every dimension >= 16. Sequences are padded to a multiple
# of it (exact under the causal mask: padded keys lie after every real query).
MIN_BLOCK = 16
HEAD_DIMS = (16, 32, 64, 128, 256)  # a block's width is head_dim, and Triton tiles are powers of two


def unsupported_head_dim(head_dim: int) -> str | None:
    """Why the kernels cannot serve `head_dim`, or None if they can."""
    if head_dim in HEAD_DIMS:
        return None
    return f"a power of two from {HEAD_DIMS[0]} to {HEAD_DIMS[-1]} (Triton tiles are powers of two)"


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """Preferred tile lengths in tokens; each is cut to the largest power of two dividing the
    (padded) sequence. forward_*: the forward kernel's query and key tiles; backward_*: the tiles
    of both backward kernels. Not tuned on a GPU yet (scripts/gpu_check.py measures them)."""

    forward_q: int = 128
    forward_k: int = 64
    backward_q: int = 64
    backward_k: int = 64


def _fit(preferred: int, seq: int) -> int:
    block = preferred
    while seq % block:
        block //= 2
    return block  # seq is a multiple of MIN_BLOCK, so this stops at MIN_BLOCK at the latest


@dataclasses.dataclass(frozen=True)
class _Plan:
    """Everything static about one call (hashable: custom_vjp's non-differentiable argument)."""

    block_q: int
    block_k: int
    bwd_q: int
    bwd_k: int
    window: int  # 0: no sliding window
    scale: float


def _warps(head_dim: int) -> int:
    return 4 if head_dim <= 64 else 8


# ----------------------------------------------------------------------------------------------
# Block ranges. Every bound is a non-negative integer, so lax.div (truncating) is floor division.

def _split(first, full_first, full_last, last):
    """[first, last) cut into a masked head, an unmasked middle (blocks that only
    [full_first, full_last) guarantees are whole) and a masked tail: (first, lo, hi, last)."""
    lo = jnp.maximum(first, jnp.minimum(full_first, last))
    hi = jnp.maximum(lo, jnp.minimum(full_last, last))
    return first, lo, hi, last


def _key_blocks(i, block_q, block_k, window, segmented):
    """Key blocks that query block i sees, split as `_split` does. With documents (`segmented`)
    no block is known to be whole, so all are masked."""
    q_first = i * block_q
    q_last = q_first + block_q - 1
    last = lax.div(q_last, block_k) + 1
    first, full_first = 0, 0
    if window:
        first = lax.div(jnp.maximum(0, q_first - window + 1), block_k)
        full_first = lax.div(jnp.maximum(0, q_last - window + 1) + block_k - 1, block_k)  # in the window
    full_last = lax.div(q_first + 1, block_k)  # key block j is wholly at or before every query
    return _split(first, last if segmented else full_first, full_last, last)


def _query_blocks(j, block_q, block_k, n_q, window, segmented):
    """Query blocks that see key block j, split as `_split` does (all masked when `segmented`)."""
    k_first = j * block_k
    k_last = k_first + block_k - 1
    first = lax.div(k_first, block_q)
    full_first = lax.div(k_last + block_q - 1, block_q)  # every query at or after every key
    last, full_last = n_q, n_q
    if window:
        last = jnp.minimum(n_q, lax.div(k_last + window - 1, block_q) + 1)
        full_last = lax.div(k_first + window, block_q)  # every query within the window of every key
    return _split(first, last if segmented else full_first, full_last, last)


def _loop(bounds, body, carry):
    """Runs body(masked, index, carry) over the unmasked middle, then over the masked head and
    tail as one loop (two loop bodies per kernel, not three: less for Triton and the interpreter
    to compile). The order of blocks does not matter to an online softmax or a sum."""
    first, lo, hi, last = bounds
    carry = lax.fori_loop(lo, hi, functools.partial(body, False), carry)
    head = lo - first

    def masked(t, carry):
        return body(True, jnp.where(t < head, first + t, hi + t - head), carry)

    return lax.fori_loop(0, head + last - hi, masked, carry)


# ----------------------------------------------------------------------------------------------
# In-kernel helpers: 2-D dots with fp32 accumulation (as Triton's tl.dot), and the mask.

def _dot(a, b):  # a @ b
    return lax.dot_general(a, b, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32)


def _dot_t(a, b):  # a @ b.T
    return lax.dot_general(a, b, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)


def _t_dot(a, b):  # a.T @ b
    return lax.dot_general(a, b, (((0,), (0,)), ((), ())), preferred_element_type=jnp.float32)


def _mask(q_pos, k_pos, window, seg_q, seg_k):
    """[len(q_pos), len(k_pos)]: causal, within the window, same document."""
    mask = k_pos[None, :] <= q_pos[:, None]
    if window:
        mask = mask & (q_pos[:, None] - k_pos[None, :] < window)
    if seg_q is not None:
        mask = mask & (seg_q[:, None] == seg_k[None, :])
    return mask


def _unpack(refs, n_inputs, segmented):
    """(inputs, (segments of the queries, of the keys) or (None, None), outputs) of a kernel whose
    segment-id refs, when present, follow its first three inputs."""
    refs = list(refs)
    segments = (None, None)
    if segmented:
        segments = (refs.pop(3), refs.pop(3))
    return refs[:n_inputs], segments, refs[n_inputs:]


# ----------------------------------------------------------------------------------------------
# The kernels. Grid axis 0 walks the blocks, so programs running together share one head's K/V.

def _forward_kernel(*refs, plan: _Plan, segmented: bool):
    (q_ref, k_ref, v_ref), (seg_q_ref, seg_k_ref), (o_ref, lse_ref) = _unpack(refs, 3, segmented)
    bq, bk = plan.block_q, plan.block_k
    i = pl.program_id(0)
    q = q_ref[...]
    q_pos = i * bq + jnp.arange(bq)
    seg_q = seg_q_ref[...] if segmented else None

    def step(masked, j, carry):
        m, l, acc = carry
        keys = pl.ds(j * bk, bk)
        s = _dot_t(q, k_ref[keys, :]) * plan.scale
        if masked:
            mask = _mask(q_pos, j * bk + jnp.arange(bk), plan.window, seg_q,
                         seg_k_ref[keys] if segmented else None)
            s = jnp.where(mask, s, NEG)
        m_new = jnp.maximum(m, s.max(axis=-1))
        p = jnp.exp(s - m_new[:, None])
        if masked:  # a row that has seen no key yet has m_new == NEG, where exp gives 1
            p = jnp.where(mask, p, 0.0)
        correction = jnp.exp(m - m_new)
        v = v_ref[keys, :]
        acc = acc * correction[:, None] + _dot(p.astype(v.dtype), v)
        return m_new, l * correction + p.sum(axis=-1), acc

    init = (jnp.full((bq,), NEG, jnp.float32), jnp.zeros((bq,), jnp.float32),
            jnp.zeros((bq, q.shape[-1]), jnp.float32))
    m, l, acc = _loop(_key_blocks(i, bq, bk, plan.window, segmented), step, init)
    o_ref[...] = (acc / l[:, None]).astype(o_ref.dtype)  # every row sees itself: l > 0
    lse_ref[...] = m + jnp.log(l)


def _dq_kernel(*refs, plan: _Plan, segmented: bool):
    (q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref), (seg_q_ref, seg_k_ref), (dq_ref,) = \
        _unpack(refs, 6, segmented)
    bq, bk = plan.bwd_q, plan.bwd_k
    i = pl.program_id(0)
    q, do = q_ref[...], do_ref[...]
    lse, delta = lse_ref[...], delta_ref[...]
    q_pos = i * bq + jnp.arange(bq)
    seg_q = seg_q_ref[...] if segmented else None

    def step(masked, j, dq):
        keys = pl.ds(j * bk, bk)
        k, v = k_ref[keys, :], v_ref[keys, :]
        s = _dot_t(q, k) * plan.scale
        if masked:
            mask = _mask(q_pos, j * bk + jnp.arange(bk), plan.window, seg_q,
                         seg_k_ref[keys] if segmented else None)
            s = jnp.where(mask, s, NEG)
        p = jnp.exp(s - lse[:, None])  # masked: exp(NEG - lse) == 0
        ds = p * (_dot_t(do, v) - delta[:, None]) * plan.scale
        return dq + _dot(ds.astype(k.dtype), k)

    dq = _loop(_key_blocks(i, bq, bk, plan.window, segmented), step, jnp.zeros(q.shape, jnp.float32))
    dq_ref[...] = dq.astype(dq_ref.dtype)


def _dkv_kernel(*refs, plan: _Plan, segmented: bool, groups: int, n_q: int):
    """dK, dV of one key block of one kv head: the sum over its `groups` query heads."""
    (q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref), (seg_q_ref, seg_k_ref), (dk_ref, dv_ref) = \
        _unpack(refs, 6, segmented)
    bq, bk = plan.bwd_q, plan.bwd_k
    j = pl.program_id(0)
    k, v = k_ref[...], v_ref[...]
    k_pos = j * bk + jnp.arange(bk)
    seg_k = seg_k_ref[...] if segmented else None
    bounds = _query_blocks(j, bq, bk, n_q, plan.window, segmented)

    def head(g, carry):
        def step(masked, i, carry):
            dk, dv = carry
            rows = pl.ds(i * bq, bq)
            q, do = q_ref[rows, g, :], do_ref[rows, g, :]
            s = _dot_t(q, k) * plan.scale
            if masked:
                mask = _mask(i * bq + jnp.arange(bq), k_pos, plan.window,
                             seg_q_ref[rows] if segmented else None, seg_k)
                s = jnp.where(mask, s, NEG)
            p = jnp.exp(s - lse_ref[g, rows][:, None])
            dv = dv + _t_dot(p.astype(do.dtype), do)
            ds = p * (_dot_t(do, v) - delta_ref[g, rows][:, None]) * plan.scale
            return dk + _t_dot(ds.astype(q.dtype), q), dv

        return _loop(bounds, step, carry)

    zeros = jnp.zeros(k.shape, jnp.float32)
    dk, dv = lax.fori_loop(0, groups, head, (zeros, zeros))
    dk_ref[...] = dk.astype(dk_ref.dtype)
    dv_ref[...] = dv.astype(dv_ref.dtype)


# ----------------------------------------------------------------------------------------------
# pallas_call wrappers. `interpret`: run in Pallas' interpreter (the CPU) instead of Triton.

def _query_row_inputs(q, k, v, segments, bq: int):
    """Block specs and arguments of a kernel whose grid runs over blocks of `bq` query rows (per
    batch row and head), each seeing its kv head's whole K and V (and both sides' segment ids):
    (the query rows' spec, the input specs, the arguments)."""
    _, seq, heads, head_dim = q.shape
    groups = heads // k.shape[2]
    row = pl.BlockSpec((None, bq, None, head_dim), lambda i, b, h: (b, i, h, 0))
    whole_kv = pl.BlockSpec((None, seq, None, head_dim), lambda i, b, h: (b, 0, h // groups, 0))
    in_specs, args = [row, whole_kv, whole_kv], [q, k, v]
    if segments is not None:
        in_specs += [pl.BlockSpec((None, bq), lambda i, b, h: (b, i)),
                     pl.BlockSpec((None, seq), lambda i, b, h: (b, 0))]
        args += [segments, segments]
    return row, in_specs, args


def _forward_call(q, k, v, segments, *, plan: _Plan, interpret: bool):
    batch, seq, heads, head_dim = q.shape
    bq = plan.block_q
    row, in_specs, args = _query_row_inputs(q, k, v, segments, bq)
    return pl.pallas_call(
        functools.partial(_forward_kernel, plan=plan, segmented=segments is not None),
        grid=(seq // bq, batch, heads),
        in_specs=in_specs,
        out_specs=[row, pl.BlockSpec((None, None, bq), lambda i, b, h: (b, h, i))],
        out_shape=[jax.ShapeDtypeStruct(q.shape, q.dtype),
                   jax.ShapeDtypeStruct((batch, heads, seq), jnp.float32)],
        compiler_params=plgpu.CompilerParams(num_warps=_warps(head_dim), num_stages=2),
        interpret=interpret, name="flash_attention_forward",
    )(*args)


def _dq_call(q, k, v, segments, d_out, lse, delta, *, plan: _Plan, interpret: bool):
    batch, seq, heads, head_dim = q.shape
    bq = plan.bwd_q
    row, in_specs, args = _query_row_inputs(q, k, v, segments, bq)
    stats = pl.BlockSpec((None, None, bq), lambda i, b, h: (b, h, i))
    return pl.pallas_call(
        functools.partial(_dq_kernel, plan=plan, segmented=segments is not None),
        grid=(seq // bq, batch, heads),
        in_specs=in_specs + [row, stats, stats],
        out_specs=row,
        out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        compiler_params=plgpu.CompilerParams(num_warps=_warps(head_dim), num_stages=2),
        interpret=interpret, name="flash_attention_dq",
    )(*args, d_out, lse, delta)


def _dkv_call(q, k, v, segments, d_out, lse, delta, *, plan: _Plan, interpret: bool):
    batch, seq, heads, head_dim = q.shape
    kv_heads = k.shape[2]
    groups = heads // kv_heads
    bk = plan.bwd_k
    # A kv head's query heads are adjacent (kv head major), so one block of `groups` heads holds them.
    group_rows = pl.BlockSpec((None, seq, groups, head_dim), lambda j, b, h: (b, 0, h, 0))
    kv_block = pl.BlockSpec((None, bk, None, head_dim), lambda j, b, h: (b, j, h, 0))
    group_stats = pl.BlockSpec((None, groups, seq), lambda j, b, h: (b, h, 0))
    in_specs, args = [group_rows, kv_block, kv_block], [q, k, v]
    if segments is not None:
        in_specs += [pl.BlockSpec((None, seq), lambda j, b, h: (b, 0)),
                     pl.BlockSpec((None, bk), lambda j, b, h: (b, j))]
        args += [segments, segments]
    kernel = functools.partial(_dkv_kernel, plan=plan, segmented=segments is not None,
                               groups=groups, n_q=seq // plan.bwd_q)
    return pl.pallas_call(
        kernel,
        grid=(seq // bk, batch, kv_heads),
        in_specs=in_specs + [group_rows, group_stats, group_stats],
        out_specs=[kv_block, kv_block],
        out_shape=[jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)],
        compiler_params=plgpu.CompilerParams(num_warps=_warps(head_dim), num_stages=2),
        interpret=interpret, name="flash_attention_dkv",
    )(*args, d_out, lse, delta)


def _run(call, q, k, v, segments, *rest, plan: _Plan, results: tuple[str, ...]):
    """call(q, k, v, segments, *rest) split over devices by batch and kv head (pallas_sharding.py);
    on each, interpreted on the CPU and compiled through Triton on any other platform (XLA lowers
    only the branch of the platform it compiles for). `rest`: d_out, lse, delta (backward)."""
    segmented = segments is not None

    def kernel(*arrays):
        q, k, v = arrays[:3]
        segments = arrays[3] if segmented else None
        args = (q, k, v, segments, *arrays[3 + segmented:])
        return lax.platform_dependent(*args, cpu=functools.partial(call, plan=plan, interpret=True),
                                      default=functools.partial(call, plan=plan, interpret=False))

    operands = (Q, KV, KV) + ((SEGMENTS,) if segmented else ()) + (Q, STATS, STATS)[:len(rest)]
    split = split_by_batch_and_heads(kernel, operands, results, groups=q.shape[2] // k.shape[2])
    return split(q, k, v, *([segments] if segmented else []), *rest)


# ----------------------------------------------------------------------------------------------
# The differentiable op.

@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _attention(q, k, v, segments, plan):
    return _run(_forward_call, q, k, v, segments, plan=plan, results=(Q, STATS))[0]


def _attention_fwd(q, k, v, segments, plan):
    out, lse = _run(_forward_call, q, k, v, segments, plan=plan, results=(Q, STATS))
    return out, (q, k, v, segments, out, lse)


def _attention_bwd(plan, residuals, d_out):
    q, k, v, segments, out, lse = residuals
    d_out = d_out.astype(q.dtype)
    # D_i = rowsum(dO * O), the softmax backward's correction term: [batch, heads, seq], fp32.
    # An elementwise product and a sum, which XLA fuses; no kernel of its own needed.
    delta = jnp.einsum("bshd,bshd->bhs", d_out.astype(jnp.float32), out.astype(jnp.float32))
    dq = _run(_dq_call, q, k, v, segments, d_out, lse, delta, plan=plan, results=(Q,))
    dk, dv = _run(_dkv_call, q, k, v, segments, d_out, lse, delta, plan=plan, results=(KV, KV))
    return dq, dk, dv, None


_attention.defvjp(_attention_fwd, _attention_bwd)


def pallas_attention(q, k, v, *, segment_ids=None, sliding_window: int | None = None,
                     blocks: BlockSizes | None = None):
    """Causal (optionally windowed, optionally per-document) attention through the Pallas kernels.

    Any sequence length: it is padded to a multiple of MIN_BLOCK (padded keys come after every
    real query, so the causal mask hides them; padded queries' rows are dropped)."""
    batch, seq, heads, head_dim = q.shape
    if heads % k.shape[2]:
        raise ValueError(f"{heads} query heads do not share {k.shape[2]} kv heads evenly")
    if reason := unsupported_head_dim(head_dim):
        raise ValueError(f"the Pallas attention needs head_dim {reason}, got {head_dim}")
    pad = -seq % MIN_BLOCK
    if pad:
        q, k, v = (jnp.pad(x, ((0, 0), (0, pad), (0, 0), (0, 0))) for x in (q, k, v))
        if segment_ids is not None:
            segment_ids = jnp.pad(segment_ids, ((0, 0), (0, pad)), constant_values=-1)
    padded = seq + pad
    blocks = blocks or BlockSizes()
    plan = _Plan(block_q=_fit(blocks.forward_q, padded), block_k=_fit(blocks.forward_k, padded),
                 bwd_q=_fit(blocks.backward_q, padded), bwd_k=_fit(blocks.backward_k, padded),
                 window=sliding_window or 0, scale=head_dim ** -0.5)
    segments = None if segment_ids is None else segment_ids.astype(jnp.int32)
    out = _attention(q, k, v, segments, plan)
    return out[:, :seq] if pad else out
