"""Counts a pipeline's schedule implies, read from the `pipeline` group: the chunks of layers each
stage device runs, whether 1F1B is interleaved, and the microbatch count that 0 (auto) stands for.
The checks (config/checks.py), the layer stack (parallel/) and the planner all count with these."""

from __future__ import annotations

from maxtext_rocm.config.keys_model import VIRTUAL_STAGE_SCHEDULES

# At most this many microbatches per stage under auto: GPipe's bubble (S-1)/(M+S-1) is ~47% at
# M = S (8 stages) and ~18% at M = 4S; past that each microbatch's matmuls shrink for little gain.
AUTO_MICROBATCHES_PER_STAGE = 4


def pipeline_microbatches(pipe, stages: int, sequences_per_shard: int) -> int:
    """pipeline.microbatches resolved. 0 (auto): the most, up to 4 per stage, that split each batch
    shard's `sequences_per_shard` (per train.grad_accum micro-batch) evenly; fewer than the stages
    only where the batch allows no more."""
    if pipe.microbatches:
        return pipe.microbatches
    counts = [m for m in range(1, AUTO_MICROBATCHES_PER_STAGE * stages + 1) if sequences_per_shard % m == 0]
    if interleaved(pipe):  # in groups of the stages (parallel/pipeline/one_f_one_b_order.py), where the batch allows
        counts = [m for m in counts if m % stages == 0] or counts
    return max(counts)


def chunks_per_device(pipe) -> int:
    """R: the chunks of layers each stage device runs, pipeline.repeats under the schedules with
    virtual stages (circular, 1f1b), 1 otherwise."""
    return pipe.repeats if pipe.schedule in VIRTUAL_STAGE_SCHEDULES else 1


def interleaved(pipe) -> bool:
    """Interleaved 1F1B: pipeline.schedule="1f1b" with pipeline.repeats > 1, which runs
    microbatches in groups of the stages."""
    return pipe.schedule == "1f1b" and pipe.repeats > 1
