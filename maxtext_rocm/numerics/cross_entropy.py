"""Cross-entropy fused with the LM head, a chunk of the sequence at a time.

The plain path materialises [tokens, vocab] logits, then fp32 copies of them for the softmax
and for its gradient: at Llama 3's 128K vocabulary that is the largest buffer of a step (8 x 8K
tokens: 34 GB in fp32). Here a `lax.scan` over sequence chunks computes each chunk's logits,
log-partition and target logit in fp32 and, when differentiated, that chunk's gradients at
once: d(hidden) for the chunk and a running fp32 sum of d(weight). No logits outlive their
chunk and nothing is recomputed in the backward pass (the backward only scales the gradients
by the incoming cotangent), so it costs the same three matmuls as the plain path.

Exact for every use: the differentiable output is the objective itself (summed cross-entropy
plus z-loss); the separate sums returned for metrics carry no gradient.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from maxtext_rocm.numerics import varying

Array = jax.Array


def chunk_length(seq_len: int, max_chunk: int) -> int:
    """The largest divisor of `seq_len` that is at most `max_chunk` (every chunk the same size)."""
    max_chunk = max(1, min(max_chunk, seq_len))
    return next(c for c in range(max_chunk, 0, -1) if seq_len % c == 0)


def _chunks(x: Array, chunk: int) -> Array:
    """[batch, seq, ...] -> [seq / chunk, batch, chunk, ...]: scanning over the sequence keeps the
    batch axis (the one data parallelism shards) whole in every step."""
    b, s = x.shape[:2]
    return jnp.moveaxis(x.reshape(b, s // chunk, chunk, *x.shape[2:]), 1, 0)


def _unchunk(x: Array) -> Array:
    x = jnp.moveaxis(x, 0, 1)
    return x.reshape(x.shape[0], -1, *x.shape[3:])


# Contractions for a head weight laid out [vocab, d_model] (a tied embedding) or [d_model, vocab].
_LOGITS = {0: "bcd,vd->bcv", 1: "bcd,dv->bcv"}
_D_HIDDEN = {0: "bcv,vd->bcd", 1: "bcv,dv->bcd"}
_D_WEIGHT = {0: "bcd,bcv->vd", 1: "bcd,bcv->dv"}


def _chunk_statistics(h, w, targets, vocab_axis, vocab_start, tensor_axes):
    """fp32 logits of one chunk, their log-partition and the targets' logits. Under
    `tensor_axes` the head holds this device's slice of the vocabulary, from `vocab_start`: the
    log-partition and the target logit are then reduced over the slices."""
    logits = jnp.einsum(_LOGITS[vocab_axis], h, w, preferred_element_type=jnp.float32)
    if not tensor_axes:
        log_z = jax.nn.logsumexp(logits, axis=-1)
        target_logit = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
        return logits, log_z, target_logit
    # The max only steadies the exponentials; any value common to the slices gives the same result.
    peak = jax.lax.pmax(jax.lax.stop_gradient(jnp.max(logits, axis=-1)), tensor_axes)
    log_z = peak + jnp.log(jax.lax.psum(jnp.sum(jnp.exp(logits - peak[..., None]), axis=-1), tensor_axes))
    local = targets - vocab_start
    mine = (local >= 0) & (local < logits.shape[-1])
    target_logit = jnp.take_along_axis(logits, jnp.clip(local, 0, logits.shape[-1] - 1)[..., None], axis=-1)[..., 0]
    return logits, log_z, jax.lax.psum(jnp.where(mine, target_logit, 0.0), tensor_axes)


def _chunked(hidden, targets, weights, chunk):
    """The scan's per-chunk inputs: hidden states, targets and token weights."""
    return _chunks(hidden, chunk), _chunks(targets, chunk), _chunks(weights, chunk)


def _sums(log_z, target_logit, weights):
    return jnp.sum((log_z - target_logit) * weights), jnp.sum(jnp.square(log_z) * weights)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7, 8))
def _fused(hidden, weight, targets, weights, vocab_start, z_loss_weight, chunk, vocab_axis, tensor_axes):
    """Undifferentiated (evaluation): the chunked forward pass alone."""
    w = weight.astype(hidden.dtype)

    def body(carry, xs):
        h, t, wt = xs
        _, log_z, target_logit = _chunk_statistics(h, w, t, vocab_axis, vocab_start, tensor_axes)
        ce, z = _sums(log_z, target_logit, wt)
        return (carry[0] + ce, carry[1] + z), None

    zero = varying.varying_like(jnp.zeros((), jnp.float32), hidden)  # per device under shard_map
    (ce, z), _ = jax.lax.scan(body, (zero, zero), _chunked(hidden, targets, weights, chunk))
    return ce + z_loss_weight * z, (ce, z)


def _fused_forward(hidden, weight, targets, weights, vocab_start, z_loss_weight, chunk, vocab_axis, tensor_axes):
    """The forward pass plus the objective's gradients for a cotangent of 1."""
    w = weight.astype(hidden.dtype)

    def body(d_weight, xs):
        h, t, wt = xs
        logits, log_z, target_logit = _chunk_statistics(h, w, t, vocab_axis, vocab_start, tensor_axes)
        # d/dlogits of sum(wt * (log_z - logit[t])) + z * sum(wt * log_z^2):
        #   wt * (1 + 2 z log_z) * softmax - wt * onehot(t)
        probs = jnp.exp(logits - log_z[..., None])
        d_logits = probs * (wt * (1.0 + 2.0 * z_loss_weight * log_z))[..., None]
        is_target = jax.lax.broadcasted_iota(jnp.int32, logits.shape, 2) == (t - vocab_start)[..., None]
        d_logits = jnp.where(is_target, d_logits - wt[..., None], d_logits).astype(h.dtype)
        d_h = jnp.einsum(_D_HIDDEN[vocab_axis], d_logits, w, preferred_element_type=jnp.float32)
        d_weight = d_weight + jnp.einsum(_D_WEIGHT[vocab_axis], h, d_logits, preferred_element_type=jnp.float32)
        ce, z = _sums(log_z, target_logit, wt)
        return d_weight, (d_h.astype(h.dtype), ce, z)

    # The running sum stays on this device: under a mesh (parallel/loss.py) it is reduced once,
    # after the last chunk, rather than once per chunk.
    d_weight = varying.varying_like(jnp.zeros(weight.shape, jnp.float32), hidden, weight)
    d_weight, (d_hidden, ce, z) = jax.lax.scan(body, d_weight, _chunked(hidden, targets, weights, chunk))
    ce, z = jnp.sum(ce), jnp.sum(z)
    d_hidden = _unchunk(d_hidden)
    if tensor_axes:  # each slice of the vocabulary contributed part of every token's gradient
        d_hidden = jax.lax.psum(d_hidden, tensor_axes)
    # An empty slice of each input keeps its shard_map typing for the backward pass (no data).
    typed_like = (hidden[:0], weight[:0])
    return (ce + z_loss_weight * z, (ce, z)), (d_hidden, d_weight.astype(weight.dtype), typed_like)


def _fused_backward(z_loss_weight, chunk, vocab_axis, tensor_axes, residuals, cotangents):
    del z_loss_weight, chunk, vocab_axis, tensor_axes
    d_hidden, d_weight, (hidden, weight) = residuals
    g = cotangents[0]  # the metric sums' cotangents are zero: head_loss stops their gradient
    # Under shard_map the head is the same on every data-parallel replica, so its gradient is the
    # sum of theirs: reduced here, once per step (outside shard_map this does nothing).
    return (varying.summed_like(d_hidden * g.astype(d_hidden.dtype), hidden),
            varying.summed_like(d_weight * g.astype(d_weight.dtype), weight), None, None, None)


_fused.defvjp(_fused_forward, _fused_backward)


def head_loss(hidden: Array, weight: Array, targets: Array, weights: Array, *, vocab_axis: int,
              z_loss_weight: float = 0.0, chunk: int, vocab_start: Array | int = 0,
              tensor_axes: tuple[str, ...] = ()) -> tuple[Array, dict[str, Array]]:
    """(objective, {"ce": ..., "z_loss": ...}) summed over tokens.

    hidden: [batch, seq, d_model] after the final norm, in the compute dtype; weight: the LM head,
    [vocab, d_model] (`vocab_axis=0`, a tied embedding) or [d_model, vocab] (`vocab_axis=1`);
    targets: int [batch, seq]; weights: [batch, seq] per-token loss weights (0 masks a token).
    objective = sum(weights * ce) + z_loss_weight * sum(weights * log_z^2), the only output with
    a gradient. `chunk` (a divisor of seq, see chunk_length) bounds the logits in memory.
    Under shard_map (maxtext_rocm/parallel/loss.py), `tensor_axes` name the mesh axes that split
    the vocabulary and `vocab_start` this device's first entry; the sums are then this device's
    tokens', and the weight's gradient this device's contribution, reduced by the caller.
    """
    if hidden.shape[1] % chunk:
        raise ValueError(f"chunk {chunk} does not divide the sequence length {hidden.shape[1]}")
    objective, (ce, z) = _fused(hidden, weight, targets, weights.astype(jnp.float32),
                                jnp.asarray(vocab_start, jnp.int32), float(z_loss_weight), int(chunk),
                                int(vocab_axis), tuple(tensor_axes))
    return objective, {"ce": jax.lax.stop_gradient(ce), "z_loss": jax.lax.stop_gradient(z)}


def token_losses(hidden: Array, weight: Array, targets: Array, *, vocab_axis: int, chunk: int,
                 vocab_start: Array | int = 0, tensor_axes: tuple[str, ...] = ()) -> Array:
    """[batch, seq] fp32: each position's cross-entropy, chunk by chunk (no [tokens, vocab] buffer)
    and without a gradient (parallel/loss.py's token_logprobs differentiates it through head_loss).
    The per-token log-probabilities of a policy-gradient objective (finetune/grpo/) are its
    negation. Arguments as head_loss's."""
    if hidden.shape[1] % chunk:
        raise ValueError(f"chunk {chunk} does not divide the sequence length {hidden.shape[1]}")
    w = weight.astype(hidden.dtype)
    vocab_start = jnp.asarray(vocab_start, jnp.int32)

    def body(_, xs):
        h, t = xs
        _, log_z, target_logit = _chunk_statistics(h, w, t, vocab_axis, vocab_start, tensor_axes)
        return None, log_z - target_logit

    _, per_chunk = jax.lax.scan(body, None, (_chunks(hidden, chunk), _chunks(targets, chunk)))
    return jax.lax.stop_gradient(_unchunk(per_chunk))


def row_sums(hidden: Array, weight: Array, targets: Array, weights: Array, *, vocab_axis: int, chunk: int,
             vocab_start: Array | int = 0, tensor_axes: tuple[str, ...] = ()) -> Array:
    """[batch] fp32: each row's sum of weights x cross-entropy, the chunked forward pass alone (no
    gradient; parallel/loss.py's sequence_logprobs differentiates it through head_loss). The
    per-sequence log-probabilities of a preference objective (finetune/dpo.py) are its negation.
    Arguments as head_loss's; under shard_map the rows are this device's and each sum covers this
    device's positions of its rows."""
    if hidden.shape[1] % chunk:
        raise ValueError(f"chunk {chunk} does not divide the sequence length {hidden.shape[1]}")
    w = weight.astype(hidden.dtype)
    vocab_start = jnp.asarray(vocab_start, jnp.int32)

    def body(carry, xs):
        h, t, wt = xs
        _, log_z, target_logit = _chunk_statistics(h, w, t, vocab_axis, vocab_start, tensor_axes)
        return carry + jnp.sum((log_z - target_logit) * wt, axis=1), None

    zero = varying.varying_like(jnp.zeros(hidden.shape[:1], jnp.float32), hidden)
    sums, _ = jax.lax.scan(body, zero, _chunked(hidden, targets, weights.astype(jnp.float32), chunk))
    return jax.lax.stop_gradient(sums)
