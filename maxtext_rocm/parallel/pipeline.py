"""Pipeline parallelism over the `stage` mesh axis: the scanned layer stack split into contiguous
stages, the batch into microbatches that flow through them (GPipe).

The parameters stay the stack's own [n_layers, ...] arrays; sharding.py maps their "layers" axis
to `stage`, so device group s holds layers [s L/S, (s+1) L/S) and the tree, hence a checkpoint, is
the same at every stage count. Here they are viewed as [S, L/S, ...] (a reshape of the sharded
axis, no data moves) and the S stages run as one vmapped stage function whose vmapped axis is
sharded over `stage` (`spmd_axis_name`): every logical constraint inside the layers keeps its
meaning, with the stage axis in front, so the pipeline composes with fsdp, tensor, expert and
sequence sharding as the unpipelined stack does.

The schedule is a loop of M + S - 1 iterations over a state [S, microbatch, seq, d]: stage 0 takes
microbatch t, every stage runs its layers on what it holds, and the outputs shift one stage on
(a collective-permute between neighbouring stage groups: activations are all that cross them).
Stage s is busy for M of the iterations; the rest, (S-1)/(M+S-1) of the time, is the bubble, in
which it computes on zeros or a repeated microbatch whose results are dropped (they get no
cotangent, so gradients are exact). The backward pass is the loop's autodiff: all forwards, then
all backwards, GPipe's order; each layer keeps what model.remat lets it keep, per microbatch.

Router losses the MoE layers sow come back per iteration and stage; only the iterations in which a
stage held a real microbatch are kept, so the mean over them is the mean over (microbatch, layer):
the value train.grad_accum = M would give on one device. fp8 delayed scaling is refused by the
config checks (the amax history would see each layer M times per step and the bubble's zeros).
"""

from __future__ import annotations

import functools
from typing import Callable

import jax
import jax.numpy as jnp
from flax import linen as nn
from jax.sharding import Mesh

from maxtext_rocm.config_checks import pipeline_microbatches
from maxtext_rocm.errors import ConfigError
from maxtext_rocm.models.llama import BLOCK_OUTPUT_AXES
from maxtext_rocm.models.moe import AUX_LOSSES

Array = jax.Array
STAGE_AXIS = "stage"  # the mesh axis; "activation_stage" is its logical name (sharding.py)


def bubble_fraction(schedule: str, stages: int, microbatches: int, repeats: int = 1) -> float:
    """The share of a step each stage idles. GPipe: (S-1)/(M+S-1). A circular schedule of R
    virtual stages per device would take (S-1)/(R M + S-1): each pass over the devices is 1/R as long."""
    if schedule == "gpipe":
        return (stages - 1) / (microbatches + stages - 1)
    return (stages - 1) / (repeats * microbatches + stages - 1)


def describe(pipeline_cfg, stages: int) -> str:
    """One phrase for the run's description: schedule, microbatches, bubble."""
    if stages <= 1:
        return "pipeline off"
    m = pipeline_microbatches(pipeline_cfg, stages)
    bubble = bubble_fraction(pipeline_cfg.schedule, stages, m, pipeline_cfg.repeats)
    formula = "(S-1)/(M+S-1)" if pipeline_cfg.schedule == "gpipe" else "(S-1)/(R M+S-1)"
    return (f"pipeline {pipeline_cfg.schedule}: {stages} stages, {m} microbatches, "
            f"bubble {bubble:.1%} = {formula}")


def layer_stack(pipeline_cfg, model_cfg, mesh: Mesh) -> Callable | None:
    """The Decoder's `layer_stack` strategy for `mesh` (models/llama.py), or None where the mesh
    has one stage and the layers run in order on every device."""
    stages = mesh.shape.get(STAGE_AXIS, 1)
    if stages <= 1:
        return None
    if model_cfg.n_layers % stages:
        raise ConfigError(f"model.n_layers={model_cfg.n_layers} does not divide into mesh stage={stages} stages")
    return functools.partial(_gpipe, stages=stages, microbatches=pipeline_microbatches(pipeline_cfg, stages))


def split_microbatches(x: Array, n: int) -> Array:
    """[B, ...] -> [n, B/n, ...], every n-th row: each microbatch keeps every batch shard's share
    (as step.split_micro_batches does), so splitting moves no data."""
    return jnp.swapaxes(x.reshape(x.shape[0] // n, n, *x.shape[1:]), 0, 1)


def merge_microbatches(x: Array) -> Array:
    """The inverse of split_microbatches."""
    return jnp.swapaxes(x, 0, 1).reshape(x.shape[0] * x.shape[1], *x.shape[2:])


def _shift(tree, first_stage_input):
    """Each stage's output to the next stage; stage 0 takes `first_stage_input` instead. The
    slice-and-concatenate along the stage-sharded axis is a collective-permute in the HLO, s to
    s + 1 only: a rotation would also send the last stage's output back to stage 0 for nothing."""
    def one(state, new):
        if state is None:
            return None
        shifted = jnp.concatenate([jnp.zeros_like(state[:1]), state[:-1]], axis=0)
        is_first = (jnp.arange(state.shape[0]) == 0).reshape(-1, *(1,) * (state.ndim - 1))
        return jnp.where(is_first, new[None], shifted)
    return jax.tree_util.tree_map(one, tree, first_stage_input, is_leaf=lambda v: v is None)


def _gpipe(stack: nn.Module, scanned: Callable, x: Array, positions: Array, segment_ids: Array | None, *,
           stages: int, microbatches: int):
    variables = stack.variables
    extra = set(variables) - {"params"}
    if extra:  # e.g. fp8 delayed scaling state; the config checks refuse it before this
        raise ConfigError(f"the pipeline cannot carry the layers' {', '.join(sorted(extra))} state yet; "
                          "use mesh stage=1 for this precision policy")
    n_layers = jax.tree_util.tree_leaves(variables["params"])[0].shape[0]
    per_stage = n_layers // stages
    # [L, ...] -> [S, L/S, ...]: stage s holds layers s*L/S .. (s+1)*L/S - 1, its own shard.
    params = jax.tree_util.tree_map(lambda p: p.reshape(stages, per_stage, *p.shape[1:]), variables["params"])
    stage_module = scanned(per_stage, parent=None)

    def run_stage(stage_params, h, pos, seg):
        (h, _), sown = stage_module.apply({"params": stage_params}, h, pos, seg, mutable=[AUX_LOSSES])
        return h, sown

    all_stages = jax.vmap(run_stage, spmd_axis_name=STAGE_AXIS)
    state_axes = ("activation_stage",) + BLOCK_OUTPUT_AXES
    token_axes = ("activation_stage", "activation_batch", "activation_length")

    inputs = jax.tree_util.tree_map(lambda a: split_microbatches(a, microbatches), (x, positions, segment_ids))

    def iteration(carry, t):
        # Past the last microbatch stage 0 takes the last one again; its results are dropped.
        new = jax.tree_util.tree_map(lambda a: jax.lax.dynamic_index_in_dim(
            a, jnp.minimum(t, microbatches - 1), keepdims=False), inputs)
        h, pos, seg = _shift(carry, new)
        h = nn.with_logical_constraint(h, state_axes)
        pos = nn.with_logical_constraint(pos, token_axes)
        if seg is not None:
            seg = nn.with_logical_constraint(seg, token_axes)
        out, sown = all_stages(params, h, pos, seg)
        out = nn.with_logical_constraint(out, state_axes)
        return (out, pos, seg), (out[-1], sown)

    def zeros(a):
        return None if a is None else jnp.zeros((stages, *a.shape[1:]), a.dtype)

    start = jax.tree_util.tree_map(zeros, inputs, is_leaf=lambda v: v is None)
    n_iterations = microbatches + stages - 1
    _, (last_stage, sown) = jax.lax.scan(iteration, start, jnp.arange(n_iterations))
    # The last stage finishes microbatch m in iteration m + S - 1.
    y = merge_microbatches(last_stage[stages - 1:])
    y = nn.with_logical_constraint(y, BLOCK_OUTPUT_AXES)
    return y, {AUX_LOSSES: jax.tree_util.tree_map(functools.partial(_real_work, stages, microbatches), sown)}


def _real_work(stages: int, microbatches: int, leaf: Array) -> Array:
    """[iterations, S, ...] -> [M, S, ...]: what stage s computed in iterations s .. s+M-1, the
    ones in which it held microbatches 0 .. M-1 (the bubble's are dropped)."""
    index = jnp.arange(microbatches)[:, None] + jnp.arange(stages)[None, :]
    index = index.reshape(microbatches, stages, *(1,) * (leaf.ndim - 2))
    return jnp.take_along_axis(leaf, index, axis=0)
