"""The tokens come in unembedded, with a pure lookup (models/llama.py, TokenEmbedding): each stage
looks the batch up itself before the loop (`embedded_per_stage`) and stage 0's is read, so neither
the embeddings nor their cotangent cross `stage`. An untied table is stored on the first stage (a
row per stage, the others zero: layout.py), so its gradient is not summed over `stage` either; a
tied one, replicated over `stage`, is."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import linen as nn
from jax.sharding import Mesh, NamedSharding

from maxtext_rocm.models.layers import EMBED_TABLE_AXES
from maxtext_rocm.models.llama import BLOCK_OUTPUT_AXES, TokenEmbedding
from maxtext_rocm.parallel.pipeline.axes import STAGE_AXIS, TOKEN_AXES
from maxtext_rocm.parallel.pipeline.microbatches import split_microbatches
from maxtext_rocm.parallel.sharding import constrained_both_ways, present_axes

Array = jax.Array


def embedded_per_stage(embedding: TokenEmbedding, tokens: Array, stages: int, microbatches: int,
                       mesh: Mesh, tables_per_stage: bool = False) -> Array:
    """[S, M, mb, seq, d]: each stage's own lookup of the whole batch's `tokens` [B, seq], split
    into microbatches, sharded over `stage`; only stage 0's is read. Looked up where it is used,
    the embeddings never cross `stage`: their cotangent (stage 0's row, zeros elsewhere) goes into
    each stage's own table gradient, and the one sum over the stages is the table's (replicated
    over `stage`, its gradient is summed over it in any case). Embedding the batch once and sending
    each stage a copy instead cost the batch's embeddings over `stage` twice: an all-gather of
    the rows (XLA split the lookup over the otherwise idle axis) and the copies' cotangent summed
    by an all-reduce (docs/figures.md, "The stage axis's bytes, counted twice").
    `tables_per_stage`: the table is stored [S, vocab, d_model], stage 0's row the table
    (layout.ends_on_their_stages), so each stage looks up in its own row and the gradient
    needs no sum over `stage`."""
    per_stage = nn.with_logical_constraint(jnp.broadcast_to(tokens[None], (stages, *tokens.shape)), TOKEN_AXES)
    # A copy of the table per stage too, each stage's gradient its own [vocab, d_model] until one
    # sum over the copies. Passed unbatched instead, the table's gradient was one scatter over all
    # stages' rows, which XLA summed whole over `stage` (fsdp times the bytes of the table's shard).
    copies = embedding.variables if tables_per_stage else jax.tree_util.tree_map(
        lambda a: jnp.broadcast_to(a[None], (stages, *a.shape)), embedding.variables)
    # Each copy's gradient is asked for in the stored layout, so each stage reduce-scatters its own
    # before the sum over `stage` adds shards. The lookup reads the copy as stored (d_model split
    # over fsdp: the looked-up rows are exchanged, as without a pipeline) or gathered over the
    # ZeRO-3 axes (_lookup_gathers_the_table).
    stored = _table_layout(copies, mesh, ("activation_stage",) + EMBED_TABLE_AXES)
    looked_up_in = (_table_layout(copies, mesh, ("activation_stage", EMBED_TABLE_AXES[0], None))
                    if _lookup_gathers_the_table(embedding, tokens, mesh) else stored)
    copies = constrained_both_ways(copies, looked_up_in, stored)
    embedded = jax.vmap(embedding.lookup, spmd_axis_name=STAGE_AXIS)(copies, per_stage)
    split = jax.vmap(functools.partial(split_microbatches, n=microbatches))(embedded)
    return nn.with_logical_constraint(split, ("activation_stage", None) + BLOCK_OUTPUT_AXES)


def _lookup_gathers_the_table(embedding: TokenEmbedding, tokens: Array, mesh: Mesh) -> bool:
    """Whether each stage looks its tokens up in the table gathered over the ZeRO-3 axes rather
    than as stored: where the gather moves fewer bytes than exchanging the looked-up rows (the
    vocabulary rows a device holds, V/t, against twice its tokens: rows out, cotangents back, as
    comm_minimum's embedding term weighs them), and always under tensor parallelism, where the
    stored layout's vmapped gather (a batched operand) kept neither the stage nor the batch
    sharding of its result and XLA replicated the whole [S, B, seq, d] ("Involuntary full
    rematerialization"; 405B stage=8 x fsdp=2 x tensor=4: f32[8,64,8192,8192])."""
    tensor = mesh.shape.get("tensor", 1)
    if tensor > 1:
        return True
    vocab = jax.tree_util.tree_leaves(embedding.variables)[0].shape[-2]  # [(S,) vocab, d_model]
    batch_shards = int(np.prod([mesh.shape[a] for a in present_axes(mesh, "activation_batch")]))
    return vocab <= 2 * tokens.size / batch_shards


def _table_layout(copies, mesh: Mesh, logical: tuple):
    """NamedShardings of the table copies [S, vocab, d_model] for `logical` axes under the rules in
    force."""
    return jax.tree_util.tree_map(lambda _: NamedSharding(mesh, nn.logical_to_mesh_axes(logical)), copies)
