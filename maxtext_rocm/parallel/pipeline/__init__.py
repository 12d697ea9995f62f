"""Pipeline parallelism over the `stage` mesh axis: the scanned layers split over the stage
devices, the batch into microbatches that flow through them.

Legend, in shapes and formulas: S stages (devices along `stage`), R repeats (chunks of layers per
device), K slots per chunk (layers, empty ones included), M microbatches, L layers; t is the
loop's iteration and i = t - s the pass stage s works on in it (microbatch i mod M, repeat i // M).

The schedules (pipeline.schedule), each an order over a lockstep loop of iterations:

- "gpipe": device s runs layers [s L/S, (s+1) L/S). M + S - 1 iterations; stage 0 takes
  microbatch t, every stage runs its layers on what it holds, and the outputs shift one stage on.
  Bubble (S-1)/(M+S-1). schedules.GPipe, over loop.run_loop.
- "circular" (pipeline.repeats = R > 1): S R chunks, chunk v on device v mod S; each microbatch
  goes round the devices R times, R M + S - 1 iterations of 1/R the work each: bubble
  (S-1)/(R M+S-1). schedules.Circular, over the same loop. One repeat is GPipe and runs as it.
- "gpipe_recompute": GPipe's order with a hand-written backward that recomputes one microbatch's
  stage at a time (gpipe_recompute.py).
- "1f1b" (and interleaved with R > 1): each microbatch's backward as soon as its cotangent
  arrives, the loss inside the loop (one_f_one_b.py; its order one_f_one_b_order.py, its loop
  one_f_one_b_loop.py).

Beside them: how a stage runs its chunk (stages.py), the permutes between stages (transfers.py),
each stage's own embedding lookup (embedding.py), which iterations do real work (real_work.py),
the microbatch count and split (microbatches.py), the weights gathered once (gather.py), the loss
on the last stage (tail.py) and the stack's storage order (layout.py).
"""

from __future__ import annotations

from jax.sharding import Mesh

from maxtext_rocm.parallel.pipeline.axes import STAGE_AXIS
from maxtext_rocm.parallel.pipeline.schedules import bubble_fraction, describe

__all__ = ["STAGE_AXIS", "bubble_fraction", "describe", "layer_stack"]


def layer_stack(cfg, mesh: Mesh):
    """The Decoder's `layer_stack` strategy for `mesh` under cfg.pipeline's schedule (models/llama.py),
    or None where the mesh has one stage and the layers run in order on every device."""
    from maxtext_rocm.parallel.pipeline import gpipe_recompute, loop, one_f_one_b

    if cfg.pipeline.schedule == "1f1b":  # the loss runs inside its own loop
        return one_f_one_b.layer_stack(cfg, mesh)
    # gpipe_recompute: GPipe's order with its own backward loop
    recompute = cfg.pipeline.schedule == "gpipe_recompute"
    return loop.layer_stack(cfg, mesh, loop=gpipe_recompute.loop if recompute else None)
