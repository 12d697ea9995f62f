"""Where a pipeline keeps the layer stack while it trains (storage order), and the way back to the
model's own order (canonical) at the boundaries: state creation, checkpoint save and restore,
parameters loaded from another run, and callers that read the parameters as the model defines them.

NamedSharding splits the [n_layers, ...] axis over `stage` in contiguous blocks. A circular
schedule runs layer chunk v (of S x R chunks, in model order) on device v mod S, and a stack of
126 layers cannot split over 8 devices at all. So the pipeline stores the stack as S x R x K
slots, K = ceil(L / (S R)): device s's contiguous block is its chunks s, s+S, s+2S, ..., and the
S R K - L slots no layer fills (at most one per chunk, in the last chunks, on their devices v mod
S) hold zeros that the stage function skips. Every state leaf whose leading logical axis is
"layers" (parameters, the optimizer's moments) is stored so. The permutation runs once at those
boundaries (a jitted reshape/transpose/pad), never per step: moving weights every step would
defeat a pipeline over slow links. Checkpoints hold model order only, so they restore across any
stage count, schedule or padding.

With untied embeddings a pipeline stores the embedding table on the first stage, and under
pipeline.schedule="1f1b" (which alone runs the LM head inside the pipeline) the head on the last
(`ends_on_their_stages`): each as [S, ...] over `stage`, the owner's row the weight and the other
rows zero, their optimizer moments likewise. Replicated over `stage` instead, each weight's
gradient (nonzero on its owner only) was summed over `stage` once a step, an all-reduce of its
shard: 1f1b at stage=2 x fsdp=4, M=16 moved 1.14x its minimum, stored so 1.04x (docs/figures.md).
The other rows cost what replication did (a row per device), no stage reads them, and their
gradients and moments stay zero. The model never sees it: it creates and checkpoints [vocab,
d_model] and [d_model, vocab], and its pipelined path hands the stored variables to the strategy
without applying them (embedding.embedded_per_stage, one_f_one_b.py, tail.py).

Words: "the layer stack" is always the scanned layers' arrays, [n_layers, ...] in model order (a
leading "layers" axis); `StackLayout` is where its rows sit in storage; a `StateConverter` moves a
state between the two orders (and the ends between their stages' rows and model order).
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import linen as nn
from jax.sharding import NamedSharding, PartitionSpec as P

from maxtext_rocm.config.checks import loss_tail_refusals
from maxtext_rocm.models.layers import EMBED_TABLE_AXES, HEAD_AXES
from maxtext_rocm.parallel.pipeline.axes import STAGE_AXIS

LAYERS = "layers"  # the stacked layers' logical axis (models/llama.py, sharding.py)


class StackLayout:
    """S devices x R chunks (virtual stages) x K slots. layer_of_slot[s R K + r K + k] is the model
    layer in slot k of chunk r of device s (chunk v = r S + s in model order), -1 when empty."""

    def __init__(self, n_layers: int, stages: int, repeats: int = 1):
        self.n_layers, self.stages, self.repeats = n_layers, stages, repeats
        chunks = stages * repeats
        self.per_chunk = -(-n_layers // chunks)
        self.slots = chunks * self.per_chunk
        self.empty = self.slots - n_layers
        # The last `empty` chunks are one layer short: the padding spreads one slot per chunk.
        self.counts = np.full(chunks, self.per_chunk)
        self.counts[chunks - self.empty:] -= 1
        starts = np.concatenate([[0], np.cumsum(self.counts)[:-1]])
        layer = np.full((stages, repeats, self.per_chunk), -1)
        for s in range(stages):
            for r in range(repeats):
                v = r * stages + s
                layer[s, r, :self.counts[v]] = starts[v] + np.arange(self.counts[v])
        self.real = layer >= 0  # [S, R, K]
        self.layer_of_slot = layer.reshape(-1)

    @property
    def is_identity(self) -> bool:
        return self.slots == self.n_layers and self.repeats == 1

    def describe(self) -> str:
        return (f"{self.n_layers} layers in {self.stages} x {self.repeats * self.per_chunk} slots, "
                f"{self.empty} empty")

    def idle_fraction(self, microbatches: int) -> float:
        """The share of slot-time a device does no layer's work: the bubble plus the empty slots.
        Each of the R M + S - 1 iterations runs K slots on every device; M L layer passes are real."""
        iterations = self.repeats * microbatches + self.stages - 1
        return 1 - microbatches * self.n_layers / (self.stages * iterations * self.per_chunk)

    # Canonical [L, ...] <-> storage [S R K, ...], as reshapes, a transpose and a pad (no gather, so
    # GSPMD moves each row once instead of gathering the stack on every device).
    def to_storage(self, x: jax.Array) -> jax.Array:
        chunks, k, short = self.stages * self.repeats, self.per_chunk, self.empty
        full = x[:(chunks - short) * k].reshape(chunks - short, k, *x.shape[1:])
        parts = [full]
        if short:
            tail = x[(chunks - short) * k:].reshape(short, k - 1, *x.shape[1:])
            parts.append(jnp.pad(tail, [(0, 0), (0, 1)] + [(0, 0)] * (x.ndim - 1)))
        by_chunk = jnp.concatenate(parts, axis=0) if short else full  # [chunk v = r S + s, K, ...]
        by_chunk = by_chunk.reshape(self.repeats, self.stages, k, *x.shape[1:])
        return jnp.swapaxes(by_chunk, 0, 1).reshape(self.slots, *x.shape[1:])

    def to_canonical(self, x: jax.Array) -> jax.Array:
        chunks, k, short = self.stages * self.repeats, self.per_chunk, self.empty
        by_chunk = jnp.swapaxes(x.reshape(self.stages, self.repeats, k, *x.shape[1:]), 0, 1)
        by_chunk = by_chunk.reshape(chunks, k, *x.shape[1:])
        parts = [by_chunk[:chunks - short].reshape(-1, *x.shape[1:])]
        if short:
            parts.append(by_chunk[chunks - short:, :k - 1].reshape(-1, *x.shape[1:]))
        return jnp.concatenate(parts, axis=0) if short else parts[0]


def stack_layout(pipeline_cfg, model_cfg, mesh) -> StackLayout | None:
    """The run's storage layout, or None where storage is model order (no pipeline, or gpipe over
    a stack that divides evenly): then nothing is ever converted."""
    stages = mesh.shape.get(STAGE_AXIS, 1)
    if stages <= 1 or not model_cfg.scan_layers:
        return None
    layout = StackLayout(model_cfg.n_layers, stages, pipeline_cfg.repeats)
    return None if layout.is_identity else layout


def layer_flags(logical_specs):
    """True for each leaf of a state whose leading logical axis is "layers"."""
    return jax.tree_util.tree_map(lambda s: bool(len(s)) and s[0] == LAYERS, logical_specs,
                                  is_leaf=lambda s: isinstance(s, P))


NOT_OWNED = -1


def stage_owners(logical_specs, stages: int, table: bool, head: bool):
    """Each leaf's owning stage: 0 for the embedding table's leaves (parameters and moments) where
    `table`, stages - 1 for the LM head's where `head`, NOT_OWNED for the rest."""
    owners = {**({EMBED_TABLE_AXES: 0} if table else {}), **({HEAD_AXES: stages - 1} if head else {})}
    return jax.tree_util.tree_map(lambda spec: owners.get(tuple(spec), NOT_OWNED), logical_specs,
                                  is_leaf=lambda s: isinstance(s, P))


class EndsOnTheirStages(NamedTuple):
    """Which of the model's ends a run stores on its stage (the module's docstring)."""
    table: bool  # the embedding table on the first stage: any schedule, untied
    head: bool  # the LM head on the last: where the loss runs there (loss_on_the_last_stage)

    @property
    def any(self) -> bool:
        return self.table or self.head


def loss_on_the_last_stage(cfg) -> bool:
    """Whether a pipeline runs the final norm, the head and the fused loss on its last stage (the
    Decoder's Tail: parallel/pipeline/tail.py), so that the stack's outputs never leave it: always
    under 1f1b (per microbatch, inside its loop; the config refuses what it cannot run), and under
    gpipe and gpipe_recompute after the loop where the step's objective is the fused head loss
    (model.loss_chunk_len > 0, the LM objective, no fp8 head of its own) and the loop is not run
    per batch shard (pipeline.gradient_reduce="once"). Otherwise, and under circular (whose outputs
    end on the first stage), the last stage's outputs go to every stage, which runs the head."""
    if cfg.pipeline.schedule == "1f1b":
        return True
    return cfg.pipeline.schedule in ("gpipe", "gpipe_recompute") and not any(
        refused for refused, _ in loss_tail_refusals(cfg))


def ends_on_their_stages(cfg, mesh) -> EndsOnTheirStages:
    """Where the run keeps its ends: on their stages under a pipeline of scanned layers with untied
    embeddings (a tied table is read at both ends: replicated over `stage`), the head where the
    loss runs on the last stage (`loss_on_the_last_stage`). LoRA, whose frozen base is not
    converted, does not run under a pipeline (config/checks.py)."""
    table = mesh.shape.get(STAGE_AXIS, 1) > 1 and cfg.model.scan_layers and not cfg.model.tie_embeddings
    return EndsOnTheirStages(table=table, head=table and loss_on_the_last_stage(cfg))


def owned_to_storage(x: jax.Array, owner: int, stages: int) -> jax.Array:
    """[...] -> [S, ...]: `x` in its owner's row, zeros in the others' (which no stage reads, and
    whose gradients and moments stay zero)."""
    mine = (jnp.arange(stages) == owner).reshape(stages, *(1,) * x.ndim)
    return jnp.where(mine, x[None], jnp.zeros((), x.dtype))


class _Conversion:
    """One direction for one tree: a program over the converted leaves alone (`fns`, one per leaf,
    None for a leaf passed through as it is, not copied) that lays each out as `out_shardings` says."""

    def __init__(self, fns, out_shardings):
        self.fns = fns
        picked = [s for s, fn in zip(jax.tree_util.tree_leaves(out_shardings), fns) if fn is not None]
        converting = [fn for fn in fns if fn is not None]
        self.program = jax.jit(lambda xs: [fn(x) for fn, x in zip(converting, xs)], out_shardings=picked)

    def __call__(self, tree):
        leaves, treedef = jax.tree_util.tree_flatten(tree)
        converted = iter(self.program([x for x, fn in zip(leaves, self.fns) if fn is not None]))
        return treedef.unflatten([next(converted) if fn is not None else x for x, fn in zip(leaves, self.fns)])


class StateConverter:
    """The conversions of one run's state (and of its parameters alone) between storage and model
    order, and the state's storage shardings and canonical abstract arrays, which checkpoints are
    restored into. `layout`: the layer stack's StackLayout, or None where it is model order;
    `owners`: each leaf's owning stage (stage_owners) or NOT_OWNED."""

    def __init__(self, layout: StackLayout | None, flags, owners, sharding, canonical_shapes, mesh):
        self.layout, self.flags, self.owners = layout, flags, owners
        self.stages = mesh.shape[STAGE_AXIS]
        self.storage_sharding = jax.tree_util.tree_map(
            lambda s, owner: NamedSharding(mesh, P(STAGE_AXIS, *s.spec)) if owner != NOT_OWNED else s,
            sharding, owners)
        canonical_sharding = jax.tree_util.tree_map(
            lambda s, x, is_layer: _canonical_sharding(s, x.shape, mesh) if is_layer and layout is not None else s,
            sharding, canonical_shapes, flags)
        self.canonical_abstract = jax.tree_util.tree_map(
            lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), canonical_shapes, canonical_sharding)
        to_storage, to_canonical = self._fns(flags, owners)
        # True for each leaf stored otherwise than in model order (the layers only where reordered)
        self.converted = jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(flags),
                                                      [fn is not None for fn in to_storage])
        self.to_storage = _Conversion(to_storage, self.storage_sharding)
        self.to_canonical = _Conversion(to_canonical, canonical_sharding)
        params_to_storage, params_to_canonical = self._fns(flags.params, owners.params)
        self.params_to_storage = _Conversion(params_to_storage, self.storage_sharding.params)
        self.params_to_canonical = _Conversion(params_to_canonical, canonical_sharding.params)

    def _fns(self, flags, owners) -> tuple[list, list]:
        """Per leaf of a tree with these `flags` and `owners`: its conversion to storage and back,
        or None."""
        forth, back = [], []
        for is_layer, owner in zip(jax.tree_util.tree_leaves(flags), jax.tree_util.tree_leaves(owners)):
            if owner != NOT_OWNED:
                forth.append(functools.partial(owned_to_storage, owner=owner, stages=self.stages))
                back.append(functools.partial(_owned_row, owner=owner))
            elif is_layer and self.layout is not None:
                forth.append(self.layout.to_storage)
                back.append(self.layout.to_canonical)
            else:
                forth.append(None)
                back.append(None)
        return forth, back

    def stored(self, canonical_state):
        """`canonical_state` in storage order, as plain jax operations (inside a caller's program:
        the state's init)."""
        forth, _ = self._fns(self.flags, self.owners)
        leaves, treedef = jax.tree_util.tree_flatten(canonical_state)
        return treedef.unflatten([fn(x) if fn is not None else x for fn, x in zip(forth, leaves)])

    def storage_shapes(self, tree):
        """`tree`'s canonical ShapeDtypeStructs as stored: the layer axis as long as the storage,
        an owned leaf with a leading row per stage."""
        def shape(x, is_layer, owner):
            if owner != NOT_OWNED:
                return jax.ShapeDtypeStruct((self.stages, *x.shape), x.dtype)
            if is_layer and self.layout is not None:
                return jax.ShapeDtypeStruct((self.layout.slots, *x.shape[1:]), x.dtype)
            return x
        return jax.tree_util.tree_map(shape, tree, self.flags, self.owners)


def _owned_row(x: jax.Array, owner: int) -> jax.Array:
    return x[owner]


def _canonical_sharding(storage: NamedSharding, shape, mesh) -> NamedSharding:
    """The storage sharding where `stage` divides the canonical layer axis; else `stage` moves to
    the first other axis it divides (each device still holds 1/S of the stack while converting),
    or, for a leaf with none, the leaf is replicated over it."""
    spec = list(storage.spec) + [None] * (len(shape) - len(storage.spec))
    stages = mesh.shape[STAGE_AXIS]
    if shape[0] % stages == 0:
        return storage
    axes = [() if e is None else ((e,) if isinstance(e, str) else tuple(e)) for e in spec]
    axes[0] = tuple(a for a in axes[0] if a != STAGE_AXIS)
    for dim in range(1, len(shape)):
        if shape[dim] % (math.prod(mesh.shape[a] for a in axes[dim]) * stages) == 0:
            axes[dim] = axes[dim] + (STAGE_AXIS,)
            break
    return NamedSharding(mesh, P(*[a if len(a) > 1 else (a[0] if a else None) for a in axes]))


def converter(layout: StackLayout | None, ends: EndsOnTheirStages, boxed_abstract, sharding,
              mesh) -> StateConverter | None:
    """The run's StateConverter from its boxed canonical abstract state (launch.stored_state) and
    its shardings in model order, or None where storage is model order throughout."""
    if layout is None and not ends.any:
        return None
    specs = nn.get_partition_spec(boxed_abstract)
    flags = layer_flags(specs)
    fp8_flags = flags.fp8
    if isinstance(fp8_flags, dict) and LAYERS in fp8_flags:  # fp8 state is unboxed: stacked by the scan
        flags = flags.replace(fp8={**fp8_flags, LAYERS: jax.tree_util.tree_map(lambda _: True, fp8_flags[LAYERS])})
    owners = stage_owners(specs, mesh.shape[STAGE_AXIS], ends.table, ends.head)
    return StateConverter(layout, flags, owners, sharding, nn.meta.unbox(boxed_abstract), mesh)
