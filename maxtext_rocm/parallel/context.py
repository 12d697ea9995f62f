"""Context parallelism: attention over a batch whose sequences are split over the `sequence` axis.

Under `mesh.*.sequence = S` every device holds 1/S of each sequence's tokens; everything but
attention is token-wise, so only attention must see the other devices' keys. GSPMD left that to
its propagation (whole-sequence scores, no causal balance). Here the layer runs under `shard_map`
over the whole mesh, each device on its own queries, in one of two ways (`model.context_parallel`):

- "all_gather": each layer all-gathers K, V (and their segment ids) over `sequence` once, then
  attends its queries to the whole sequence blockwise; the gradient's transpose of that gather is
  one reduce-scatter of dK, dV. Bytes leaving a device: (S-1)/S of one layer's K/V.
- "ring": K/V blocks travel around `sequence` with `ppermute` (S-1 hops), each device folding
  each arriving block into an online softmax (context_blocks.py), so no device ever holds more
  than its own and one arriving block of K/V. The forward moves the all-gather's bytes. The
  backward cannot: it has not kept the blocks that passed (keeping them is the all-gather), so
  K/V go round again (S-1 hops) beside the dK/dV partial sums (S-1 hops, in K/V's dtype, like
  the all-gather's reduce-scatter): one layer's backward sends 2 blocks per hop where the
  all-gather's sends 1. Under remat the forward's ring runs twice, so a step moves 4 blocks per
  hop against the all-gather's 3 (comm_minimum.py holds each to its own). The permute of the
  next block does not wait for the current block's computation, so it can run under it.
- "auto": "all_gather". Llama 3's GQA K/V are small (8 KV heads against 64 query heads for 70B),
  so the gathered copy of one layer is transient and cheap (Llama 3.1 8B at 131,072 tokens:
  512 MiB in bf16), and one all-gather is the collective GPU compilers overlap best; it is
  MaxText's default too. Ring is the choice when a layer's whole K/V would not fit beside the
  activations (multi-head attention at very long context), which no preset here reaches.

Both are exact, with the 1-device mask built from each token's true index in the sequence and its
segment id (context_blocks.py), forward and backward (custom VJPs; tests/test_context_parallel.py).

Causal load balance (`model.context_load_balance`, on by default): under a causal mask the shard
holding the end of a sequence does S times the work of the first. With it each sequence is cut
into 2S chunks and shard i holds chunks i and 2S-1-i, one from each end, so every shard sees the
same number of query-key pairs (`attention_pairs` counts them). The permutation is applied to the
batch on the host (`Layout.apply`: tokens, targets, weights, positions, segment ids) before it is
placed on the devices; the loss is a sum over tokens, so it does not change, and RoPE reads the
positions that travel with the tokens. The model never sees the layout; only this attention does,
to know which true indices its chunks hold.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, PartitionSpec

from maxtext_rocm.numerics import varying
from maxtext_rocm.parallel import sharding
from maxtext_rocm.models.blockwise_attention import block_size
from maxtext_rocm.parallel import context_blocks as blocks

Array = jax.Array
AXIS = "sequence"


def resolve_mode(mode: str) -> str:
    """`model.context_parallel` with "auto" resolved (see the module docstring for why), by the
    resolve step (maxtext_rocm/resolve.py); context_attention receives its answer."""
    return "all_gather" if mode == "auto" else mode


# ----------------------------------------------------------------------------------------------
# The layout of a sequence over the `sequence` axis (shared by the data path and the attention)


@dataclasses.dataclass(frozen=True)
class Layout:
    """How each sequence's tokens lie over `n_shards` devices: contiguous 1/S slices, or (balanced)
    chunks i and 2S-1-i of 2S on shard i."""

    n_shards: int
    balanced: bool

    @property
    def chunks(self) -> int:
        """Contiguous chunks per shard."""
        return 2 if self.balanced and self.n_shards > 1 else 1

    def chunk_order(self) -> np.ndarray:
        """The natural (sequence-order) index of each chunk, in the laid-out order."""
        S = self.n_shards
        if self.chunks == 1:
            return np.arange(S)
        return np.array([c for i in range(S) for c in (i, 2 * S - 1 - i)])

    def permutation(self, seq_len: int) -> np.ndarray:
        """The true index of the token at each position of the laid-out sequence."""
        n = self.n_shards * self.chunks
        chunk = seq_len // n
        return (self.chunk_order()[:, None] * chunk + np.arange(chunk)[None]).reshape(-1)

    def starts(self, shard, local_len: int) -> list:
        """True index of the first token of each of `shard`'s chunks (`shard` may be traced)."""
        chunk = local_len // self.chunks
        if self.chunks == 1:
            return [shard * chunk]
        return [shard * chunk, (2 * self.n_shards - 1 - shard) * chunk]

    def apply(self, batch: dict) -> dict:
        """A host batch ([rows, seq_len] arrays) laid out for the mesh. Positions are added where
        the batch has none (the model's default arange would no longer be the true positions)."""
        if self.chunks == 1:
            return batch
        seq_len = next(iter(batch.values())).shape[1]
        perm = self.permutation(seq_len)
        out = {k: np.asarray(v)[:, perm] for k, v in batch.items()}
        if "positions" not in out:
            rows = next(iter(batch.values())).shape[0]
            out["positions"] = np.broadcast_to(perm.astype(np.int32), (rows, seq_len)).copy()
        return out

    def batch_dtypes(self, spec: dict) -> dict:
        """data.batch_spec's arrays plus the positions that `apply` adds."""
        if self.chunks == 1 or "positions" in spec:
            return spec
        return {**spec, "positions": np.dtype(np.int32)}


def layout(model_cfg, n_shards: int) -> Layout:
    return Layout(n_shards, bool(model_cfg.context_load_balance))


def mesh_layout(model_cfg, mesh: Mesh) -> Layout:
    return layout(model_cfg, mesh.shape[AXIS])


def attention_pairs(lay: Layout, seq_len: int, window: int = 0) -> list[int]:
    """Unmasked (query, key) pairs of a causal (optionally windowed) mask per shard, counted from
    the layout's permutation: the attention work each shard does."""
    true_index = lay.permutation(seq_len).reshape(lay.n_shards, -1)
    pairs = []
    for q in true_index:
        seen = q + 1 if not window else np.minimum(q + 1, window)
        pairs.append(int(seen.sum()))
    return pairs


# ----------------------------------------------------------------------------------------------
# The strategy the model receives


def context_attention(model_cfg, mesh: Mesh) -> Callable | None:
    """The Attention module's `context_attention` for `mesh`: f(q, k, v, segment_ids, window=) -> out,
    q [batch, seq, heads, head_dim], k, v [batch, seq, kv_heads, head_dim] as global arrays;
    `window`, the layer's sliding window (a static size, 0: none; default model.sliding_window's),
    so that a stack whose layers differ in kind passes each layer's own.
    None without a `sequence` axis (one device, or sequence=1): attention stays as it was."""
    if AXIS not in mesh.shape or mesh.shape[AXIS] == 1:
        return None
    if model_cfg.context_parallel == "auto":
        raise ValueError("model.context_parallel='auto' reached context_attention: the config was not resolved "
                         "(maxtext_rocm.resolve.resolve() was skipped)")
    return functools.partial(_sharded_attention, mesh=mesh, layout=mesh_layout(model_cfg, mesh),
                             mode=model_cfg.context_parallel, window=model_cfg.sliding_window or 0)


def _sharded_attention(q, k, v, segment_ids, *, mesh: Mesh, layout: Layout, mode: str, window: int):
    axes = functools.partial(sharding.present_axes, mesh)
    batch_axes, head_axes, kv_axes = axes("activation_batch"), axes("activation_heads"), axes("activation_kv_heads")
    S = mesh.shape[AXIS]
    batch, seq = q.shape[:2]
    local_len = seq // S
    if batch % math.prod(mesh.shape[a] for a in batch_axes) or seq % (S * layout.chunks):
        return _unsplit_attention(q, k, v, segment_ids, layout, window)
    block = block_size(local_len // layout.chunks)
    tokens = PartitionSpec(batch_axes, AXIS)
    q_spec = PartitionSpec(batch_axes, AXIS, head_axes, None)
    kv_spec = PartitionSpec(batch_axes, AXIS, kv_axes, None)

    def local(q, k, v, *segments):
        b, t, h, d = q.shape
        q = q.reshape(b, t, k.shape[2], h // k.shape[2], d)
        seg = segments[0] if segments else None
        shard = jax.lax.axis_index(AXIS)
        if mode == "ring":
            out = _ring(q, k, v, seg, seg, shard, layout, block, window)
        else:
            out = _gathered(q, k, v, seg, shard, layout, block, window)
        return out.reshape(b, t, h, d)

    args = (q, k, v) if segment_ids is None else (q, k, v, segment_ids)
    specs = (q_spec, kv_spec, kv_spec) + (() if segment_ids is None else (tokens,))
    return jax.shard_map(local, mesh=mesh, in_specs=specs, out_specs=q_spec,
                         check_vma=varying.check_vma(mesh))(*args)


def _unsplit_attention(q, k, v, segment_ids, layout: Layout, window: int):
    """A batch the mesh cannot split (the parameters' init traces one 8-token row; the config
    checks keep the train and eval batches splittable): the plain attention, left to GSPMD, under
    the mask of the tokens' true indices, so the values stay exact in any layout."""
    from maxtext_rocm.models.attention import dot_product_attention, masked_attention, position_mask

    seq = q.shape[1]
    if layout.chunks == 1 or seq % (layout.n_shards * layout.chunks):
        # Contiguous: the natural causal mask. Not laid out at all (a shorter row): likewise.
        return dot_product_attention(q, k, v, segment_ids=segment_ids, implementation="xla", sliding_window=window)
    true_index = jnp.asarray(layout.permutation(seq), jnp.int32)[None]
    mask = position_mask(true_index, true_index, window)
    if segment_ids is not None:
        mask = mask & (segment_ids[:, None, :, None] == segment_ids[:, None, None, :])
    return masked_attention(q, k, v, mask)


def _chunks(x, n, axis=1):
    size = x.shape[axis] // n
    return [jax.lax.slice_in_dim(x, c * size, (c + 1) * size, axis=axis) for c in range(n)]


def _cat(parts, axis=1):
    return parts[0] if len(parts) == 1 else jnp.concatenate(parts, axis=axis)


# ----------------------------------------------------------------------------------------------
# all_gather: K/V of the whole sequence, gathered once per layer


def _gathered(q, k, v, seg, shard, layout: Layout, block: int, window: int):
    gather = functools.partial(jax.lax.all_gather, axis_name=AXIS, axis=1, tiled=True)
    # Gathered in the laid-out order; put back in sequence order (a static chunk permutation), so
    # the keys are one contiguous range starting at index 0.
    where = np.argsort(layout.chunk_order())
    n = layout.n_shards * layout.chunks

    def natural(x):
        parts = _chunks(gather(x), n)
        return _cat([parts[i] for i in where])

    k_seg = None if seg is None else natural(seg)
    starts = jnp.stack(layout.starts(shard, q.shape[1])).astype(jnp.int32)
    return _attend_whole(q, natural(k), natural(v), seg, k_seg, starts, block, window)


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7))
def _attend_whole(q, k, v, q_seg, k_seg, q_starts, block, window):
    return _attend_whole_fwd(q, k, v, q_seg, k_seg, q_starts, block, window)[0]


def _attend_whole_fwd(q, k, v, q_seg, k_seg, q_starts, block, window):
    n = q_starts.shape[0]
    zero = jnp.zeros((), jnp.int32)
    outs, lses = [], []
    for c, (q_c, seg_c) in enumerate(zip(_chunks(q, n), _chunks(q_seg, n) if q_seg is not None else [None] * n)):
        carry = blocks.initial_carry(q_c, k, q_starts)
        carry = blocks.forward(q_c, k, v, q_starts[c], zero, seg_c, k_seg, carry, block, window)
        out, lse = blocks.finish(carry, q.dtype)
        outs.append(out)
        lses.append(lse)
    out, lse = _cat(outs), _cat(lses, axis=3)
    return out, (q, k, v, q_seg, k_seg, q_starts, out, lse)


def _attend_whole_bwd(block, window, residuals, d_out):
    q, k, v, q_seg, k_seg, q_starts, out, lse = residuals
    n = q_starts.shape[0]
    zero = jnp.zeros((), jnp.int32)
    delta = jnp.einsum("bqkgd,bqkgd->bkgq", d_out.astype(jnp.float32), out.astype(jnp.float32))
    segs = _chunks(q_seg, n) if q_seg is not None else [None] * n
    dqs, dk, dv = [], 0.0, 0.0
    for c in range(n):
        dq_c, dk_c, dv_c = blocks.backward(
            _chunks(q, n)[c], k, v, q_starts[c], zero, segs[c], k_seg, _chunks(lse, n, 3)[c],
            _chunks(delta, n, 3)[c], _chunks(d_out, n)[c], block, window)
        dqs.append(dq_c)
        dk, dv = dk + dk_c, dv + dv_c
    return _cat(dqs).astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None, None, None


_attend_whole.defvjp(_attend_whole_fwd, _attend_whole_bwd)


# ----------------------------------------------------------------------------------------------
# ring: K/V blocks passed around `sequence`


def _ring_perm(n: int):
    return [(j, (j + 1) % n) for j in range(n)]


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7, 8))
def _ring(q, k, v, q_seg, k_seg, shard, layout, block, window):
    return _ring_fwd(q, k, v, q_seg, k_seg, shard, layout, block, window)[0]


def _ring_fwd(q, k, v, q_seg, k_seg, shard, layout: Layout, block: int, window: int):
    S, n = layout.n_shards, layout.chunks
    local_len = q.shape[1]
    q_parts = _chunks(q, n)
    q_segs = _chunks(q_seg, n) if q_seg is not None else [None] * n
    q_starts = layout.starts(shard, local_len)

    def fold(r, kv, carries):
        """Every query chunk meets the key chunks that arrived at ring step r (from shard i-r)."""
        k_r, v_r, seg_r = kv
        k_starts = layout.starts((shard - r) % S, local_len)
        k_parts, v_parts = _chunks(k_r, n), _chunks(v_r, n)
        k_segs = _chunks(seg_r, n) if seg_r is not None else [None] * n
        new = []
        for c in range(n):
            carry = carries[c]
            for e in range(n):
                carry = blocks.forward(q_parts[c], k_parts[e], v_parts[e], q_starts[c], k_starts[e],
                                       q_segs[c], k_segs[e], carry, block, window)
            new.append(carry)
        return tuple(new)

    def body(r, state):
        kv, carries = state
        carries = fold(r, kv, carries)
        # The next hop; nothing above depends on it, so it can overlap the blocks' computation.
        kv = jax.lax.ppermute(kv, AXIS, _ring_perm(S))
        return kv, carries

    carries = tuple(blocks.initial_carry(q_c, k, v, shard) for q_c in q_parts)
    kv, carries = jax.lax.fori_loop(0, S - 1, body, ((k, v, k_seg), carries))
    carries = fold(S - 1, kv, carries)
    finished = [blocks.finish(c, q.dtype) for c in carries]
    out, lse = _cat([f[0] for f in finished]), _cat([f[1] for f in finished], axis=3)
    return out, (q, k, v, q_seg, k_seg, shard, out, lse)


def _ring_bwd(layout: Layout, block: int, window: int, residuals, d_out):
    q, k, v, q_seg, k_seg, shard, out, lse = residuals
    S, n = layout.n_shards, layout.chunks
    local_len = q.shape[1]
    delta = jnp.einsum("bqkgd,bqkgd->bkgq", d_out.astype(jnp.float32), out.astype(jnp.float32))
    q_parts, do_parts = _chunks(q, n), _chunks(d_out, n)
    lse_parts, delta_parts = _chunks(lse, n, 3), _chunks(delta, n, 3)
    q_segs = _chunks(q_seg, n) if q_seg is not None else [None] * n
    q_starts = layout.starts(shard, local_len)
    hop = functools.partial(jax.lax.ppermute, axis_name=AXIS, perm=_ring_perm(S))

    def unfold(r, kv, grads, dq):
        """Step r's key chunks (from shard i-r) meet every query chunk: their contributions to dq
        (which stays) and to those keys' dK, dV, added to `grads` in fp32."""
        k_r, v_r, seg_r = kv
        k_starts = layout.starts((shard - r) % S, local_len)
        k_parts, v_parts = _chunks(k_r, n), _chunks(v_r, n)
        k_segs = _chunks(seg_r, n) if seg_r is not None else [None] * n
        dq = list(dq)
        dk_parts = [p.astype(jnp.float32) for p in _chunks(grads[0], n)]
        dv_parts = [p.astype(jnp.float32) for p in _chunks(grads[1], n)]
        for c in range(n):
            for e in range(n):
                dq_ce, dk_ce, dv_ce = blocks.backward(
                    q_parts[c], k_parts[e], v_parts[e], q_starts[c], k_starts[e], q_segs[c], k_segs[e],
                    lse_parts[c], delta_parts[c], do_parts[c], block, window)
                dq[c], dk_parts[e], dv_parts[e] = dq[c] + dq_ce, dk_parts[e] + dk_ce, dv_parts[e] + dv_ce
        return (_cat(dk_parts), _cat(dv_parts)), tuple(dq)

    def wire(grads):
        """A travelling dK/dV partial sum in K/V's dtype, as the all-gather's reduce-scatter sends
        it (a bf16 ring reduce-scatter rounds at every hop too); fp32 travels as fp32."""
        return grads[0].astype(k.dtype), grads[1].astype(v.dtype)

    operands = (q, k, v, d_out, lse, shard)
    def zeros(x):
        return varying.varying_like(jnp.zeros(x.shape, jnp.float32), *operands)

    dq = tuple(zeros(p) for p in q_parts)
    kv = (k, v, k_seg)
    # Step 0, the device's own keys: their dK/dV stay here, so no accumulator travels with the
    # first hop. The accumulator of shard j starts at j+1 (step 1) and, after visiting the other
    # S-2 devices, arrives home with the last of S-1 hops: S-1 hops of K/V and S-1 of dK/dV
    # (the all-gather's reduce-scatter moves the same (S-1) blocks of dK/dV).
    own, dq = unfold(0, kv, (zeros(k), zeros(v)), dq)
    kv = hop(kv)
    grads = wire((zeros(k), zeros(v)))

    def body(r, state):
        kv, grads, dq = state
        # K/V's next hop does not wait for this step's blocks (it can run under them); the
        # accumulators, which do, go after.
        next_kv = hop(kv)
        grads, dq = unfold(r, kv, grads, dq)
        return next_kv, hop(wire(grads)), dq

    kv, grads, dq = jax.lax.fori_loop(1, S - 1, body, (kv, grads, dq))
    grads, dq = unfold(S - 1, kv, grads, dq)
    dk, dv = hop(wire(grads))
    dk, dv = own[0] + dk.astype(jnp.float32), own[1] + dv.astype(jnp.float32)
    return _cat(list(dq)).astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None, None, None


_ring.defvjp(_ring_fwd, _ring_bwd)
