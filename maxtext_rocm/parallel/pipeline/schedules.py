"""The schedules GPipe and Circular: what separates them, around the loop they share (loop.py),
and the bubble each leaves (legend: __init__.py)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from maxtext_rocm.config.choices import VIRTUAL_STAGE_SCHEDULES
from maxtext_rocm.errors import ConfigError
from maxtext_rocm.parallel.pipeline.axes import STAGE_AXIS
from maxtext_rocm.parallel.pipeline.layout import StackLayout
from maxtext_rocm.parallel.pipeline.microbatches import resolved_microbatches
from maxtext_rocm.parallel.pipeline.transfers import from_stage, is_first, permute, shift

Array = jax.Array


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
    microbatches, repeats = resolved_microbatches(pipeline_cfg), pipeline_cfg.repeats
    bubble = bubble_fraction(pipeline_cfg.schedule, stages, microbatches, repeats)
    formula = "(S-1)/(M+S-1)" if repeats == 1 else "(S-1)/(R M+S-1)"
    shape = f"{stages} stages" + (f" x {repeats} repeats" if repeats > 1 else "")
    text = (f"pipeline {pipeline_cfg.schedule}: {shape}, {microbatches} microbatches, "
            f"bubble {bubble:.1%} = {formula}")
    layout = StackLayout(n_layers, stages, repeats) if n_layers else None
    if layout is not None and layout.empty:
        text += f"; {layout.describe()}, idle {layout.idle_fraction(microbatches):.1%} with them"
    return text


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
    order = GPipe if layout.repeats == 1 else Circular
    return order(layout, resolved_microbatches(pipeline_cfg), mesh)


class Schedule:
    """A schedule for `layout`'s S stages x R repeats and M microbatches on `mesh`: the loop
    (loop.run_loop) carries each stage's last output [S, mb, seq, d] and the schedule's own `buffer`,
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
        return from_stage(*self.outputs_by_stage(out, buffer, every_iteration), self.mesh)

    def outputs_by_stage(self, out: Array, buffer, every_iteration: Array | None) -> tuple[Array, int]:
        """([S, M, mb, seq, d] sharded over `stage`, the stage whose row holds each microbatch after
        the last layer): where `outputs` takes them from."""
        raise NotImplementedError


class GPipe(Schedule):
    """M + S - 1 iterations; stage s runs its one chunk on microbatch t - s. The outputs shift one
    stage on (`shift`: a collective-permute between neighbouring stage groups; activations are all
    that cross them) and the last stage's are kept per iteration, moved off it once after the loop."""

    def stage_inputs(self, out, buffer, fresh, t):
        return shift(out, fresh, self.mesh), buffer

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
        rotated = permute(out, self.mesh, [(s, (s + 1) % stages) for s in range(stages)])
        buffer = jax.lax.dynamic_update_index_in_dim(buffer, rotated, (t - stages) % microbatches, axis=1)
        again = jax.lax.dynamic_index_in_dim(buffer, t % microbatches, axis=1, keepdims=False)
        return jnp.where(is_first(rotated), jnp.where(t < microbatches, fresh, again), rotated), buffer

    def pick_chunk(self, per_stage, repeat):
        return jax.lax.dynamic_index_in_dim(per_stage, index=repeat, keepdims=False)

    def outputs_by_stage(self, out, buffer, every_iteration):
        # The last repeat's outputs, stored as if for one more: stage 0's copy of the buffer.
        last = permute(out, self.mesh, [(self.stages - 1, 0)])
        position = (self.n_iterations - self.stages) % self.microbatches
        return jax.lax.dynamic_update_index_in_dim(buffer, last, position, axis=1), 0
