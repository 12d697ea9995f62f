"""The fused LM head + cross-entropy on a mesh: each device on its own tokens and, under `tensor`,
its own slice of the vocabulary; the head's gradient reduced once per step.

Under GSPMD the chunked loss (maxtext_rocm/numerics/cross_entropy.py) carried its running d(head) sum in
the head's FSDP sharding, so every chunk's partial sum was all-reduced: for llama3_8b at 8,192
tokens per device, 8 all-reduces of the 2 GiB fp32 head gradient per step where one
reduce-scatter does. Here, under `shard_map` over the whole mesh:

- the head is all-gathered over its FSDP axes once (its `embed` axis; the vocabulary stays split
  over `tensor`), in the compute dtype, and its gradient leaves by the transpose of that gather,
  one reduce-scatter, then (on that 1/F shard) one all-reduce over `data`, which does not shard
  parameters;
- the running d(head) sum stays on the device through all the chunks;
- under `tensor` the log-partition and the target logit are reduced over the vocabulary slices
  ([tokens] values), and the hidden states' gradient is summed over them once, after the chunks;
- under `sequence` each shard computes the head on its own tokens only.

Without a mesh (one device, a notebook) it is cross_entropy.head_loss itself.
"""

from __future__ import annotations

import functools
import math

import jax
from jax.sharding import PartitionSpec

from maxtext_rocm.numerics import cross_entropy, varying
from maxtext_rocm.parallel import sharding

Array = jax.Array


def _ambient_mesh():
    """The mesh the step is traced under (`jax.set_mesh`), or None for one device or where an
    enclosing shard_map is manual over every axis of more than one device (pipeline.schedule="1f1b"
    runs the loss on each device's rows: parallel/pipeline/one_f_one_b.py)."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh is None or mesh.empty or math.prod(mesh.shape[a] for a in _auto_axes(mesh)) == 1:
        return None
    return mesh


def _axes_of(mesh, logical: str) -> tuple[str, ...]:
    """The mesh axes `logical` maps to here: those of more than one device that no enclosing
    shard_map is already manual over (those are this device's own already)."""
    return tuple(a for a in sharding.present_axes(mesh, logical) if a in _auto_axes(mesh))


def head_loss(hidden: Array, weight: Array, targets: Array, weights: Array, *, vocab_axis: int,
              z_loss_weight: float = 0.0, chunk: int) -> tuple[Array, dict[str, Array]]:
    """cross_entropy.head_loss's contract (sums over every token of the global batch), computed
    where each token and each slice of the head lives."""
    mesh = _ambient_mesh()
    if mesh is None:
        return cross_entropy.head_loss(hidden, weight, targets, weights, vocab_axis=vocab_axis,
                                       z_loss_weight=z_loss_weight, chunk=chunk)
    axes = functools.partial(_axes_of, mesh)
    batch, length, embed, vocab = axes("activation_batch"), axes("activation_length"), axes("embed"), axes("vocab")
    token_axes = batch + length
    tokens = PartitionSpec(batch, length)
    head = PartitionSpec(embed, vocab) if vocab_axis == 1 else PartitionSpec(vocab, embed)
    d_axis = 1 - vocab_axis

    def local(hidden, weight, targets, weights):
        # The head crosses the links in the compute dtype (bf16 under bf16 and fp8), as the layers'
        # weights do under GSPMD: cast before the gather, not after (cross_entropy casts it anyway).
        weight = weight.astype(hidden.dtype)
        # The head is the same on every device of a token axis that does not split it (`data`):
        # typed as varying there before the gather, its gradient is summed over those axes after
        # the gather's transpose (the reduce-scatter), on 1/F of the head. Left invariant, shard_map
        # would sum it where the gathered head meets the tokens: the whole head all-reduced over
        # `data` (1.25x the minimum for data=2 x fsdp=4, tests/test_comm.py).
        weight = varying.varying_over(weight, token_axes)
        if embed:  # the transpose of this gather is the head gradient's one reduce-scatter
            weight = jax.lax.all_gather(weight, embed, axis=d_axis, tiled=True)
        vocab_start = jax.lax.axis_index(vocab) * weight.shape[vocab_axis] if vocab else 0
        objective, sums = cross_entropy.head_loss(
            hidden, weight, targets, weights, vocab_axis=vocab_axis, z_loss_weight=z_loss_weight,
            chunk=cross_entropy.chunk_length(hidden.shape[1], chunk), vocab_start=vocab_start,
            tensor_axes=vocab)
        return jax.lax.psum((objective, sums), token_axes) if token_axes else (objective, sums)

    return jax.shard_map(local, mesh=mesh, in_specs=(PartitionSpec(batch, length, None), head, tokens, tokens),
                         out_specs=PartitionSpec(), axis_names=_auto_axes(mesh))(hidden, weight, targets, weights)


def _auto_axes(mesh) -> frozenset:
    """The mesh axes a shard_map here is manual over: all but those an enclosing shard_map already
    is (pipeline.schedule="1f1b" runs the loss inside one manual over `stage`)."""
    return frozenset(mesh.axis_names) - frozenset(getattr(mesh, "manual_axes", ()))


def row_sums(hidden: Array, weight: Array, targets: Array, weights: Array, *, vocab_axis: int,
             chunk: int) -> Array:
    """cross_entropy.row_sums on a mesh: [batch] sums of weights x cross-entropy, each row on the
    device that holds it (summed over `sequence` and reduced over the vocabulary's slices), sharded
    over the batch axes like the rows. No gradient: see sequence_logprobs."""
    mesh = _ambient_mesh()
    if mesh is None:
        return cross_entropy.row_sums(hidden, weight, targets, weights, vocab_axis=vocab_axis, chunk=chunk)
    axes = functools.partial(_axes_of, mesh)
    batch, length, embed, vocab = axes("activation_batch"), axes("activation_length"), axes("embed"), axes("vocab")
    tokens = PartitionSpec(batch, length)
    head = PartitionSpec(embed, vocab) if vocab_axis == 1 else PartitionSpec(vocab, embed)

    def local(hidden, weight, targets, weights):
        weight = weight.astype(hidden.dtype)
        if embed:
            weight = jax.lax.all_gather(weight, embed, axis=1 - vocab_axis, tiled=True)
        vocab_start = jax.lax.axis_index(vocab) * weight.shape[vocab_axis] if vocab else 0
        sums = cross_entropy.row_sums(hidden, weight, targets, weights, vocab_axis=vocab_axis,
                                      chunk=cross_entropy.chunk_length(hidden.shape[1], chunk),
                                      vocab_start=vocab_start, tensor_axes=vocab)
        return jax.lax.psum(sums, length) if length else sums  # a row's positions over `sequence`

    return jax.shard_map(local, mesh=mesh, in_specs=(PartitionSpec(batch, length, None), head, tokens, tokens),
                         out_specs=PartitionSpec(batch), axis_names=_auto_axes(mesh))(hidden, weight, targets, weights)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def sequence_logprobs(hidden: Array, weight: Array, targets: Array, weights: Array, vocab_axis: int,
                      chunk: int) -> Array:
    """[batch] fp32: each row's sum of weights x log p(target) through the fused LM head, with a
    gradient. The chunked head computes its gradient in its forward pass for one cotangent per
    token; a per-row objective (DPO) only knows its cotangents [batch] once every row's value is
    in. So the forward pass runs the head without gradients (row_sums) and the backward pass runs
    head_loss with each row's weights times its cotangent: the objective sum_b g_b logp_b, whose
    gradient is the chain rule's. Cost: one more head forward than the LM loss (8 instead of 6
    FLOPs per head parameter and token), no [tokens, vocab] buffer."""
    return -row_sums(hidden, weight, targets, weights, vocab_axis=vocab_axis, chunk=chunk)


def _sequence_logprobs_forward(hidden, weight, targets, weights, vocab_axis, chunk):
    return sequence_logprobs(hidden, weight, targets, weights, vocab_axis, chunk), (hidden, weight, targets, weights)


def _sequence_logprobs_backward(vocab_axis, chunk, residuals, g):
    hidden, weight, targets, weights = residuals
    # d/dtheta sum_b g_b logp_b = d/dtheta sum_b sum_t (-g_b w_bt) ce_bt: head_loss's objective.
    scaled = weights.astype(jax.numpy.float32) * -g[:, None]
    d_hidden, d_weight = jax.grad(
        lambda h, w: head_loss(h, w, targets, scaled, vocab_axis=vocab_axis, chunk=chunk)[0],
        argnums=(0, 1))(hidden, weight)
    return d_hidden, d_weight, None, None


sequence_logprobs.defvjp(_sequence_logprobs_forward, _sequence_logprobs_backward)


def token_losses(hidden: Array, weight: Array, targets: Array, *, vocab_axis: int, chunk: int) -> Array:
    """cross_entropy.token_losses on a mesh: [batch, seq] cross-entropy of each position, computed
    where its token lives (reduced over the vocabulary's slices), sharded like the tokens. No
    gradient: see token_logprobs."""
    mesh = _ambient_mesh()
    if mesh is None:
        return cross_entropy.token_losses(hidden, weight, targets, vocab_axis=vocab_axis, chunk=chunk)
    axes = functools.partial(_axes_of, mesh)
    batch, length, embed, vocab = axes("activation_batch"), axes("activation_length"), axes("embed"), axes("vocab")
    tokens = PartitionSpec(batch, length)
    head = PartitionSpec(embed, vocab) if vocab_axis == 1 else PartitionSpec(vocab, embed)

    def local(hidden, weight, targets):
        weight = weight.astype(hidden.dtype)
        if embed:
            weight = jax.lax.all_gather(weight, embed, axis=1 - vocab_axis, tiled=True)
        vocab_start = jax.lax.axis_index(vocab) * weight.shape[vocab_axis] if vocab else 0
        return cross_entropy.token_losses(hidden, weight, targets, vocab_axis=vocab_axis,
                                          chunk=cross_entropy.chunk_length(hidden.shape[1], chunk),
                                          vocab_start=vocab_start, tensor_axes=vocab)

    return jax.shard_map(local, mesh=mesh, in_specs=(PartitionSpec(batch, length, None), head, tokens),
                         out_specs=tokens, axis_names=_auto_axes(mesh))(hidden, weight, targets)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def token_logprobs(hidden: Array, weight: Array, targets: Array, vocab_axis: int, chunk: int) -> Array:
    """[batch, seq] fp32: log p(target) at each position through the fused LM head, with a
    gradient, as sequence_logprobs does for row sums: the forward pass runs the head without
    gradients (token_losses) and the backward pass runs head_loss with each position's cotangent as
    its weight, the objective sum_bt g_bt logp_bt, whose gradient is the chain rule's."""
    return -token_losses(hidden, weight, targets, vocab_axis=vocab_axis, chunk=chunk)


def _token_logprobs_forward(hidden, weight, targets, vocab_axis, chunk):
    return token_logprobs(hidden, weight, targets, vocab_axis, chunk), (hidden, weight, targets)


def _token_logprobs_backward(vocab_axis, chunk, residuals, g):
    hidden, weight, targets = residuals
    d_hidden, d_weight = jax.grad(
        lambda h, w: head_loss(h, w, targets, -g.astype(jax.numpy.float32), vocab_axis=vocab_axis, chunk=chunk)[0],
        argnums=(0, 1))(hidden, weight)
    return d_hidden, d_weight, None


token_logprobs.defvjp(_token_logprobs_forward, _token_logprobs_backward)
