"""Pipeline parallelism over the `stage` mesh axis: the scanned layer stack split over the stage
devices, the batch into microbatches that flow through them. Two schedules:

- "gpipe": device s runs layers [s L/S, (s+1) L/S). A loop of M + S - 1 iterations over a state
  [S, microbatch, seq, d]: stage 0 takes microbatch t, every stage runs its layers on what it
  holds, and the outputs shift one stage on (a collective-permute between neighbouring stage
  groups: activations are all that cross them). Bubble (S-1)/(M+S-1).
- "circular" (pipeline.repeats = R): the stack is S R chunks, chunk v on device v mod S; each
  microbatch goes round the devices R times, R M + S - 1 iterations of 1/R the work each: bubble
  (S-1)/(R M+S-1). The shift is a rotation (the last stage's output goes back to stage 0) into a
  buffer that holds it until stage 0 is free (M >= S); each stage indexes its chunk of the
  iteration out of its own block, so no weight moves.

The parameters are the stack's own arrays, the "layers" axis sharded over `stage` (sharding.py).
Where model order is not what each device runs (circular) or the stack does not divide (126
layers on 8 stages), the run stores the stack in its own order, empty slots included
(parallel/pipeline_layout.py); checkpoints keep model order. Here storage [S R K, ...] is viewed
as [S, R, K, ...] (a reshape of the sharded axis, no data moves) and the S stages run as one
vmapped stage function whose vmapped axis is sharded over `stage` (`spmd_axis_name`): every
logical constraint inside the layers keeps its meaning, with the stage axis in front, so the
pipeline composes with fsdp, tensor, expert and sequence sharding as the unpipelined stack does.
The layers' own shard_maps (the dropless expert exchange, context-parallel attention) are batched
by that vmap, the stage axis added to their specs; they run unchecked here (varying.check_vma).
An empty slot runs the layer on its zeros and keeps its input (`where`), so it gets zero gradient.

Work a stage does in the bubble (on zeros or a repeated microbatch) is dropped and gets no
cotangent, so gradients are exact. The backward pass is the loop's autodiff: all forwards, then
all backwards; each layer keeps what model.remat lets it keep, per microbatch.

Router losses the MoE layers sow come back per iteration, stage and slot; only real layers'
passes over real microbatches are kept, so the mean over them is the mean over (microbatch,
layer): the value train.grad_accum = M would give on one device. fp8 delayed scaling likewise: its
state updates arrive as cotangents (fp8.py), which a loop would sum over every use of a layer,
bubble included; the state goes in as one copy per iteration (_fan_out) whose backward keeps each
slot's real uses only and merges them as fp8.combine_updates merges micro-batches.
"""

from __future__ import annotations

import functools
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import linen as nn
from jax.sharding import Mesh, PartitionSpec as P

from maxtext_rocm.config.checks import pipeline_microbatches
from maxtext_rocm.errors import ConfigError
from maxtext_rocm.numerics import fp8
from maxtext_rocm.numerics.fp8 import FP8_COLLECTION
from maxtext_rocm.models.llama import BLOCK_OUTPUT_AXES
from maxtext_rocm.models.moe import AUX_LOSSES
from maxtext_rocm.parallel.pipeline_layout import StackLayout

Array = jax.Array
STAGE_AXIS = "stage"  # the mesh axis; "activation_stage" is its logical name (sharding.py)


def bubble_fraction(schedule: str, stages: int, microbatches: int, repeats: int = 1) -> float:
    """The share of a step each stage idles. GPipe: (S-1)/(M+S-1). Circular, R virtual stages per
    device: (S-1)/(R M + S-1), each pass over the devices being 1/R as long."""
    if schedule == "gpipe":
        return (stages - 1) / (microbatches + stages - 1)
    return (stages - 1) / (repeats * microbatches + stages - 1)


def describe(pipeline_cfg, stages: int, n_layers: int | None = None) -> str:
    """One phrase for the run's description: schedule, microbatches, bubble, and (given the model's
    `n_layers`) the empty slots of a stack that does not divide evenly, with the idle time they add."""
    if stages <= 1:
        return "pipeline off"
    m = _resolved(pipeline_cfg)
    r = pipeline_cfg.repeats
    bubble = bubble_fraction(pipeline_cfg.schedule, stages, m, r)
    formula = "(S-1)/(M+S-1)" if pipeline_cfg.schedule == "gpipe" else "(S-1)/(R M+S-1)"
    shape = f"{stages} stages" + (f" x {r} repeats" if r > 1 else "")
    text = f"pipeline {pipeline_cfg.schedule}: {shape}, {m} microbatches, bubble {bubble:.1%} = {formula}"
    layout = StackLayout(n_layers, stages, r) if n_layers else None
    if layout is not None and layout.empty:
        text += f"; {layout.describe()}, idle {layout.idle_fraction(m):.1%} with them"
    return text


def layer_stack(pipeline_cfg, model_cfg, mesh: Mesh) -> Callable | None:
    """The Decoder's `layer_stack` strategy for `mesh` (models/llama.py), or None where the mesh
    has one stage and the layers run in order on every device."""
    stages = mesh.shape.get(STAGE_AXIS, 1)
    if stages <= 1:
        return None
    if model_cfg.n_layers < stages * pipeline_cfg.repeats:  # the config checks say it first
        raise ConfigError(f"model.n_layers={model_cfg.n_layers} leaves some of mesh stage={stages} x "
                          f"pipeline.repeats={pipeline_cfg.repeats} virtual stages without a layer")
    return functools.partial(_schedule, layout=StackLayout(model_cfg.n_layers, stages, pipeline_cfg.repeats),
                             microbatches=_resolved(pipeline_cfg), mesh=mesh)


def resolve_microbatches(cfg, mesh: Mesh) -> None:
    """pipeline.microbatches=0 (auto) resolved in `cfg` for `mesh` (config_checks.pipeline_microbatches:
    the most, up to 4 per stage, that split each batch shard's sequences), so that config.json and
    the run's first line record what ran."""
    from maxtext_rocm.config import global_batch_size
    from maxtext_rocm.parallel.sharding import mesh_axes_of

    stages = mesh.shape.get(STAGE_AXIS, 1)
    if stages <= 1 or cfg.pipeline.microbatches:
        return
    shards = int(np.prod([mesh.shape[a] for a in mesh_axes_of("activation_batch")]))
    per_shard = global_batch_size(cfg, mesh.size) // cfg.train.grad_accum // shards
    cfg.pipeline.microbatches = pipeline_microbatches(cfg.pipeline, stages, max(1, per_shard))


def _resolved(pipeline_cfg) -> int:
    if not pipeline_cfg.microbatches:
        raise ValueError("pipeline.microbatches=0 (auto) must be resolved for the mesh first (resolve_microbatches)")
    return pipeline_cfg.microbatches


def split_microbatches(x: Array, n: int) -> Array:
    """[B, ...] -> [n, B/n, ...], every n-th row: each microbatch keeps every batch shard's share
    (as step.split_micro_batches does), so splitting moves no data."""
    return jnp.swapaxes(x.reshape(x.shape[0] // n, n, *x.shape[1:]), 0, 1)


def merge_microbatches(x: Array) -> Array:
    """The inverse of split_microbatches."""
    return jnp.swapaxes(x, 0, 1).reshape(x.shape[0] * x.shape[1], *x.shape[2:])


def _shift(state: Array, first_stage_input: Array, mesh: Mesh) -> Array:
    """Each stage's output to the next stage; stage 0 takes its row of `first_stage_input` [S, ...]
    instead. s to s + 1 only: GPipe needs no rotation, which would also send the last stage's
    output back to stage 0 for nothing."""
    shifted = _permute(state, mesh, [(s, s + 1) for s in range(state.shape[0] - 1)])
    return jnp.where(_is_first(state), first_stage_input, shifted)


def _permute(state: Array, mesh: Mesh, pairs: list[tuple[int, int]]) -> Array:
    """`state` [S, ...] (sharded over `stage`) sent from stage a to stage b for each (a, b) of
    `pairs`; a stage no pair sends to gets zeros. An explicit ppermute, manual over `stage` alone
    (the other axes stay GSPMD's): the same shift written as a slice-and-concatenate along the
    sharded axis was lowered as an all-to-all over `stage`."""
    def local(block):  # block: this stage's [1, ...]
        return jax.lax.ppermute(block, STAGE_AXIS, pairs)
    return jax.shard_map(local, mesh=mesh, in_specs=P(STAGE_AXIS), out_specs=P(STAGE_AXIS),
                         axis_names=frozenset({STAGE_AXIS}))(state)


def _from_stage(stacked: Array, stage: int, mesh: Mesh) -> Array:
    """stacked[stage] on every stage, for `stacked` [S, ...] sharded over `stage`: one all-reduce
    of what that stage holds (the others add zeros), whose transpose moves nothing (each stage
    keeps the cotangent of its own copy). Indexing the sharded axis instead was lowered as a
    permute to stage 0 and an all-reduce forward, and a permute back for the cotangent.
    In at least fp32: XLA:CPU (jax 0.10.2) aborts compiling a 16-bit all-reduce whose reducer jax
    wraps in a sharding constraint, as it does under a partial-manual shard_map ("Invalid binary
    instruction opcode copy" in AllReducePromotion). Once per step; the CPU count is unchanged (it
    shows bf16 collectives as f32 anyway), a GPU sends this one broadcast at twice bf16's bytes."""
    def local(block):  # block: this stage's [1, ...]
        mine = jax.lax.axis_index(STAGE_AXIS) == stage
        wide = block[0].astype(jnp.promote_types(block.dtype, jnp.float32))
        return jax.lax.psum(jnp.where(mine, wide, jnp.zeros_like(wide)), STAGE_AXIS).astype(block.dtype)
    return jax.shard_map(local, mesh=mesh, in_specs=P(STAGE_AXIS), out_specs=P(),
                         axis_names=frozenset({STAGE_AXIS}))(stacked)


def _is_first(state: Array) -> Array:
    return (jnp.arange(state.shape[0]) == 0).reshape(-1, *(1,) * (state.ndim - 1))


def _schedule(stack: nn.Module, scanned: Callable, x: Array, positions: Array, segment_ids: Array | None, *,
              layout: StackLayout, microbatches: int, mesh: Mesh):
    variables = dict(stack.variables)
    extra = set(variables) - {"params", FP8_COLLECTION}
    if extra:
        raise ConfigError(f"the pipeline cannot carry the layers' {', '.join(sorted(extra))} state yet; "
                          "use mesh stage=1")
    S, R, K, M = layout.stages, layout.repeats, layout.per_chunk, microbatches
    n_iterations = R * M + S - 1
    # Storage [S R K, ...] -> [S, R, K, ...]: device s holds its R chunks, its own shard (a reshape
    # of the sharded axis; no data moves). Without padding or repeats storage is model order.
    stored = jax.tree_util.tree_map(lambda p: p.reshape(S, R, K, *p.shape[1:]), variables)
    params, fp8_state = stored["params"], stored.get(FP8_COLLECTION)
    # fp8 delayed scaling: one copy of the state per iteration, so that each use's update (its
    # cotangent) stays apart and the real ones combine as grad_accum's micro-batches do.
    fp8_per_iteration = None if fp8_state is None else _fan_out(fp8_state, _uses(layout, M))
    real = jnp.asarray(layout.real)
    padded = bool(layout.empty)
    chunk_module = scanned(1 if padded else K, parent=None)

    def run_chunk(chunk_vars, chunk_real, h, pos, seg):
        if not padded:
            (h, _), sown = chunk_module.apply(chunk_vars, h, pos, seg, mutable=[AUX_LOSSES])
            return h, sown

        def slot(h, slot_in):  # one layer; an empty slot passes h through (its zeros get zero gradient)
            v, is_real = slot_in
            if FP8_COLLECTION in v:  # an empty slot's zero scales would divide by zero
                v = {**v, FP8_COLLECTION: jax.tree_util.tree_map(
                    lambda a: jnp.where(is_real, a, jnp.ones_like(a)), v[FP8_COLLECTION])}
            (out, _), sown = chunk_module.apply(jax.tree_util.tree_map(lambda a: a[None], v),
                                                h, pos, seg, mutable=[AUX_LOSSES])
            return jnp.where(is_real, out, h), jax.tree_util.tree_map(lambda a: a[0], sown)
        return jax.lax.scan(slot, h, (chunk_vars, chunk_real))

    def run_stage(stage_vars, stage_real, repeat, h, pos, seg):
        # The chunk of this repeat: an index into the device's own [R, ...] block. With one repeat
        # the index is static: a slice that varies with the iteration would be a new value in
        # each, which the loop's autodiff saves once per iteration (M + S - 1 copies of the
        # stage's weights: 70B on 4 stages, 161 GiB of XLA buffers instead of 106); a static one
        # of the loop-invariant weights is saved once. Circular's repeat does vary, so it still
        # pays that (its chunk, 1/R of the stage's weights, per iteration; docs/parallelism.md).
        if R == 1:
            pick = functools.partial(jax.lax.index_in_dim, index=0, keepdims=False)
        else:
            pick = functools.partial(jax.lax.dynamic_index_in_dim, index=repeat, keepdims=False)
        return run_chunk(jax.tree_util.tree_map(pick, stage_vars), pick(stage_real), h, pos, seg)

    all_stages = jax.vmap(run_stage, spmd_axis_name=STAGE_AXIS)
    state_axes = ("activation_stage",) + BLOCK_OUTPUT_AXES
    token_axes = ("activation_stage", "activation_batch", "activation_length")

    inputs, pos_in, seg_in = (None if a is None else split_microbatches(a, M) for a in (x, positions, segment_ids))
    stage_ids = jnp.arange(S)
    # A copy of the inputs per stage, sharded over `stage` (each device already holds all of them):
    # stage 0's use of its copy in the loop is local, and the cotangent (its transpose, a sum over
    # the copies) is one all-reduce after the loop rather than one per iteration, the bubble's too.
    staged = nn.with_logical_constraint(jnp.broadcast_to(inputs[None], (S, *inputs.shape)),
                                        ("activation_stage", None) + BLOCK_OUTPUT_AXES)

    def iteration(carry, xs):
        out, circling = carry
        t, fp8_now = xs
        # Stage s works on pass i = t - s: microbatch i mod M of repeat i // M (clamped in the
        # bubble, whose results are dropped and so get no cotangent).
        work = jnp.clip(t - stage_ids, 0, R * M - 1)
        micro, repeat = work % M, work // M
        fresh = jax.lax.dynamic_index_in_dim(staged, jnp.minimum(t, M - 1), axis=1, keepdims=False)
        if R == 1:
            h = _shift(out, fresh, mesh)
        else:
            # A rotation: stage S-1's output goes on to stage 0 for its next repeat, through a
            # buffer (every stage keeps its own copy; only stage 0's is read) that holds it the
            # M - S iterations until stage 0 is free for it.
            rotated = _permute(out, mesh, [(s, (s + 1) % S) for s in range(S)])
            circling = jax.lax.dynamic_update_index_in_dim(circling, rotated, (t - S) % M, axis=1)
            again = jax.lax.dynamic_index_in_dim(circling, t % M, axis=1, keepdims=False)
            h = jnp.where(_is_first(rotated), jnp.where(t < M, fresh, again), rotated)
        h = nn.with_logical_constraint(h, state_axes)
        # Positions and segments are indexed per stage from the inputs every stage holds.
        pos = nn.with_logical_constraint(jnp.take(pos_in, micro, axis=0), token_axes)
        seg = None if seg_in is None else nn.with_logical_constraint(jnp.take(seg_in, micro, axis=0), token_axes)
        stage_vars = {"params": params} if fp8_now is None else {"params": params, FP8_COLLECTION: fp8_now}
        out, sown = all_stages(stage_vars, real, repeat, h, pos, seg)
        out = nn.with_logical_constraint(out, state_axes)
        # Every stage's output, kept where it is (stage-sharded): reading out[-1] here instead made
        # GSPMD send the last stage's output to every stage in every iteration, the bubble's too.
        return (out, circling), (out if R == 1 else None, sown)

    circling = None if R == 1 else jnp.zeros((S, M, *inputs.shape[1:]), inputs.dtype)
    (out, circling), (every_stage, sown) = jax.lax.scan(
        iteration, (jnp.zeros((S, *inputs.shape[1:]), inputs.dtype), circling),
        (jnp.arange(n_iterations), fp8_per_iteration))
    if R == 1:  # the last stage finishes microbatch m in iteration m + S - 1: moved off it once, here
        y = _from_stage(jnp.swapaxes(every_stage[S - 1:], 0, 1), S - 1, mesh)
    else:  # the last repeat's outputs, stored as if for one more: stage 0's copy of the buffer
        y = _from_stage(jax.lax.dynamic_update_index_in_dim(circling, _permute(out, mesh, [(S - 1, 0)]),
                                                            (n_iterations - S) % M, axis=1), 0, mesh)
    y = nn.with_logical_constraint(merge_microbatches(y), BLOCK_OUTPUT_AXES)
    return y, {AUX_LOSSES: jax.tree_util.tree_map(functools.partial(_real_work, layout, M), sown)}


def _real_work(layout: StackLayout, microbatches: int, leaf: Array) -> Array:
    """[iterations, S, K, ...] -> [M L, ...]: what each layer computed for each microbatch (the
    bubble's iterations and the empty slots dropped), whose mean is the one device's."""
    S, R, K = layout.stages, layout.repeats, layout.per_chunk
    t, s, k = np.meshgrid(np.arange(R * microbatches + S - 1), np.arange(S), np.arange(K), indexing="ij")
    work = t - s
    in_time = (work >= 0) & (work < R * microbatches)
    keep = in_time & layout.real[s, np.clip(work, 0, R * microbatches - 1) // microbatches, k]
    flat = leaf.reshape(-1, *leaf.shape[3:])
    return jnp.take(flat, np.flatnonzero(keep.reshape(-1)), axis=0)


def _uses(layout: StackLayout, microbatches: int) -> np.ndarray:
    """[iterations, S, R, K]: whether slot k of chunk r on device s runs a real layer on a real
    microbatch in that iteration."""
    S, R, K = layout.stages, layout.repeats, layout.per_chunk
    t, s = np.meshgrid(np.arange(R * microbatches + S - 1), np.arange(S), indexing="ij")
    work = t - s
    in_time = (work >= 0) & (work < R * microbatches)
    repeat = np.clip(work, 0, R * microbatches - 1) // microbatches
    uses = in_time[:, :, None] & (repeat[:, :, None] == np.arange(R)[None, None, :])
    return uses[..., None] & layout.real[None]


def _fan_out(state, uses: np.ndarray):
    """`state` [S, R, K, ...] repeated once per iteration. Backward, each slot's cotangents (fp8.py:
    the updated scale and amax history of each use) combine over its real uses only, as
    fp8.combine_updates merges micro-batches; a slot with none keeps its state."""
    iterations = uses.shape[0]

    @jax.custom_vjp
    def fan(tree):
        return jax.tree_util.tree_map(lambda a: jnp.broadcast_to(a, (iterations, *a.shape)), tree)

    def forward(tree):
        return fan(tree), tree

    def backward(tree, cotangent):
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
