"""pipeline.schedule="1f1b": each stage runs a microbatch's backward as soon as its cotangent
arrives, so a stage holds the layer residuals of at most 2S - 1 microbatches, not every
iteration's (legend: __init__.py).

A microbatch's backward can start before the others' forwards end only if its loss exists by
then, so this schedule takes the step's objective with it: the Decoder hands it a `Tail` (the
final norm, the LM head and the fused loss with this microbatch's targets, a pure function of its
variables; models/llama.py) and the schedule returns the objective, not the stack's output. The
whole of it is one `custom_vjp` whose forward runs the schedule, computing the objective and every
gradient, and whose backward scales them by the objective's cotangent.

The schedule is lockstep, as an SPMD program is: in iteration t stage s runs the forward of
microbatch t - s and the backward of microbatch t - (2S - 2 - s) (one_f_one_b_order.py, which
also orders the interleaved form below). Between them, in the same
iteration, the last stage's output goes to the tail (microbatch t - S + 1), whose cotangent starts
that microbatch's backward on the last stage at once; every other stage's backward takes the
cotangent the stage after it sent in the previous iteration (a collective-permute s + 1 -> s).
One loop of M + 2S - 2 iterations in three phases, each part a `cond` on t (the same on every
device, so XLA runs one branch) so that nothing runs that only the bubble would use:

- warm-up, t < S - 1: forwards only (no cotangent has reached any stage yet);
- steady, M iterations: a forward, the tail, a backward;
- cool-down, S - 1 iterations: backwards only.

Three loops, one per phase, held more: XLA copied the slot buffers inside the steady loop's body
(the 8B on 2 stages, remat none: 150.4 against 107.9 GiB of XLA:CPU temporaries). The conds are
named for the share of the iterations they run (one_f_one_b_loop.phase_scope), which the communication and
FLOPs counts read. (S-1) F + M (F + B) + (S-1) B: GPipe's time, bubble (S-1)/(M+S-1), without gpipe_recompute's
third forward. Memory: stage s holds microbatch m from its forward (t = m + s) to its backward
(t = m + 2S - 2 - s), 2(S - s) - 1 microbatches, 2S - 1 on the first stage; every stage keeps a
buffer of min(2S - 1, M) slots (the stages are one vmapped program). GPipe's autodiff keeps
M + S - 1 iterations' residuals, the bubble's included. Standard (asynchronous) 1F1B holds S on
its first stage because a backward there takes two forward's time; in lockstep each iteration
is one forward and one backward, and a microbatch's cotangent needs S - 1 iterations to come back.

Interleaved (pipeline.repeats = R > 1): each device holds R chunks of L/(S R) layers, chunk r of
device s being virtual stage r S + s, and the same loop runs one_f_one_b_order's order: the
microbatches in groups of S, each group round the devices R times forward and R times back, the
activations and cotangents going round a ring (S - 1 -> 0 and back) where plain 1F1B's stop at
the ends. R M + S - 1 iterations of forwards and as many of backwards, each 1/R of a stage's work:
the bubble is (S-1)/(R M+S-1), for R times the stage boundaries' activation traffic. Each chunk
has its own slots in one buffer (N_r for chunk r, sized by the order), about S (1 + 1/R) stages'
worth of residuals against plain 1F1B's 2S - 1. A chunk is picked per stage by a dynamic index
(its repeat differs between stages in one iteration), and its gradient added at that index.

What a microbatch's backward needs from its forward is taken from the forward's own `jax.vjp`:
its residuals are flattened, and those that are not an input of the stage (weights, positions,
segments, which the backward supplies again) are written to the microbatch's slot. So a slot
holds exactly what model.remat lets a layer keep, once per layer. Under model.remat="none" the
stage is checkpointed with "save_dots"'s policy (every matmul's output kept, elementwise work
recomputed): without it the residuals would include values that depend on the weights alone (a
weight cast to bf16, the fused gate-up kernel), a copy of the stage's weights per slot.

The tail runs on the last stage alone, each device on its own rows with the head gathered once
(tail.py). With untied embeddings the table is stored on the first stage and the head on
the last, a row per stage (layout.ends_on_their_stages), so neither gradient crosses `stage`.

Router losses and fp8 delayed state: the layers' sown router losses enter the objective
linearly (means times a weight), so their cotangent is known before the loop (`Tail.of_sown`'s
gradient) and each backward takes its own. The fp8 state's updates arrive from each backward as
its cotangent and merge over the real (stage, microbatch) uses as fp8.combine_updates merges
micro-batches; a slot no real layer uses keeps its state.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable

import jax
import jax.numpy as jnp
from flax import linen as nn
from jax.sharding import Mesh

from maxtext_rocm.models.llama import REMAT_POLICIES, Tail, TokenEmbedding
from maxtext_rocm.models.moe import AUX_LOSSES
from maxtext_rocm.parallel.pipeline.embedding import embedded_per_stage
from maxtext_rocm.parallel.pipeline.gather import GatheredOnce
from maxtext_rocm.parallel.pipeline.layout import ends_on_their_stages
from maxtext_rocm.parallel.pipeline.microbatches import split_microbatches
from maxtext_rocm.parallel.pipeline.one_f_one_b_loop import OneFOneBLoop
from maxtext_rocm.parallel.pipeline.schedules import Schedule, schedule_for
from maxtext_rocm.parallel.pipeline.stages import run_chunk, stage_stack
from maxtext_rocm.parallel.pipeline.tail import TailOnLastStage

Array = jax.Array


@dataclasses.dataclass(frozen=True)
class OneFOneB:
    """The Decoder's `layer_stack` strategy under pipeline.schedule="1f1b": it takes the Decoder's
    `Tail` and returns ((objective, sums), {AUX_LOSSES: what the real layers sowed}) instead of
    the stack's output (models/llama.py). `remat`: model.remat."""

    schedule: Schedule
    remat: str
    gather_once: bool = False
    # The embedding table stored on the first stage and the head on the last (layout.py's
    # ends_on_their_stages, both under 1f1b with untied embeddings): their variables come [S, ...],
    # each stage its own row.
    ends_on_their_stages: bool = False
    runs_the_loss = True  # the Decoder hands it the Tail

    def __call__(self, layers: nn.Module, make_layers: Callable, embedding: TokenEmbedding, tokens: Array,
                 positions: Array, segment_ids: Array | None, *, tail: Tail):
        schedule = self.schedule
        stack = stage_stack(layers, make_layers, schedule)
        staged = embedded_per_stage(embedding, tokens, schedule.stages, schedule.microbatches, schedule.mesh,
                                    tables_per_stage=self.ends_on_their_stages)
        gathered = GatheredOnce.of(stack.chunk_layers, staged[0, 0], positions, segment_ids, schedule.mesh,
                                   stack.first_chunk_args())
        chunk = functools.partial(run_chunk, stack.chunk_layers, stack.padded)
        if self.remat == "none":  # see the module's docstring: no residual may depend on the weights alone
            chunk = jax.checkpoint(chunk, policy=REMAT_POLICIES["save_dots"])
        split = functools.partial(split_microbatches, n=schedule.microbatches)
        rows = jax.tree_util.tree_map(split, tail.rows)
        pos_in, seg_in = (None if a is None else split(a) for a in (positions, segment_ids))
        on_last = TailOnLastStage.of(tail, schedule.mesh, self.ends_on_their_stages)
        loop = OneFOneBLoop(schedule, chunk, stack.slots, on_last,
                     gathered if self.gather_once else None, gathered.stored)
        sown_shape = loop.sown_shape(stack.params, stack.fp8_state, staged, pos_in, seg_in)
        sown_cotangent = _sown_cotangent(tail.of_sown, sown_shape, loop.real_work)
        objective, sums, sown = _pipelined_objective(loop)(
            stack.params, stack.fp8_state, staged, tail.variables, rows, pos_in, seg_in, sown_cotangent)
        kept = jax.tree_util.tree_map(loop.real_work, sown)
        kept = jax.lax.stop_gradient(kept)  # its share of the objective is in `objective` already
        return (objective + tail.of_sown({AUX_LOSSES: kept}), sums), {AUX_LOSSES: kept}


def _sown_cotangent(of_sown: Callable, sown_shape, real_work: Callable):
    """[S, R M + S - 1, K, ...]: the objective's derivative by each layer's sown value in each
    forward iteration (zero in the bubble), rows per stage: `of_sown` is linear, so its gradient at
    zero is its gradient everywhere. `real_work`: OneFOneBLoop.real_work."""
    def share(sown):
        kept = jax.tree_util.tree_map(real_work, sown)
        return of_sown({AUX_LOSSES: kept})
    zeros = jax.tree_util.tree_map(lambda s: jnp.zeros(s.shape, s.dtype), sown_shape)
    return jax.tree_util.tree_map(lambda a: jnp.swapaxes(a, 0, 1), jax.grad(share)(zeros))


def _pipelined_objective(loop: OneFOneBLoop) -> Callable:
    """objective(params, fp8_state, staged, tail_variables, rows, pos_in, seg_in, sown_cotangent)
    -> (objective, sums, sown [R M + S - 1, S, K, ...]), differentiable in params, staged and the
    tail's variables (and the fp8 state: its updates)."""

    @jax.custom_vjp
    def objective(params, fp8_state, staged, tail_variables, rows, pos_in, seg_in, sown_cotangent):
        result = loop.run(params, fp8_state, staged, tail_variables, rows, pos_in, seg_in, sown_cotangent,
                          with_backward=False)
        return result.objective, result.sums, result.sown

    def forward(params, fp8_state, staged, tail_variables, rows, pos_in, seg_in, sown_cotangent):
        result = loop.run(params, fp8_state, staged, tail_variables, rows, pos_in, seg_in, sown_cotangent,
                          with_backward=True)
        grads = (result.d_params, result.d_fp8, result.d_staged, result.d_tail)
        return (result.objective, result.sums, result.sown), grads

    def backward(grads, cotangents):
        d_params, d_fp8, d_staged, d_tail = grads
        g = cotangents[0]  # the objective's; the sums and sown values are reported, not differentiated
        times_g = functools.partial(jax.tree_util.tree_map, lambda d: (d * g).astype(d.dtype))
        # fp8: the state's update, whatever the objective's cotangent (numerics/fp8.py).
        return times_g(d_params), d_fp8, times_g(d_staged), times_g(d_tail), None, None, None, None

    objective.defvjp(forward, backward)
    return objective


def layer_stack(cfg, mesh: Mesh) -> OneFOneB | None:
    """pipeline.layer_stack's counterpart under pipeline.schedule="1f1b"; None on one stage."""
    schedule = schedule_for(cfg.pipeline, cfg.model, mesh)
    if schedule is None:
        return None
    return OneFOneB(schedule, cfg.model.remat, gather_once=cfg.pipeline.weight_gather == "once",
                    ends_on_their_stages=ends_on_their_stages(cfg, mesh).head)
