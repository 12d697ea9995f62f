"""Which iterations do real work (legend: __init__.py). Router losses the MoE layers
sow come back per iteration, stage and slot; only real layers' passes over real microbatches are
kept (`real_work`), so the mean over them is the mean over (microbatch, layer): the value
train.grad_accum = M would give on one device. fp8 delayed scaling likewise: its state updates
arrive as cotangents (fp8.py), which a loop would sum over every use of a layer, bubble included;
the state goes in as one copy per iteration (`fan_out`) whose backward keeps each slot's real uses
only and merges them as fp8.combine_updates merges micro-batches."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from maxtext_rocm.numerics import fp8
from maxtext_rocm.parallel.pipeline.layout import StackLayout

Array = jax.Array


def pass_table(layout: StackLayout, microbatches: int) -> tuple[np.ndarray, np.ndarray]:
    """[iterations, S] each: the repeat stage s runs in iteration t (its pass t - s, clamped into
    the schedule), and whether that pass is real (False in the bubble)."""
    passes = layout.repeats * microbatches
    t, s = np.meshgrid(np.arange(passes + layout.stages - 1), np.arange(layout.stages), indexing="ij")
    work = t - s
    return np.clip(work, 0, passes - 1) // microbatches, (work >= 0) & (work < passes)


def real_work(layout: StackLayout, microbatches: int, leaf: Array, passes=None) -> Array:
    """[iterations, S, K, ...] -> [M L, ...]: what each layer computed for each microbatch (the
    bubble's iterations and the empty slots dropped), whose mean is the one device's. `passes`:
    another order's (repeat, real) per iteration and stage (1f1b's); None: `pass_table`."""
    repeat, in_time = passes if passes is not None else pass_table(layout, microbatches)
    stage_ids, slot_ids = np.arange(layout.stages)[None, :, None], np.arange(layout.per_chunk)[None, None, :]
    keep = in_time[:, :, None] & layout.real[stage_ids, repeat[:, :, None], slot_ids]
    flat = leaf.reshape(-1, *leaf.shape[3:])
    return jnp.take(flat, np.flatnonzero(keep.reshape(-1)), axis=0)


def real_uses(layout: StackLayout, microbatches: int) -> np.ndarray:
    """[iterations, S, R, K]: whether slot k of chunk r on device s runs a real layer on a real
    microbatch in that iteration."""
    repeat, in_time = pass_table(layout, microbatches)
    uses = in_time[:, :, None] & (repeat[:, :, None] == np.arange(layout.repeats)[None, None, :])
    return uses[..., None] & layout.real[None]


def fan_out(state, uses: np.ndarray):
    """`state` [S, R, K, ...] repeated once per iteration. Backward, each slot's cotangents (fp8.py:
    the updated scale and amax history of each use) combine over its real uses only, as
    fp8.combine_updates merges micro-batches; a slot with none keeps its state."""
    iterations = uses.shape[0]

    @jax.custom_vjp
    def fan(tree):  # forward: the state, broadcast to [iterations, S, R, K, ...]
        return jax.tree_util.tree_map(lambda a: jnp.broadcast_to(a, (iterations, *a.shape)), tree)

    def forward(tree):  # keeps the state itself as the residual
        return fan(tree), tree

    def backward(tree, cotangent):  # cotangent: [iterations, S, R, K, ...], each use's update
        identity = fp8.merge_identity(tree)

        def combine(c, start):  # start: +inf for a scale (the smallest wins), -inf for a history
            masked = jnp.where(uses.reshape(*uses.shape, *(1,) * (c.ndim - uses.ndim)), c, start[None])
            return jnp.where(start == jnp.inf, masked.min(axis=0), masked.max(axis=0))
        combined = jax.tree_util.tree_map(combine, cotangent, identity)
        used = uses.any(axis=0)
        return (jax.tree_util.tree_map(
            lambda new, old: jnp.where(used.reshape(*used.shape, *(1,) * (old.ndim - used.ndim)), new, old),
            combined, tree),)

    fan.defvjp(forward, backward)
    return fan(state)
