"""The one resolve step: a validated config, a mesh and a target in; a read-only config out with
no "auto" left (and pipeline.microbatches a count), so that everything after it (the model, the
step, the planner, config.json) reads the values that run. It sits just above the models and the
parallel algorithms whose knowledge it calls, below every reader of a resolved config (checkpoint
readers, the Trainer, the planner, the API).

What each "auto" becomes, and where that knowledge lives (each decision is called from here only):

| key | resolved to | decided in |
| --- | --- | --- |
| precision.fp8_format | "fnuz" on gfx942-class targets (MI300X/MI325X), else "ocp" | numerics/fp8.py |
| model.attention | cuDNN on CUDA in bf16, blockwise on ROCm (and CUDA fp32), on the CPU by length | models/attention.py |
| model.fuse_projections | "on" where mesh tensor > 1, else "off" | projection_fusion below |
| pipeline.microbatches | 0: the most, up to 4 per stage, that split each batch shard; 1 without a pipeline | config.checks |
| model.moe_impl | "dropless" everywhere | models/moe.py |
| model.context_parallel | "all_gather" | parallel/context.py |
| data.buckets | the lengths one-example rows pad to ("256,512,768,1024"), or "none" where rows are packed | data/buckets.py |

The result is an `ml_collections.FrozenConfigDict`: nothing after this step may write the config
(a write raises); a part that needs a variant (the planner's CPU stand-in for a GPU kernel) copies
the group it changes.
"""

from __future__ import annotations

import dataclasses

import jax
import ml_collections
import numpy as np
from jax.sharding import Mesh

from maxtext_rocm.config.checks import global_batch_size, pipeline_microbatches
from maxtext_rocm.data import buckets
from maxtext_rocm.models import attention, moe
from maxtext_rocm.numerics import fp8
from maxtext_rocm.numerics.precision import compute_dtype
from maxtext_rocm.parallel import context
from maxtext_rocm.parallel.pipeline.axes import STAGE_AXIS
from maxtext_rocm.parallel.sharding import mesh_axes_of


@dataclasses.dataclass(frozen=True)
class Target:
    """What the resolve step needs to know of the devices a program is for.

    platform: "cpu", "cuda" or "rocm" (a device's other platforms keep their own name, "tpu").
    fp8_fnuz: whether its matrix cores know only the FNUZ fp8 formats (gfx942: MI300X/MI325X).
    """

    platform: str
    fp8_fnuz: bool = False

    @classmethod
    def of_device(cls, device) -> Target:
        """The target a real jax device is (the Trainer's first device)."""
        return cls(attention.platform_of(device), fp8.is_fnuz_device(device))

    # A planner GPU kind's target ("mi300x", "h100"): planner/gpu_nodes.resolve_target.


def resolve(cfg, mesh: Mesh, target: Target, seq_len: int | None = None) -> ml_collections.FrozenConfigDict:
    """`cfg` (validated) with every "auto" decided for `mesh` and `target`, read-only; `cfg` itself
    is left as it was. Resolving a resolved config changes nothing. `seq_len`: the sequence length
    the program runs, where it is not train.seq_len (the notebook functions' own tokens).

    precision.fp8_format is resolved under every policy: under fp32 and bf16 it is the format fp8
    would use on this target, which nothing reads (no fp8 op is built), so that no "auto" is left
    and config.json says what an fp8 run on the same target would use."""
    out = ml_collections.ConfigDict(cfg.to_dict())
    out.precision.fp8_format = fp8.format_for(cfg.precision.fp8_format, target.fp8_fnuz)
    m = out.model
    m.attention = attention.implementation_for(m.attention, target.platform, compute_dtype(cfg.precision.policy),
                                               seq_len or cfg.train.seq_len, sinks=m.attention_sinks)
    m.fuse_projections = projection_fusion(m.fuse_projections, mesh)
    m.moe_impl = moe.resolve_implementation(m.moe_impl)
    m.context_parallel = context.resolve_mode(m.context_parallel)
    out.pipeline.microbatches = microbatches(cfg, mesh)
    sequence = context.layout(cfg.model, mesh.shape.get(context.AXIS, 1))  # each bucket splits over it
    out.data.buckets = buckets.resolved(cfg.data, cfg.train.seq_len, sequence.n_shards * sequence.chunks)
    return ml_collections.FrozenConfigDict(out)


def resolve_here(cfg, mesh: Mesh | None = None, seq_len: int | None = None) -> ml_collections.FrozenConfigDict:
    """`cfg` resolved for this process's first device and `mesh` (default: that device alone), for
    the notebook-facing functions (api.py, generate.py), which run without a Trainer."""
    device = jax.devices()[0]
    if mesh is None:
        mesh = Mesh(np.array([device]), ("data",))
    return resolve(cfg, mesh, Target.of_device(device), seq_len)


def projection_fusion(setting: str, mesh: Mesh) -> str:
    """model.fuse_projections: "auto" is "on" where it saves collectives (mesh tensor > 1: one
    reduction of x's gradient per fused group) and "off" elsewhere, where separate dots are
    faster (docs/figures.md)."""
    if setting != "auto":
        return setting
    return "on" if mesh.shape.get("tensor", 1) > 1 else "off"


def microbatches(cfg, mesh: Mesh) -> int:
    """pipeline.microbatches for `mesh`: a count as given; 0 (auto) the most, up to 4 per stage,
    that split each batch shard's sequences (per train.grad_accum micro-batch) evenly
    (config.checks.pipeline_microbatches). Without a pipeline (mesh stage = 1) the batch is one
    microbatch."""
    stages = mesh.shape.get(STAGE_AXIS, 1)
    if cfg.pipeline.microbatches:
        return cfg.pipeline.microbatches
    if stages <= 1:
        return 1
    shards = int(np.prod([mesh.shape[a] for a in mesh_axes_of("activation_batch")]))
    per_shard = global_batch_size(cfg, mesh.size) // cfg.train.grad_accum // shards
    return pipeline_microbatches(cfg.pipeline, stages, max(1, per_shard))

