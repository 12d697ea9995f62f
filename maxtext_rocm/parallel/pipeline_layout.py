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

Words: "the layer stack" is always the scanned layers' arrays, [n_layers, ...] in model order (a
leading "layers" axis); `StackLayout` is where its rows sit in storage; a `StateConverter` moves a
state between the two orders.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import linen as nn
from jax.sharding import NamedSharding, PartitionSpec as P

LAYERS = "layers"  # the stacked layers' logical axis (models/llama.py, sharding.py)
STAGE_AXIS = "stage"


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


def _map_layer_leaves(fn, tree, flags):
    """`fn` on each leaf that `flags` marks as a layer leaf; the others as they are."""
    return jax.tree_util.tree_map(lambda x, is_layer: fn(x) if is_layer else x, tree, flags)


class _Conversion:
    """One direction for one tree: a program over the layer leaves alone (the others are passed
    through as they are, not copied) that lays each out as `out_shardings` says."""

    def __init__(self, fn, flags, out_shardings):
        self.flags = jax.tree_util.tree_leaves(flags)
        picked = [s for s, is_layer in zip(jax.tree_util.tree_leaves(out_shardings), self.flags) if is_layer]
        self.program = jax.jit(lambda xs: [fn(x) for x in xs], out_shardings=picked)

    def __call__(self, tree):
        leaves, treedef = jax.tree_util.tree_flatten(tree)
        converted = iter(self.program([x for x, is_layer in zip(leaves, self.flags) if is_layer]))
        return treedef.unflatten([next(converted) if is_layer else x for x, is_layer in zip(leaves, self.flags)])


class StateConverter:
    """The conversions of one run's state (and of its parameters alone) between storage and model
    order, and the state's canonical abstract arrays, which checkpoints are restored into."""

    def __init__(self, layout: StackLayout, flags, storage_sharding, canonical_shapes, mesh):
        self.layout, self.flags = layout, flags
        canonical_sharding = jax.tree_util.tree_map(
            lambda s, x, is_layer: _canonical_sharding(s, x.shape, mesh) if is_layer else s,
            storage_sharding, canonical_shapes, flags)
        self.canonical_abstract = jax.tree_util.tree_map(
            lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), canonical_shapes, canonical_sharding)
        self.to_storage = _Conversion(layout.to_storage, flags, storage_sharding)
        self.to_canonical = _Conversion(layout.to_canonical, flags, canonical_sharding)
        self.params_to_storage = _Conversion(layout.to_storage, flags.params, storage_sharding.params)
        self.params_to_canonical = _Conversion(layout.to_canonical, flags.params, canonical_sharding.params)

    def storage_shapes(self, tree):
        """`tree`'s canonical ShapeDtypeStructs with the layer axis as long as the storage."""
        return _map_layer_leaves(lambda x: jax.ShapeDtypeStruct((self.layout.slots, *x.shape[1:]), x.dtype),
                                 tree, self.flags)


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


def converter(layout: StackLayout | None, boxed_abstract, storage_sharding, mesh) -> StateConverter | None:
    """The run's StateConverter from its boxed canonical abstract state (launch.stored_state)."""
    if layout is None:
        return None
    flags = layer_flags(nn.get_partition_spec(boxed_abstract))
    fp8_flags = flags.fp8
    if isinstance(fp8_flags, dict) and LAYERS in fp8_flags:  # fp8 state is unboxed: stacked by the scan
        flags = flags.replace(fp8={**fp8_flags, LAYERS: jax.tree_util.tree_map(lambda _: True, fp8_flags[LAYERS])})
    return StateConverter(layout, flags, storage_sharding, nn.meta.unbox(boxed_abstract), mesh)
