"""pipeline.schedule="gpipe_recompute": the pipeline's backward written by hand, one microbatch's stage at a
time, so that a stage's saved activations are one stage input per microbatch plus the layer
residuals of the one microbatch it is differentiating, not every microbatch's (legend: __init__.py).

GPipe's backward is the loop's autodiff: every iteration keeps what model.remat lets its K layers
keep, M + S - 1 times per stage (the bubble's iterations too). Here the loop is a `custom_vjp`:

- forward: GPipe's M + S - 1 iterations, not differentiated, keeping each stage's input [mb, seq, d]
  per microbatch ([S, M, mb, seq, d], stage-sharded: M x mb = the batch shard, one activation) and
  the last stage's outputs;
- backward: the same iterations in reverse, stage s taking microbatch t - s: it recomputes its
  stage forward from the saved input (activation checkpointing at stage granularity) inside a
  `jax.vjp`, pulls back the cotangent that the stage after it sent in the previous iteration (the
  last stage: the stack output's), adds the weights' cotangent to a running sum, and sends its
  input's cotangent one stage up (a collective-permute s + 1 -> s). Only that one vjp's residuals
  are live at a time, whatever M is.

Why not 1F1B's interleaving of forwards and backwards: the head and loss run after the stack, on the
whole batch, so no microbatch's cotangent exists before every microbatch's forward has finished.
Interleaving would not save memory here (the stack's input and output stay whole either way) and
would cost a third forward. What the name promises and this keeps: GPipe's bubble (S-1)/(M+S-1),
and per stage O(S) layer residuals (here one microbatch's) instead of O(M). What it costs: one
more forward of the stack per step (the stage recompute); model.remat="none" is the natural
choice under it, the stage checkpoint doing remat's work.

fp8 delayed state and router losses work as under GPipe: each iteration's vjp returns that
iteration's fp8 state cotangents (the updates), stacked per iteration for real_work.fan_out, and the
sown losses' cotangents arrive per iteration and stage as the forward returned them.
"""

from __future__ import annotations

import functools
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import linen as nn

from maxtext_rocm.models.llama import BLOCK_OUTPUT_AXES
from maxtext_rocm.numerics.fp8 import FP8_COLLECTION
from maxtext_rocm.parallel.pipeline.axes import STAGE_AXIS, STATE_AXES, TOKEN_AXES
from maxtext_rocm.parallel.pipeline.microbatches import merge_microbatches, split_microbatches
from maxtext_rocm.parallel.pipeline.schedules import Schedule
from maxtext_rocm.parallel.pipeline.transfers import from_stage, is_first, permute, shift

Array = jax.Array
SAVED_AXES = ("activation_stage", None) + BLOCK_OUTPUT_AXES  # [S, M, mb, seq, d]: one row per stage


def loop(schedule: Schedule, run_stage: Callable, params, fp8_per_iteration, real: Array,
         staged: Array, positions: Array, segment_ids: Array | None, by_stage: bool = False):
    """loop.run_loop's contract (y [B, seq, d], sown [iterations, S, K, ...]; `by_stage`: y as the
    stages hold it) with the backward of this module's docstring. `run_stage(stage_vars,
    stage_real, repeat, h, pos, seg)` is one stage's work, unvmapped. `staged` [S, M, mb, seq, d]:
    each stage's own lookup (embedding.embedded_per_stage); the backward's cotangent of it (stage
    0's row) stays on stage 0, in the table's gradient."""
    stages, microbatches = schedule.stages, schedule.microbatches
    pos_in, seg_in = (None if a is None else split_microbatches(a, microbatches) for a in (positions, segment_ids))
    stack = _differentiable_stack(schedule, run_stage, real)
    outs, sown = stack(params, fp8_per_iteration, staged, pos_in, seg_in)
    if by_stage:  # [S, M, mb, seq, d], the last stage's row the outputs
        return outs, sown
    y = from_stage(outs, stages - 1, schedule.mesh)  # the last stage's row, on every stage
    return nn.with_logical_constraint(merge_microbatches(y), BLOCK_OUTPUT_AXES), sown


def _differentiable_stack(schedule: Schedule, run_stage: Callable, real: Array) -> Callable:
    """stack(params, fp8_per_iteration, staged, pos_in, seg_in) -> (outs [S, M, mb, seq, d] whose
    row S - 1 is the stack's output, sown [iterations, S, K, ...]), with the hand-scheduled backward."""
    order = _RecomputeOrder(schedule, run_stage, real)
    # The backward is traced when the step is differentiated, outside any rules context the
    # forward ran in (gather.per_batch_shard's): it resolves logical axes as the forward did.
    rules = nn.get_logical_axis_rules()

    @jax.custom_vjp
    def stack(params, fp8_per_iteration, staged, pos_in, seg_in):
        saved_out, sown, _ = order.forward(params, fp8_per_iteration, staged, pos_in, seg_in)
        return saved_out, sown

    def stack_forward(params, fp8_per_iteration, staged, pos_in, seg_in):
        saved_out, sown, saved_in = order.forward(params, fp8_per_iteration, staged, pos_in, seg_in)
        return (saved_out, sown), (params, fp8_per_iteration, saved_in, pos_in, seg_in)

    def stack_backward(residuals, cotangents):
        params, fp8_per_iteration, saved_in, pos_in, seg_in = residuals
        d_outs, d_sown = cotangents
        with nn.logical_axis_rules(rules):
            d_params, d_fp8, d_staged = order.backward(params, fp8_per_iteration, saved_in, pos_in, seg_in,
                                                       d_outs, d_sown)
        return d_params, d_fp8, d_staged, None, None  # positions and segments: integers

    stack.defvjp(stack_forward, stack_backward)
    return stack


class _RecomputeOrder:
    """GPipe's iterations for `schedule`, forward (`forward`) and in reverse with each stage's
    forward recomputed (`backward`); `run_stage` one stage's work, `real` [S, R, K]."""

    def __init__(self, schedule: Schedule, run_stage: Callable, real: Array):
        self.schedule, self.real, self.mesh = schedule, real, schedule.mesh
        self.stages, self.microbatches = schedule.stages, schedule.microbatches
        # a constant, not a value traced with the forward (which the backward closes over)
        self.stage_ids = np.arange(self.stages)

        def one_stage(stage_vars, stage_real, h, pos, seg):
            return run_stage(stage_vars, stage_real, 0, h, pos, seg)  # GPipe: each device's one chunk

        self.all_stages = jax.vmap(one_stage, spmd_axis_name=STAGE_AXIS)
        self.all_vjps = jax.vmap(functools.partial(_stage_vjp, one_stage), spmd_axis_name=STAGE_AXIS)
        self.per_stage_read = jax.vmap(read_row, spmd_axis_name=STAGE_AXIS)
        self.per_stage_write = jax.vmap(write_row, spmd_axis_name=STAGE_AXIS)

    def at(self, t):
        """Each stage's microbatch in iteration t (clamped in the bubble) and whether it is real."""
        work = t - self.stage_ids
        return jnp.clip(work, 0, self.microbatches - 1), (work >= 0) & (work < self.microbatches)

    @staticmethod
    def tokens(pos_in, seg_in, micro):
        pos = nn.with_logical_constraint(jnp.take(pos_in, micro, axis=0), TOKEN_AXES)
        seg = None if seg_in is None else nn.with_logical_constraint(jnp.take(seg_in, micro, axis=0), TOKEN_AXES)
        return pos, seg

    @staticmethod
    def variables(params, fp8_now):
        return {"params": params} if fp8_now is None else {"params": params, FP8_COLLECTION: fp8_now}

    def forward(self, params, fp8_per_iteration, staged, pos_in, seg_in):
        """GPipe's iterations, keeping each stage's input and output per microbatch (not per
        iteration: the bubble's are not written). Returns (outputs, sown, inputs)."""
        def iteration(carry, xs):
            out, saved_in, saved_out = carry
            t, fp8_now = xs
            micro, real_work = self.at(t)
            fresh = jax.lax.dynamic_index_in_dim(staged, jnp.minimum(t, self.microbatches - 1), axis=1,
                                                 keepdims=False)
            h = nn.with_logical_constraint(shift(out, fresh, self.mesh), STATE_AXES)
            out, sown = self.all_stages(self.variables(params, fp8_now), self.real, h,
                                        *self.tokens(pos_in, seg_in, micro))
            out = nn.with_logical_constraint(out, STATE_AXES)
            saved_in = self.per_stage_write(saved_in, h, micro, real_work)
            saved_out = self.per_stage_write(saved_out, out, micro, real_work)
            return (out, saved_in, saved_out), sown

        empty = nn.with_logical_constraint(jnp.zeros_like(staged), SAVED_AXES)
        first = (jnp.zeros((self.stages, *staged.shape[2:]), staged.dtype), empty, empty)
        (_, saved_in, saved_out), sown = jax.lax.scan(
            iteration, first, (jnp.arange(self.schedule.n_iterations), fp8_per_iteration))
        return saved_out, sown, saved_in

    def backward(self, params, fp8_per_iteration, saved_in, pos_in, seg_in, d_outs, d_sown):
        """The forward's iterations in reverse: stage s differentiates microbatch t - s. Returns
        (the weights' cotangent, the fp8 state's per iteration, the stage inputs' [S, M, ...])."""
        stages = self.stages

        def iteration(carry, xs):
            d_from_below, d_params = carry  # each stage's input cotangent of the previous iteration
            t, fp8_now, d_sown_now = xs
            micro, real_work = self.at(t)
            # The last stage's output cotangent comes from the stack's; each other stage's from the
            # stage after it, which took this microbatch's backward one iteration earlier.
            from_next = permute(d_from_below, self.mesh, [(s + 1, s) for s in range(stages - 1)])
            is_last = (self.stage_ids == stages - 1).reshape(-1, *(1,) * (from_next.ndim - 1))
            d_out = jnp.where(is_last, self.per_stage_read(d_outs, micro), from_next)
            mask = real_work.reshape(is_last.shape)
            d_out = nn.with_logical_constraint(jnp.where(mask, d_out, jnp.zeros_like(d_out)), STATE_AXES)
            h = nn.with_logical_constraint(self.per_stage_read(saved_in, micro), STATE_AXES)
            d_vars, d_h = self.all_vjps(self.variables(params, fp8_now), self.real, h,
                                        *self.tokens(pos_in, seg_in, micro), d_out, d_sown_now)
            d_h = nn.with_logical_constraint(d_h, STATE_AXES)
            d_params = jax.tree_util.tree_map(jnp.add, d_params, d_vars["params"])
            return (d_h, d_params), (d_vars.get(FP8_COLLECTION), d_h)

        first = (jnp.zeros((stages, *saved_in.shape[2:]), saved_in.dtype),
                 jax.tree_util.tree_map(jnp.zeros_like, params))
        (_, d_params), (d_fp8, d_h) = jax.lax.scan(
            iteration, first, (jnp.arange(self.schedule.n_iterations), fp8_per_iteration, d_sown), reverse=True)
        # Stage 0 took microbatch t in iteration t; the other stages' rows are no input's cotangent.
        d_first = jnp.swapaxes(d_h[:self.microbatches], 0, 1)
        d_staged = jnp.where(is_first(d_first), d_first, jnp.zeros_like(d_first))
        return d_params, d_fp8, nn.with_logical_constraint(d_staged, SAVED_AXES)


def _stage_vjp(one_stage: Callable, stage_vars, stage_real, h, pos, seg, d_out, d_sown):
    """One stage's backward for one microbatch: its forward recomputed from the saved input `h`,
    pulled back from the output's cotangent `d_out` and the sown losses' `d_sown`. Returns
    (the variables' cotangents, h's)."""
    _, pull_back = jax.vjp(lambda v, x: one_stage(v, stage_real, x, pos, seg), stage_vars, h)
    return pull_back((d_out, d_sown))


def read_row(row: Array, micro: Array) -> Array:
    """One stage's [M, ...] row at its microbatch."""
    return jax.lax.dynamic_index_in_dim(row, micro, axis=0, keepdims=False)


def write_row(row: Array, value: Array, micro: Array, real_work: Array) -> Array:
    """One stage's [M, ...] row with `value` at its microbatch, where that work is real (the
    bubble's clamped index would overwrite a real microbatch's)."""
    return jax.lax.dynamic_update_index_in_dim(row, jnp.where(real_work, value, read_row(row, micro)), micro, axis=0)
