"""Moving activations between stages: collective-permutes between neighbouring stage groups, and
one stage's rows to every stage."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec as P

from maxtext_rocm.parallel.pipeline.axes import STAGE_AXIS
from maxtext_rocm.parallel.sharding import nested_mesh

Array = jax.Array


def shift(state: Array, first_stage_input: Array, mesh: Mesh) -> Array:
    """Each stage's output to the next stage; stage 0 takes its row of `first_stage_input` [S, ...]
    instead. s to s + 1 only: GPipe needs no rotation, which would also send the last stage's
    output back to stage 0 for nothing."""
    shifted = permute(state, mesh, [(s, s + 1) for s in range(state.shape[0] - 1)])
    return jnp.where(is_first(state), first_stage_input, shifted)


def permute(state: Array, mesh: Mesh, pairs: list[tuple[int, int]]) -> Array:
    """`state` [S, ...] (sharded over `stage`) sent from stage a to stage b for each (a, b) of
    `pairs`; a stage no pair sends to gets zeros. An explicit ppermute, manual over `stage` alone
    (the other axes stay GSPMD's): the same shift written as a slice-and-concatenate along the
    sharded axis was lowered as an all-to-all over `stage`."""
    def local(block):  # block: this stage's [1, ...]
        return jax.lax.ppermute(block, STAGE_AXIS, pairs)
    return jax.shard_map(local, mesh=nested_mesh(mesh), in_specs=P(STAGE_AXIS), out_specs=P(STAGE_AXIS),
                         axis_names=frozenset({STAGE_AXIS}))(state)


def from_stage(per_stage: Array, stage: int, mesh: Mesh) -> Array:
    """per_stage[stage] on every stage, for `per_stage` [S, ...] sharded over `stage`: one
    all-reduce of what that stage holds (the others add zeros), whose transpose moves nothing (each
    stage keeps the cotangent of its own copy). Indexing the sharded axis instead was lowered as a
    permute to stage 0 and an all-reduce forward, and a permute back for the cotangent.
    In at least fp32: XLA:CPU aborts compiling a 16-bit all-reduce whose reducer jax wraps in a
    sharding constraint, as it does under a partial-manual shard_map (the version and the error:
    docs/figures.md, "Pipeline and expert code"). Once per step; a GPU sends this one broadcast at
    twice bf16's bytes."""
    def local(block):  # block: this stage's [1, ...]
        mine = jax.lax.axis_index(STAGE_AXIS) == stage
        wide = block[0].astype(jnp.promote_types(block.dtype, jnp.float32))
        return jax.lax.psum(jnp.where(mine, wide, jnp.zeros_like(wide)), STAGE_AXIS).astype(block.dtype)
    return jax.shard_map(local, mesh=nested_mesh(mesh), in_specs=P(STAGE_AXIS), out_specs=P(),
                         axis_names=frozenset({STAGE_AXIS}))(per_stage)


def is_first(state: Array) -> Array:
    """[S, 1, ...]: True in stage 0's row, to `where` over `state` [S, ...]."""
    return (jnp.arange(state.shape[0]) == 0).reshape(-1, *(1,) * (state.ndim - 1))
