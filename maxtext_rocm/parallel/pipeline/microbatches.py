"""How many microbatches a pipeline splits each batch shard into, and the split itself."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from maxtext_rocm.config.checks import pipeline_microbatches
from maxtext_rocm.parallel.pipeline.axes import STAGE_AXIS

Array = jax.Array


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


def resolved_microbatches(pipeline_cfg) -> int:
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
