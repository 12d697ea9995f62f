"""Pipeline parallelism over the `stage` mesh axis: the scanned layers split over the stage
devices, the batch into microbatches that flow through them.

Legend, in shapes and formulas: S stages (devices along `stage`), R repeats (chunks of layers per
device), K slots per chunk (layers, empty ones included), M microbatches, L layers; t is the
loop's iteration and i = t - s the pass stage s works on in it (microbatch i mod M, repeat i // M).

Two schedules share one loop (`_loop`) and differ where a `Schedule` says so (pipeline.schedule
"gpipe_recompute" is GPipe's schedule with a hand-written backward: pipeline_recompute.py):

- `GPipe` (pipeline.schedule="gpipe"): device s runs layers [s L/S, (s+1) L/S). M + S - 1
  iterations; stage 0 takes microbatch t, every stage runs its layers on what it holds, and the
  outputs shift one stage on. Bubble (S-1)/(M+S-1).
- `Circular` (pipeline.schedule="circular", pipeline.repeats = R > 1): S R chunks, chunk v on
  device v mod S; each microbatch goes round the devices R times, R M + S - 1 iterations of 1/R
  the work each: bubble (S-1)/(R M+S-1). A circular schedule of one repeat is GPipe and runs as it.

The parameters are the layers' own stacked arrays, the "layers" axis sharded over `stage`
(sharding.py). Where model order is not what each device runs (circular) or the layers do not
divide (126 on 8 stages), the run stores them in its own order, empty slots included
(parallel/pipeline_layout.py); checkpoints keep model order. Here storage [S R K, ...] is viewed
as [S, R, K, ...] (a reshape of the sharded axis, no data moves) and the S stages run as one
vmapped stage function whose vmapped axis is sharded over `stage` (`spmd_axis_name`): every
logical constraint inside the layers keeps its meaning, with the stage axis in front, so the
pipeline composes with fsdp, tensor, expert and sequence sharding as the unpipelined layers do.
The layers' own shard_maps (the dropless expert exchange, context-parallel attention) are batched
by that vmap, the stage axis added to their specs; they run unchecked here (varying.check_vma).
An empty slot runs the layer on its zeros and keeps its input (`where`), so it gets zero gradient.
GSPMD gathers a stage's fsdp-sharded weights where the loop's body uses them, in every iteration;
pipeline.weight_gather="once" gathers them before the loop instead (pipeline_gather.py).

Work a stage does in the bubble (on zeros or a repeated microbatch) is dropped and gets no
cotangent, so gradients are exact. The backward pass is the loop's autodiff: all forwards, then
all backwards; each layer keeps what model.remat lets it keep, per microbatch.

Router losses the MoE layers sow come back per iteration, stage and slot; only real layers'
passes over real microbatches are kept, so the mean over them is the mean over (microbatch,
layer): the value train.grad_accum = M would give on one device. fp8 delayed scaling likewise: its
state updates arrive as cotangents (fp8.py), which a loop would sum over every use of a layer,
bubble included; the state goes in as one copy per iteration (_fan_out) whose backward keeps each
slot's real uses only and merges them as fp8.combine_updates merges micro-batches.

Where the step's objective is the fused LM loss (pipeline_layout.loss_on_the_last_stage), the
Decoder hands the strategy its Tail (final norm, head, loss) and the loop's outputs stay where the
last stage made them: the tail runs there (pipeline_tail.py), not on every stage after the outputs
went to each (`_from_stage`, which circular and the other objectives still use).

The tokens come in unembedded, with a pure lookup (models/llama.py, TokenEmbedding): each stage
looks the batch up itself before the loop (`embedded_per_stage`) and stage 0's is read, so neither
the embeddings nor their cotangent cross `stage`. An untied table is stored on the first stage (a
row per stage, the others zero: pipeline_layout.py), so its gradient is not summed over `stage`
either; a tied one, replicated over `stage`, is.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import linen as nn
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from maxtext_rocm.config.checks import pipeline_microbatches
from maxtext_rocm.config.choices import VIRTUAL_STAGE_SCHEDULES
from maxtext_rocm.errors import ConfigError
from maxtext_rocm.numerics import fp8
from maxtext_rocm.numerics.fp8 import FP8_COLLECTION
from maxtext_rocm.models.layers import EMBED_TABLE_AXES
from maxtext_rocm.models.llama import BLOCK_OUTPUT_AXES, Tail, TokenEmbedding
from maxtext_rocm.models.moe import AUX_LOSSES
from maxtext_rocm.parallel.pipeline_gather import GatheredOnce, per_batch_shard
from maxtext_rocm.parallel.pipeline_tail import TailOnLastStage, objective_on_the_last_stage
from maxtext_rocm.parallel.sharding import constrained_both_ways, nested_mesh, present_axes
from maxtext_rocm.parallel.pipeline_layout import StackLayout, ends_on_their_stages, loss_on_the_last_stage

Array = jax.Array
STAGE_AXIS = "stage"  # the mesh axis; "activation_stage" is its logical name (sharding.py)
STATE_AXES = ("activation_stage",) + BLOCK_OUTPUT_AXES  # each stage's activations [S, mb, seq, d]
TOKEN_AXES = ("activation_stage", "activation_batch", "activation_length")  # positions, segments


def bubble_fraction(schedule: str, stages: int, microbatches: int, repeats: int = 1) -> float:
    """The share of a step each stage idles. GPipe, gpipe_recompute, 1f1b: (S-1)/(M+S-1).
    Circular and interleaved 1f1b, R virtual stages per device: (S-1)/(R M + S-1), each pass over
    the devices being 1/R as long."""
    if schedule not in VIRTUAL_STAGE_SCHEDULES:  # gpipe, gpipe_recompute: one chunk per device
        repeats = 1
    return (stages - 1) / (repeats * microbatches + stages - 1)


def describe(pipeline_cfg, stages: int, n_layers: int | None = None) -> str:
    """One phrase for the run's description: schedule, microbatches, bubble, and (given the model's
    `n_layers`) the empty slots of layers that do not divide evenly, with the idle time they add."""
    if stages <= 1:
        return "pipeline off"
    microbatches, repeats = _resolved(pipeline_cfg), pipeline_cfg.repeats
    bubble = bubble_fraction(pipeline_cfg.schedule, stages, microbatches, repeats)
    formula = "(S-1)/(M+S-1)" if repeats == 1 else "(S-1)/(R M+S-1)"
    shape = f"{stages} stages" + (f" x {repeats} repeats" if repeats > 1 else "")
    text = (f"pipeline {pipeline_cfg.schedule}: {shape}, {microbatches} microbatches, "
            f"bubble {bubble:.1%} = {formula}")
    layout = StackLayout(n_layers, stages, repeats) if n_layers else None
    if layout is not None and layout.empty:
        text += f"; {layout.describe()}, idle {layout.idle_fraction(microbatches):.1%} with them"
    return text


def layer_stack(cfg, mesh: Mesh, loop: Callable | None = None) -> "Pipelined | None":
    """The Decoder's `layer_stack` strategy for `mesh` (models/llama.py), or None where the mesh
    has one stage and the layers run in order on every device. `loop`: another loop for `_loop`'s
    contract (pipeline_recompute.loop under pipeline.schedule="gpipe_recompute"); None: `_loop`."""
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
    stage after the loop (pipeline_layout.loss_on_the_last_stage says where)."""

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


def schedule_for(pipeline_cfg, model_cfg, mesh: Mesh) -> "Schedule | None":
    """The stages' schedule for `mesh` (GPipe's order, or Circular's with repeats), or None
    where the mesh has one stage."""
    stages = mesh.shape.get(STAGE_AXIS, 1)
    if stages <= 1:
        return None
    if model_cfg.n_layers < stages * pipeline_cfg.repeats:  # the config checks say it first
        raise ConfigError(f"model.n_layers={model_cfg.n_layers} leaves some of mesh stage={stages} x "
                          f"pipeline.repeats={pipeline_cfg.repeats} virtual stages without a layer")
    layout = StackLayout(model_cfg.n_layers, stages, pipeline_cfg.repeats)
    return (GPipe if layout.repeats == 1 else Circular)(layout, _resolved(pipeline_cfg), mesh)


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


# ----------------------------------------------------------------------------------------------
# The schedules: what separates them, around the loop they share


class Schedule:
    """A schedule for `layout`'s S stages x R repeats and M microbatches on `mesh`: the loop
    (`_loop`) carries each stage's last output [S, mb, seq, d] and the schedule's own `buffer`,
    and asks the schedule what each stage takes in, which chunk it runs, and where the outputs are."""

    def __init__(self, layout: StackLayout, microbatches: int, mesh: Mesh):
        self.layout, self.microbatches, self.mesh = layout, microbatches, mesh
        self.stages, self.repeats = layout.stages, layout.repeats
        self.n_iterations = self.repeats * microbatches + self.stages - 1

    def first_buffer(self, inputs: Array):
        """What the loop carries for the schedule beside the outputs, at the start (None: nothing)."""
        return None

    def stage_inputs(self, out: Array, buffer, fresh: Array, t: Array) -> tuple[Array, object]:
        """Each stage's input [S, mb, seq, d] in iteration `t`, from the last iteration's outputs
        `out` and microbatch `fresh` (the one stage 0 takes new, if any), and the buffer after it."""
        raise NotImplementedError

    def pick_chunk(self, per_stage: Array, repeat: Array) -> Array:
        """One stage's chunk of this iteration out of its own [R, ...] block."""
        raise NotImplementedError

    def kept_per_iteration(self, out: Array) -> Array | None:
        """What of each iteration's outputs the loop stacks for `outputs` (None: nothing)."""
        return None

    def outputs(self, out: Array, buffer, every_iteration: Array | None) -> Array:
        """[M, mb, seq, d]: each microbatch after the last layer, on every stage, from the loop's
        last outputs and buffer and what `kept_per_iteration` kept."""
        return _from_stage(*self.outputs_by_stage(out, buffer, every_iteration), self.mesh)

    def outputs_by_stage(self, out: Array, buffer, every_iteration: Array | None) -> tuple[Array, int]:
        """([S, M, mb, seq, d] sharded over `stage`, the stage whose row holds each microbatch after
        the last layer): where `outputs` takes them from."""
        raise NotImplementedError


class GPipe(Schedule):
    """M + S - 1 iterations; stage s runs its one chunk on microbatch t - s. The outputs shift one
    stage on (`_shift`: a collective-permute between neighbouring stage groups; activations are all
    that cross them) and the last stage's are kept per iteration, moved off it once after the loop."""

    def stage_inputs(self, out, buffer, fresh, t):
        return _shift(out, fresh, self.mesh), buffer

    def pick_chunk(self, per_stage, repeat):
        # A static index: a slice that varied with the iteration would be a new value in each,
        # which the loop's autodiff saves once per iteration (M + S - 1 copies of the stage's
        # weights; the figures: docs/figures.md, "Pipeline and expert code"); a static one of the
        # loop-invariant weights is saved once. tests/test_compile_pipeline.py holds it.
        return jax.lax.index_in_dim(per_stage, index=0, keepdims=False)

    def kept_per_iteration(self, out):
        return out

    def outputs_by_stage(self, out, buffer, every_iteration):
        # The last stage finishes microbatch m in iteration m + S - 1.
        last = self.stages - 1
        return jnp.swapaxes(every_iteration[last:], 0, 1), last


class Circular(Schedule):
    """R M + S - 1 iterations; stage s runs chunk (t - s) // M of its R on microbatch (t - s) mod M.
    The shift is a rotation: the last stage's output goes back to stage 0 for its next repeat,
    through a buffer [S, M, mb, seq, d] (every stage keeps its own copy; only stage 0's is read)
    that holds it the M - S iterations until stage 0 is free for it (so M >= S). Each stage
    indexes its chunk out of its own block, so no weight moves; the index varies per iteration, so
    the loop's autodiff saves the chunk (1/R of the stage's weights) once per iteration
    (docs/parallelism.md)."""

    def first_buffer(self, inputs):
        return jnp.zeros((self.stages, self.microbatches, *inputs.shape[1:]), inputs.dtype)

    def stage_inputs(self, out, buffer, fresh, t):
        stages, microbatches = self.stages, self.microbatches
        rotated = _permute(out, self.mesh, [(s, (s + 1) % stages) for s in range(stages)])
        buffer = jax.lax.dynamic_update_index_in_dim(buffer, rotated, (t - stages) % microbatches, axis=1)
        again = jax.lax.dynamic_index_in_dim(buffer, t % microbatches, axis=1, keepdims=False)
        return jnp.where(_is_first(rotated), jnp.where(t < microbatches, fresh, again), rotated), buffer

    def pick_chunk(self, per_stage, repeat):
        return jax.lax.dynamic_index_in_dim(per_stage, index=repeat, keepdims=False)

    def outputs_by_stage(self, out, buffer, every_iteration):
        # The last repeat's outputs, stored as if for one more: stage 0's copy of the buffer.
        last = _permute(out, self.mesh, [(self.stages - 1, 0)])
        position = (self.n_iterations - self.stages) % self.microbatches
        return jax.lax.dynamic_update_index_in_dim(buffer, last, position, axis=1), 0


def pipelined(layers: nn.Module, make_layers: Callable, embedding: TokenEmbedding, tokens: Array, positions: Array,
              segment_ids: Array | None, *, schedule: Schedule, loop: Callable | None = None,
              gather_once: bool = False, reduce_once: bool = False, table_on_its_stage: bool = False,
              tail: Tail | None = None, head_on_its_stage: bool = False):
    """The Decoder's `layer_stack` strategy: the bound scanned layers `layers` (whose variables are
    the stored [S R K, ...] arrays) run over the stages by `schedule` on `tokens` [B, seq] as
    `embedding` looks them up (on the stages: embedded_per_stage); `make_layers(length,
    parent=None)` makes an unbound scan of `length` layers to run each stage's chunk with.
    `loop`: _loop's contract with another backward (pipeline_recompute.loop); None: _loop.
    `gather_once`: the stages' weights gathered before the loop, not in it (pipeline_gather.py);
    `reduce_once`: and their gradient reduced after it (pipeline_gather.per_batch_shard).
    `table_on_its_stage`: the embedding table is stored [S, vocab, d_model], stage 0's row the
    table (pipeline_layout.ends_on_their_stages).
    Returns (y, {AUX_LOSSES: what the real layers sowed on real microbatches}); with `tail`
    ((objective, sums), {AUX_LOSSES: ...}), the tail run on the last stage's outputs there
    (pipeline_tail.objective_on_the_last_stage; `head_on_its_stage`: its head stored [S, ...])."""
    stack = stage_stack(layers, make_layers, schedule)
    layout, microbatches, params = schedule.layout, schedule.microbatches, stack.params
    # fp8 delayed scaling: one copy of the state per iteration, so that each use's update (its
    # cotangent) stays apart and the real ones combine as grad_accum's micro-batches do.
    fp8_per_iteration = None if stack.fp8_state is None else _fan_out(stack.fp8_state, _uses(layout, microbatches))
    staged = embedded_per_stage(embedding, tokens, layout.stages, microbatches, schedule.mesh,  # [S, M, mb, seq, d]
                                tables_per_stage=table_on_its_stage)
    gathered = (GatheredOnce.of(stack.chunk_layers, staged[0, 0], positions, segment_ids, schedule.mesh)
                if gather_once else None)
    if gathered is not None:
        params = gathered.before_loop(params)
    loop = loop or _loop
    if reduce_once:  # each device sums its own gradient; nothing to ask of each iteration's
        loop = per_batch_shard(loop, schedule.mesh, present_axes(schedule.mesh, "activation_batch"))
        gathered = None
    run_stage = functools.partial(_run_stage, stack.chunk_layers, stack.padded, schedule.pick_chunk, gathered)
    if tail is None:
        y, sown = loop(schedule, run_stage, params, fp8_per_iteration, stack.real, staged, positions, segment_ids)
        return y, {AUX_LOSSES: jax.tree_util.tree_map(functools.partial(_real_work, layout, microbatches), sown)}
    # The stack's outputs stay where the last stage made them; the tail runs there on them all.
    per_stage, sown = loop(schedule, run_stage, params, fp8_per_iteration, stack.real, staged, positions,
                           segment_ids, by_stage=True)
    kept = {AUX_LOSSES: jax.tree_util.tree_map(functools.partial(_real_work, layout, microbatches), sown)}
    y = nn.with_logical_constraint(jax.vmap(merge_microbatches)(per_stage), STATE_AXES)  # [S, B, seq, d]
    on_last = TailOnLastStage.of(tail, schedule.mesh, head_on_its_stage)
    objective, sums = objective_on_the_last_stage(on_last)(y, tail.variables, tail.rows)
    return (objective + tail.of_sown(kept), sums), kept


class StageStack(NamedTuple):
    """The scanned layers' variables as the stages run them: `params` and `fp8_state` (None
    without delayed fp8 scaling) viewed [S, R, K, ...]; `real` [S, R, K] (False: an empty slot);
    `chunk_layers`, an unbound scan that runs one chunk, or where some slots are empty (`padded`)
    one unscanned layer that run_chunk runs a slot at a time."""
    params: object
    fp8_state: object
    real: Array
    padded: bool
    chunk_layers: nn.Module


def stage_stack(layers: nn.Module, make_layers: Callable, schedule: Schedule) -> StageStack:
    """The bound scanned `layers` (whose variables are the stored [S R K, ...] arrays) as
    `schedule`'s stages run them; `make_layers(length, parent=None)` makes an unbound scan (length
    None: one layer, unscanned)."""
    variables = dict(layers.variables)
    extra = set(variables) - {"params", FP8_COLLECTION}
    if extra:
        raise ConfigError(f"the pipeline cannot carry the layers' {', '.join(sorted(extra))} state yet; "
                          "use mesh stage=1")
    layout = schedule.layout
    # Storage [S R K, ...] -> [S, R, K, ...]: device s holds its R chunks, its own shard (a reshape
    # of the sharded axis; no data moves). Without padding or repeats storage is model order.
    stored = jax.tree_util.tree_map(
        lambda p: p.reshape(layout.stages, layout.repeats, layout.per_chunk, *p.shape[1:]), variables)
    padded = bool(layout.empty)
    return StageStack(stored["params"], stored.get(FP8_COLLECTION), jnp.asarray(layout.real), padded,
                      make_layers(None if padded else layout.per_chunk, parent=None))


def _loop(schedule: Schedule, run_stage: Callable, params, fp8_per_iteration, real: Array,
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
    (pipeline_layout.ends_on_their_stages), so each stage looks up in its own row and the gradient
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


# ----------------------------------------------------------------------------------------------
# One stage's work in one iteration (vmapped over the stages by `pipelined`)


def _run_stage(chunk_layers: nn.Module, padded: bool, pick_chunk: Callable, gathered, stage_vars,
               stage_real: Array, repeat: Array, h: Array, pos: Array, seg: Array | None):
    """One stage: its chunk of this iteration (`pick_chunk` of its [R, ...] block) run on `h`.
    stage_vars {collection: [R, K, ...]}, stage_real [R, K] (False: an empty slot). `gathered`: a
    GatheredOnce whose weights these are, or None."""
    if gathered is not None:
        stage_vars = {**stage_vars, "params": gathered.in_stage(stage_vars["params"])}
    chunk_vars = jax.tree_util.tree_map(lambda a: pick_chunk(a, repeat), stage_vars)
    return run_chunk(chunk_layers, padded, chunk_vars, pick_chunk(stage_real, repeat), h, pos, seg)


def run_chunk(chunk_layers: nn.Module, padded: bool, chunk_vars, chunk_real: Array, h: Array, pos: Array,
              seg: Array | None):
    """One chunk of layers (chunk_vars {collection: [K, ...]}, chunk_real [K]) run on `h`; returns
    (h, what its layers sowed). `chunk_layers`: a scan of the K layers, or where `padded` one
    layer, unscanned, run slot by slot (StageStack)."""
    if not padded:
        (h, _), sown = chunk_layers.apply(chunk_vars, h, pos, seg, mutable=[AUX_LOSSES])
        return h, sown
    return jax.lax.scan(functools.partial(_run_slot, chunk_layers, pos, seg), h, (chunk_vars, chunk_real))


def _run_slot(one_layer: nn.Module, pos: Array, seg: Array | None, h: Array, slot_in):
    """A scan step over a chunk that may hold empty slots: one layer (`slot_in`: its variables and
    whether it is real) on the carried activations `h`; an empty slot passes h through (its zeros
    get zero gradient). The layer takes the slot's variables as the scan hands them over: a
    reshaped copy (a scan of one layer over v[None]) would be a new value the layer's remat keeps
    as a residual, where the scan's own slice is recognised as its input. 1f1b keeps residuals
    per microbatch slot, so the copy held every layer's weights once per slot (Llama 3.1 405B's
    126 layers on 8 stages: 651 GiB of XLA buffers where the estimate read 200)."""
    v, is_real = slot_in
    if FP8_COLLECTION in v:  # an empty slot's zero scales would divide by zero
        v = {**v, FP8_COLLECTION: jax.tree_util.tree_map(
            lambda a: jnp.where(is_real, a, jnp.ones_like(a)), v[FP8_COLLECTION])}
    (out, _), sown = one_layer.apply(v, h, pos, seg, mutable=[AUX_LOSSES])
    return jnp.where(is_real, out, h), sown


# ----------------------------------------------------------------------------------------------
# Moving activations between stages


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
    return jax.shard_map(local, mesh=nested_mesh(mesh), in_specs=P(STAGE_AXIS), out_specs=P(STAGE_AXIS),
                         axis_names=frozenset({STAGE_AXIS}))(state)


def _from_stage(per_stage: Array, stage: int, mesh: Mesh) -> Array:
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


def _is_first(state: Array) -> Array:
    """[S, 1, ...]: True in stage 0's row, to `where` over `state` [S, ...]."""
    return (jnp.arange(state.shape[0]) == 0).reshape(-1, *(1,) * (state.ndim - 1))


# ----------------------------------------------------------------------------------------------
# Which iterations do real work: the router losses kept, the fp8 state's uses


def _passes(layout: StackLayout, microbatches: int) -> tuple[np.ndarray, np.ndarray]:
    """[iterations, S] each: the repeat stage s runs in iteration t (its pass t - s, clamped into
    the schedule), and whether that pass is real (False in the bubble)."""
    passes = layout.repeats * microbatches
    t, s = np.meshgrid(np.arange(passes + layout.stages - 1), np.arange(layout.stages), indexing="ij")
    work = t - s
    return np.clip(work, 0, passes - 1) // microbatches, (work >= 0) & (work < passes)


def _real_work(layout: StackLayout, microbatches: int, leaf: Array, passes=None) -> Array:
    """[iterations, S, K, ...] -> [M L, ...]: what each layer computed for each microbatch (the
    bubble's iterations and the empty slots dropped), whose mean is the one device's. `passes`:
    another order's (repeat, real) per iteration and stage (1f1b's); None: `_passes`."""
    repeat, in_time = passes if passes is not None else _passes(layout, microbatches)
    stage_ids, slot_ids = np.arange(layout.stages)[None, :, None], np.arange(layout.per_chunk)[None, None, :]
    keep = in_time[:, :, None] & layout.real[stage_ids, repeat[:, :, None], slot_ids]
    flat = leaf.reshape(-1, *leaf.shape[3:])
    return jnp.take(flat, np.flatnonzero(keep.reshape(-1)), axis=0)


def _uses(layout: StackLayout, microbatches: int) -> np.ndarray:
    """[iterations, S, R, K]: whether slot k of chunk r on device s runs a real layer on a real
    microbatch in that iteration."""
    repeat, in_time = _passes(layout, microbatches)
    uses = in_time[:, :, None] & (repeat[:, :, None] == np.arange(layout.repeats)[None, None, :])
    return uses[..., None] & layout.real[None]


def _fan_out(state, uses: np.ndarray):
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
