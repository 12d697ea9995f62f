"""One stage's work in one iteration, run over the stages by the loop (loop.py).

The parameters are the layers' own stacked arrays, the "layers" axis sharded over `stage`
(sharding.py). Where model order is not what each device runs (circular) or the layers do not
divide (126 on 8 stages), the run stores them in its own order, empty slots included (layout.py);
checkpoints keep model order. Here storage [S R K, ...] is viewed as [S, R, K, ...] (a reshape of
the sharded axis, no data moves: `stage_stack`) and the S stages run as one vmapped stage
function (`run_picked_chunk`, vmapped by the loop) whose vmapped axis is sharded over `stage`
(`spmd_axis_name`): every logical constraint inside the layers keeps its meaning, with the stage
axis in front, so the pipeline composes with fsdp, tensor, expert and sequence sharding as the
unpipelined layers do. The layers' own shard_maps (the dropless expert exchange, context-parallel
attention) are batched by that vmap, the stage axis added to their specs; they run unchecked here
(varying.check_vma).
An empty slot runs the layer on its zeros and keeps its input (`where`), so it gets zero gradient.
Where the stack's layers differ in kind (models/layer_kinds.py) each slot also hands its layer
the layer's index, the one thing a stage needs to run layers of several kinds: `Slots`.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Callable, NamedTuple

import jax
import jax.numpy as jnp
from flax import linen as nn

from maxtext_rocm.errors import ConfigError
from maxtext_rocm.models.layer_kinds import kinds_differ
from maxtext_rocm.models.moe import AUX_LOSSES
from maxtext_rocm.numerics.fp8 import FP8_COLLECTION

if TYPE_CHECKING:
    from maxtext_rocm.parallel.pipeline.schedules import Schedule

Array = jax.Array


class Slots(NamedTuple):
    """What each slot [S, R, K] holds beside its weights: `real` (False: empty), and `layer`, the
    model index of its layer where the layers take theirs (kinds_differ; an empty slot's is 0),
    else None."""
    real: Array
    layer: Array | None

    def layer_args(self) -> tuple:
        """The layer indices as the layers' extra argument: (layer,), or () where they take none."""
        return () if self.layer is None else (self.layer,)


class StageStack(NamedTuple):
    """The scanned layers' variables as the stages run them: `params` and `fp8_state` (None
    without delayed fp8 scaling) viewed [S, R, K, ...]; `slots` [S, R, K] (Slots: which are
    empty, which layer each holds); `chunk_layers`, an unbound scan that runs one chunk, or where
    some slots are empty (`padded`) one unscanned layer that run_chunk runs a slot at a time."""
    params: object
    fp8_state: object
    slots: Slots
    padded: bool
    chunk_layers: nn.Module

    def first_chunk_args(self) -> tuple:
        """chunk_layers' extra arguments for the first chunk (its layer indices, or ()): what an
        abstract init of one chunk passes (gather.GatheredOnce.of)."""
        layer = self.slots.layer
        if layer is None:
            return ()
        return (layer[0, 0, 0],) if self.padded else (layer[0, 0],)


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
    indices = layout.layer_of_slot.reshape(layout.real.shape).clip(0)
    slots = Slots(jnp.asarray(layout.real), jnp.asarray(indices, jnp.int32) if kinds_differ(layers.cfg) else None)
    return StageStack(stored["params"], stored.get(FP8_COLLECTION), slots, padded,
                      make_layers(None if padded else layout.per_chunk, parent=None))


def run_picked_chunk(chunk_layers: nn.Module, padded: bool, pick_chunk: Callable, gathered, stage_vars,
                     stage_real: Array, repeat: Array, h: Array, pos: Array, seg: Array | None):
    """One stage: its chunk of this iteration (`pick_chunk` of its [R, ...] block) run on `h`.
    stage_vars {collection: [R, K, ...]}, stage_real the Slots [R, K]. `gathered`: a GatheredOnce
    whose weights these are, or None."""
    if gathered is not None:
        stage_vars = {**stage_vars, "params": gathered.in_stage(stage_vars["params"])}
    chunk_vars, chunk_real = jax.tree_util.tree_map(lambda a: pick_chunk(a, repeat), (stage_vars, stage_real))
    return run_chunk(chunk_layers, padded, chunk_vars, chunk_real, h, pos, seg)


def run_chunk(chunk_layers: nn.Module, padded: bool, chunk_vars, chunk_real: Slots, h: Array, pos: Array,
              seg: Array | None):
    """One chunk of layers (chunk_vars {collection: [K, ...]}, chunk_real the Slots [K]) run on
    `h`; returns (h, what its layers sowed). `chunk_layers`: a scan of the K layers, or where
    `padded` one layer, unscanned, run slot by slot (StageStack)."""
    if not padded:
        (h, _), sown = chunk_layers.apply(chunk_vars, h, pos, seg, *chunk_real.layer_args(), mutable=[AUX_LOSSES])
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
    v, slot = slot_in
    is_real = slot.real
    if FP8_COLLECTION in v:  # an empty slot's zero scales would divide by zero
        v = {**v, FP8_COLLECTION: jax.tree_util.tree_map(
            lambda a: jnp.where(is_real, a, jnp.ones_like(a)), v[FP8_COLLECTION])}
    (out, _), sown = one_layer.apply(v, h, pos, seg, *slot.layer_args(), mutable=[AUX_LOSSES])
    return jnp.where(is_real, out, h), sown
