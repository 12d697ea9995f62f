"""The loop GPipe and Circular share (`run_loop`: schedules.py says where they differ), and the
Decoder's `layer_stack` strategy that runs it (`Pipelined`; legend: __init__.py).

Each of the loop's R M + S - 1 iterations takes each stage's input (stage 0 a fresh microbatch or,
under circular, one coming round again) and runs every stage's chunk on it, vmapped over the
stages. GSPMD gathers a stage's fsdp-sharded weights where the loop's body uses them, in every
iteration; pipeline.weight_gather="once" gathers them before the loop instead (gather.py). Work a
stage does in the bubble (on zeros or a repeated microbatch) is dropped and gets no cotangent, so
gradients are exact. The backward pass is the loop's autodiff: all forwards, then all
backwards; each layer keeps what model.remat lets it keep, per microbatch. pipeline.schedule="gpipe_recompute" runs GPipe's order with a hand-written backward instead
(gpipe_recompute.loop, this loop's contract).

Where the step's objective is the fused LM loss (layout.loss_on_the_last_stage), the Decoder hands
the strategy its Tail (final norm, head, loss) and the loop's outputs stay where the last stage
made them: the tail runs there (tail.py), not on every stage after the outputs went to each
(transfers.from_stage, which circular and the other objectives still use).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable

import jax
import jax.numpy as jnp
from flax import linen as nn
from jax.sharding import Mesh

from maxtext_rocm.models.llama import BLOCK_OUTPUT_AXES, Tail, TokenEmbedding
from maxtext_rocm.models.moe import AUX_LOSSES
from maxtext_rocm.numerics.fp8 import FP8_COLLECTION
from maxtext_rocm.parallel.pipeline.axes import STAGE_AXIS, STATE_AXES, TOKEN_AXES
from maxtext_rocm.parallel.pipeline.embedding import embedded_per_stage
from maxtext_rocm.parallel.pipeline.gather import GatheredOnce, per_batch_shard
from maxtext_rocm.parallel.pipeline.layout import ends_on_their_stages, loss_on_the_last_stage
from maxtext_rocm.parallel.pipeline.microbatches import merge_microbatches, split_microbatches
from maxtext_rocm.parallel.pipeline.real_work import fan_out, real_uses, real_work
from maxtext_rocm.parallel.pipeline.schedules import Schedule, schedule_for
from maxtext_rocm.parallel.pipeline.stages import run_picked_chunk, stage_stack
from maxtext_rocm.parallel.pipeline.tail import TailOnLastStage, objective_on_the_last_stage
from maxtext_rocm.parallel.sharding import present_axes

Array = jax.Array


def layer_stack(cfg, mesh: Mesh, loop: Callable | None = None) -> "Pipelined | None":
    """The Decoder's `layer_stack` strategy for `mesh` (models/llama.py), or None where the mesh
    has one stage and the layers run in order on every device. `loop`: another loop for `run_loop`'s
    contract (gpipe_recompute.loop under pipeline.schedule="gpipe_recompute"); None: `run_loop`."""
    schedule = schedule_for(cfg.pipeline, cfg.model, mesh)
    if schedule is None:
        return None
    ends = ends_on_their_stages(cfg, mesh)
    return Pipelined(schedule, loop, gather_once=cfg.pipeline.weight_gather == "once",
                     reduce_once=cfg.pipeline.gradient_reduce == "once", table_on_its_stage=ends.table,
                     head_on_its_stage=ends.head, runs_the_loss=loss_on_the_last_stage(cfg))


@dataclasses.dataclass(frozen=True)
class Pipelined:
    """`pipelined` with its settings, as the Decoder calls a `layer_stack`; `runs_the_loss`: the
    Decoder hands it its `Tail` (the final norm, the head, the fused loss), which runs on the last
    stage after the loop (layout.loss_on_the_last_stage says where)."""

    schedule: "Schedule"
    loop: Callable | None = None
    gather_once: bool = False
    reduce_once: bool = False
    table_on_its_stage: bool = False
    head_on_its_stage: bool = False
    runs_the_loss: bool = False

    def __call__(self, layers: nn.Module, make_layers: Callable, embedding: TokenEmbedding, tokens: Array,
                 positions: Array, segment_ids: Array | None, *, tail: Tail | None = None):
        return pipelined(layers, make_layers, embedding, tokens, positions, segment_ids, schedule=self.schedule,
                         loop=self.loop, gather_once=self.gather_once, reduce_once=self.reduce_once,
                         table_on_its_stage=self.table_on_its_stage, tail=tail,
                         head_on_its_stage=self.head_on_its_stage)


def pipelined(layers: nn.Module, make_layers: Callable, embedding: TokenEmbedding, tokens: Array, positions: Array,
              segment_ids: Array | None, *, schedule: Schedule, loop: Callable | None = None,
              gather_once: bool = False, reduce_once: bool = False, table_on_its_stage: bool = False,
              tail: Tail | None = None, head_on_its_stage: bool = False):
    """The Decoder's `layer_stack` strategy: the bound scanned layers `layers` (whose variables are
    the stored [S R K, ...] arrays) run over the stages by `schedule` on `tokens` [B, seq] as
    `embedding` looks them up (on the stages: embedded_per_stage); `make_layers(length,
    parent=None)` makes an unbound scan of `length` layers to run each stage's chunk with.
    `loop`: run_loop's contract with another backward (gpipe_recompute.loop); None: run_loop.
    `gather_once`: the stages' weights gathered before the loop, not in it (gather.py);
    `reduce_once`: and their gradient reduced after it (gather.per_batch_shard).
    `table_on_its_stage`: the embedding table is stored [S, vocab, d_model], stage 0's row the
    table (layout.ends_on_their_stages).
    Returns (y, {AUX_LOSSES: what the real layers sowed on real microbatches}); with `tail`
    ((objective, sums), {AUX_LOSSES: ...}), the tail run on the last stage's outputs there
    (tail.objective_on_the_last_stage; `head_on_its_stage`: its head stored [S, ...])."""
    stack = stage_stack(layers, make_layers, schedule)
    layout, microbatches, params = schedule.layout, schedule.microbatches, stack.params
    # fp8 delayed scaling: one copy of the state per iteration, so that each use's update (its
    # cotangent) stays apart and the real ones combine as grad_accum's micro-batches do.
    fp8_per_iteration = None if stack.fp8_state is None else fan_out(stack.fp8_state, real_uses(layout, microbatches))
    staged = embedded_per_stage(embedding, tokens, layout.stages, microbatches, schedule.mesh,  # [S, M, mb, seq, d]
                                tables_per_stage=table_on_its_stage)
    gathered = (GatheredOnce.of(stack.chunk_layers, staged[0, 0], positions, segment_ids, schedule.mesh,
                                stack.first_chunk_args())
                if gather_once else None)
    if gathered is not None:
        params = gathered.before_loop(params)
    loop = loop or run_loop
    if reduce_once:  # each device sums its own gradient; nothing to ask of each iteration's
        loop = per_batch_shard(loop, schedule.mesh, present_axes(schedule.mesh, "activation_batch"))
        gathered = None
    run_stage = functools.partial(run_picked_chunk, stack.chunk_layers, stack.padded, schedule.pick_chunk, gathered)
    if tail is None:
        y, sown = loop(schedule, run_stage, params, fp8_per_iteration, stack.slots, staged, positions, segment_ids)
        return y, {AUX_LOSSES: jax.tree_util.tree_map(functools.partial(real_work, layout, microbatches), sown)}
    # The stack's outputs stay where the last stage made them; the tail runs there on them all.
    per_stage, sown = loop(schedule, run_stage, params, fp8_per_iteration, stack.slots, staged, positions,
                           segment_ids, by_stage=True)
    kept = {AUX_LOSSES: jax.tree_util.tree_map(functools.partial(real_work, layout, microbatches), sown)}
    y = nn.with_logical_constraint(jax.vmap(merge_microbatches)(per_stage), STATE_AXES)  # [S, B, seq, d]
    on_last = TailOnLastStage.of(tail, schedule.mesh, head_on_its_stage)
    objective, sums = objective_on_the_last_stage(on_last)(y, tail.variables, tail.rows)
    return (objective + tail.of_sown(kept), sums), kept


def run_loop(schedule: Schedule, run_stage: Callable, params, fp8_per_iteration, real: Array,
             staged: Array, positions: Array, segment_ids: Array | None, by_stage: bool = False):
    """The loop every schedule runs: `schedule.n_iterations` iterations, in each of which every
    stage takes its input (`schedule.stage_inputs`; stage 0 its row of `staged` [S, M, mb, seq, d],
    embedded_per_stage) and runs its chunk (`run_stage`, vmapped over the stages). Returns
    (y [B, seq, d], what the layers sowed [iterations, S, K, ...]); with `by_stage`, y as the
    stages hold it instead ([S, M, mb, seq, d], the last stage's row the outputs: GPipe's order)."""
    all_stages = jax.vmap(run_stage, spmd_axis_name=STAGE_AXIS)
    stages, microbatches = schedule.stages, schedule.microbatches
    passes = schedule.repeats * microbatches  # each microbatch once per repeat
    pos_in, seg_in = (None if a is None else split_microbatches(a, microbatches) for a in (positions, segment_ids))
    stage_ids = jnp.arange(stages)
    inputs = jax.ShapeDtypeStruct(staged.shape[1:], staged.dtype)  # [M, mb, seq, d], for shapes

    def iteration(carry, xs):
        """Carries (each stage's last output [S, mb, seq, d], the schedule's buffer); takes (t, the
        fp8 state's copy for this iteration or None); gives what `kept_per_iteration` keeps and
        what the layers sowed."""
        out, buffer = carry
        t, fp8_now = xs
        # Stage s works on pass i = t - s: microbatch i mod M of repeat i // M (clamped in the
        # bubble, whose results are dropped and so get no cotangent).
        work = jnp.clip(t - stage_ids, 0, passes - 1)
        micro, repeat = work % microbatches, work // microbatches
        fresh = jax.lax.dynamic_index_in_dim(staged, jnp.minimum(t, microbatches - 1), axis=1, keepdims=False)
        h, buffer = schedule.stage_inputs(out, buffer, fresh, t)
        h = nn.with_logical_constraint(h, STATE_AXES)
        # Positions and segments are indexed per stage from the inputs every stage holds.
        pos = nn.with_logical_constraint(jnp.take(pos_in, micro, axis=0), TOKEN_AXES)
        seg = None if seg_in is None else nn.with_logical_constraint(jnp.take(seg_in, micro, axis=0), TOKEN_AXES)
        stage_vars = {"params": params} if fp8_now is None else {"params": params, FP8_COLLECTION: fp8_now}
        out, sown = all_stages(stage_vars, real, repeat, h, pos, seg)
        out = nn.with_logical_constraint(out, STATE_AXES)
        # Every stage's output, kept where it is (stage-sharded): reading out[-1] here instead made
        # GSPMD send the last stage's output to every stage in every iteration, the bubble's too.
        return (out, buffer), (schedule.kept_per_iteration(out), sown)

    buffer = schedule.first_buffer(inputs)
    (out, buffer), (every_iteration, sown) = jax.lax.scan(
        iteration, (jnp.zeros((stages, *inputs.shape[1:]), inputs.dtype), buffer),
        (jnp.arange(schedule.n_iterations), fp8_per_iteration))
    if by_stage:
        return schedule.outputs_by_stage(out, buffer, every_iteration)[0], sown
    y = schedule.outputs(out, buffer, every_iteration)
    return nn.with_logical_constraint(merge_microbatches(y), BLOCK_OUTPUT_AXES), sown
