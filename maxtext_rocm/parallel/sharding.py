"""The mesh, and the one table that maps the models' logical axes onto it.

Models name their axes ("embed", "heads", "activation_batch", ...) and never see a mesh. This
file alone decides where each logical axis lives, so changing parallelism is a config edit:

- data:      pure data parallelism (parameters replicated).
- fsdp:      data parallelism with parameters, gradients and optimizer state sharded (ZeRO-3).
- expert:    splits the experts of a MoE layer; dense parameters are FSDP-sharded over it.
- sequence:  splits activations along the sequence; parameters are FSDP-sharded over it.
- tensor:    Megatron-style tensor parallelism over heads, MLP and vocabulary.
- stage:     pipeline parallelism: the stacked layers split into contiguous stages
             (maxtext_rocm/parallel/pipeline/); everything else is replicated over it.
"""

from __future__ import annotations

import contextlib
import math

import jax
import numpy as np
from flax import linen as nn
from jax.experimental import mesh_utils
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from maxtext_rocm.config.choices import MESH_AXES
from maxtext_rocm.config.mesh_sizes import mesh_shape

# Mesh axes (MESH_AXES), outermost first: the innermost axis gets the closest devices, so tensor
# parallelism (a collective in every layer) rides the fastest links.

# Logical axis -> mesh axes. Linen takes the rules in table order and skips a rule whole if any
# of its mesh axes is already taken in the spec, so ("vocab", "embed") becomes ("tensor", ("fsdp",
# ...)), and expert weights name "exp_embed" (an "embed" after "exp" would be left unsharded).
LOGICAL_RULES: tuple[tuple[str, str | tuple[str, ...] | None], ...] = (
    # activations
    ("activation_batch", ("data", "fsdp", "expert")),
    ("activation_length", "sequence"),
    ("activation_embed", None),
    ("activation_heads", "tensor"),
    ("activation_kv_heads", "tensor"),
    ("activation_mlp", "tensor"),
    ("activation_vocab", "tensor"),
    # MoE capacity buffers [batch, experts, slots, ...]: experts over `expert`, so the batch keeps
    # only the other batch axes; moving tokens between the two layouts is the all-to-all.
    ("activation_exp", "expert"),
    ("activation_exp_batch", ("data", "fsdp")),
    ("activation_stage", "stage"),  # the pipeline's per-stage state [stages, ...]
    # parameters
    ("vocab", "tensor"),
    ("embed", ("fsdp", "sequence", "expert")),
    ("heads", "tensor"),
    ("kv_heads", "tensor"),
    ("head_dim", None),
    ("mlp", "tensor"),
    ("exp", "expert"),  # the experts of a MoE layer
    ("exp_embed", ("fsdp", "sequence")),  # d_model of expert weights: FSDP, minus `expert`
    ("norm", None),
    # Scanned layers [n_layers, ...]: a sharding, so the parameter tree is the same with and
    # without a pipeline, and checkpoints restore across stage counts (a circular or padded
    # pipeline stores the axis in its own order while training: parallel/pipeline/layout.py).
    ("layers", "stage"),
)

# The logical axes a weight is ZeRO-3-sharded along (over fsdp, and sequence and expert for dense
# weights): what a gather of the weights undoes. tensor ("heads", "mlp", ...) and expert ("exp")
# split the computation itself, and a gather of them would only add work.
ZERO3_AXES = ("embed", "exp_embed")


def rules_without_zero3() -> tuple:
    """LOGICAL_RULES with the ZeRO-3 axes unsharded: a weight's layout once gathered
    (parallel/pipeline/, pipeline.weight_gather="once")."""
    return tuple((name, None if name in ZERO3_AXES else target) for name, target in LOGICAL_RULES)


# Which model dimension each sharded parameter axis carries, for the divisibility check.
PARAM_AXIS_SIZES = {
    "vocab": "vocab_size",
    "embed": "d_model",
    "heads": "n_heads",
    "kv_heads": "n_kv_heads",
    "mlp": "mlp_dim",
    "exp": "n_experts",
}


def mesh_axes_of(logical: str) -> tuple[str, ...]:
    for name, target in LOGICAL_RULES:
        if name == logical:
            if target is None:
                return ()
            return (target,) if isinstance(target, str) else tuple(target)
    raise KeyError(f"logical axis {logical!r} has no rule")


def present_axes(mesh, logical: str) -> tuple[str, ...]:
    """The mesh axes of more than one device that `logical` maps to, for shard_map code
    (maxtext_rocm/parallel/): naming an axis of size 1 there would only add trivial collectives."""
    return tuple(a for a in mesh_axes_of(logical) if mesh.shape[a] > 1)


def make_mesh(mesh_cfg, devices=None) -> Mesh:
    """Builds the ICI x DCN mesh from `cfg.mesh` over `devices` (default: all of them)."""
    devices = list(jax.devices() if devices is None else devices)
    process_count = len({d.process_index for d in devices})
    shape = mesh_shape(mesh_cfg, len(devices), process_count)
    ici = [shape["ici"][a] for a in MESH_AXES]
    dcn = [shape["dcn"][a] for a in MESH_AXES]
    if process_count > 1:
        device_array = mesh_utils.create_hybrid_device_mesh(
            ici, dcn, devices, process_is_granule=True, allow_split_physical_axes=True)
    else:
        full = [i * d for i, d in zip(ici, dcn)]
        try:
            device_array = mesh_utils.create_device_mesh(
                full, devices, allow_split_physical_axes=True)
        except (ValueError, NotImplementedError, AssertionError):
            # Topology-unaware fallback (e.g. a subset of devices in tests).
            device_array = np.asarray(devices).reshape(full)
    # Auto axes: XLA propagates shardings between the constraints we give it. Explicit axes
    # (jax.make_mesh's default now) reject the embedding gather and shard_map inputs.
    return Mesh(device_array, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES))


def logical_to_sharding(logical_specs, mesh: Mesh):
    """Maps a pytree of logical PartitionSpecs to NamedShardings on `mesh`."""
    return nn.logical_to_mesh_sharding(logical_specs, mesh, LOGICAL_RULES)


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """Sequences split over the batch axes, tokens over `sequence`."""
    spec = nn.logical_to_mesh_axes(("activation_batch", "activation_length"), LOGICAL_RULES)
    return NamedSharding(mesh, spec)


def batch_rows_of_process(mesh: Mesh, global_batch: int, seq_len: int) -> tuple[int, int]:
    """(index, count) for this process's data source: the processes fall into `count` groups by
    the set of batch rows their devices hold, and this one is in group `index` (groups ordered by
    their first row). Usually every process holds rows of its own (count = the process count);
    processes that differ only along axes the batch is not split over (a pipeline's `stage`
    across hosts) hold the same rows, so they must load the same data."""
    rows_of = {}
    for device, index in batch_sharding(mesh).devices_indices_map((global_batch, seq_len)).items():
        rows = index[0]
        rows_of.setdefault(device.process_index, set()).add(
            (rows.start or 0, global_batch if rows.stop is None else rows.stop))
    groups = sorted({frozenset(r) for r in rows_of.values()}, key=min)
    mine = frozenset(rows_of[jax.process_index()])
    if sum(b - a for a, b in mine) * len(groups) != global_batch:
        raise ValueError(f"the processes' batch rows do not split the batch of {global_batch} evenly: {groups}")
    return groups.index(mine), len(groups)


def rules_context(mesh: Mesh) -> contextlib.ExitStack:
    """The mesh and the logical-axis rules that the models' sharding constraints resolve against,
    as one context (tracing the step reads both)."""
    stack = contextlib.ExitStack()
    stack.enter_context(jax.set_mesh(mesh))
    stack.enter_context(nn.logical_axis_rules(LOGICAL_RULES))
    return stack


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec())


def check_param_divisibility(model_cfg, axis_sizes: dict[str, int]) -> str | None:
    """The first model dimension that its mesh axes cannot split evenly, as a sentence."""
    for logical, key in PARAM_AXIS_SIZES.items():
        if logical == "exp" and model_cfg.n_experts == 1:
            continue  # a dense model has no expert weights; the expert axis only splits its batch
        axes = [a for a in mesh_axes_of(logical) if axis_sizes.get(a, 1) > 1]
        shards = math.prod(axis_sizes[a] for a in axes)
        if model_cfg[key] % shards:
            return (f"model.{key}={model_cfg[key]} does not divide over the {shards} devices of mesh "
                    f"{' x '.join(axes)} that shard the {logical!r} axis; choose mesh sizes that divide it")
    return None


def describe(mesh: Mesh) -> str:
    return " x ".join(f"{a}={s}" for a, s in mesh.shape.items() if s > 1) or "single device"


def constrained_both_ways(tree, forward, backward):
    """`tree` constrained to the `forward` NamedShardings (None: unchanged) and its cotangent to
    the `backward` ones: a sharding constraint whose transpose lands elsewhere than the forward.
    A plain constraint's transpose puts the cotangent where the value was put, e.g. a gradient in
    a gathered layout that one more collective must then shard (parallel/pipeline/gather.py)."""
    def constrain(values, layouts):
        if layouts is None:
            return values
        return jax.tree_util.tree_map(jax.lax.with_sharding_constraint, values, layouts)

    @jax.custom_vjp
    def move(values):
        return constrain(values, forward)

    def move_forward(values):
        return move(values), None

    def move_backward(_, cotangent):
        return (constrain(cotangent, backward),)

    move.defvjp(move_forward, move_backward)
    return move(tree)


def nested_mesh(mesh: Mesh):
    """The mesh for a shard_map that may run inside another: inside pipeline.gather.per_batch_shard's
    shard_map (manual over the batch axes) a nested one must name the context's mesh, manual axes
    and all; elsewhere `mesh`."""
    context = jax.sharding.get_abstract_mesh()
    return context if not context.empty and context.manual_axes else mesh
