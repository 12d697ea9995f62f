"""The microbatches a pipeline splits each batch shard into (their count resolved by
maxtext_rocm/resolve.py), and the split itself."""

from __future__ import annotations

import jax
import jax.numpy as jnp

Array = jax.Array


def resolved_microbatches(pipeline_cfg) -> int:
    """pipeline.microbatches as the resolve step (maxtext_rocm/resolve.py) counted it."""
    if not pipeline_cfg.microbatches:
        raise ValueError("pipeline.microbatches=0 (auto) reached the pipeline: the config was not resolved "
                         "(maxtext_rocm.resolve.resolve() was skipped)")
    return pipeline_cfg.microbatches


def split_microbatches(x: Array, n: int) -> Array:
    """[B, ...] -> [n, B/n, ...], every n-th row: each microbatch keeps every batch shard's share
    (as step.split_micro_batches does), so splitting moves no data."""
    return jnp.swapaxes(x.reshape(x.shape[0] // n, n, *x.shape[1:]), 0, 1)


def merge_microbatches(x: Array) -> Array:
    """The inverse of split_microbatches."""
    return jnp.swapaxes(x, 0, 1).reshape(x.shape[0] * x.shape[1], *x.shape[2:])
