"""pipeline.schedule="1f1b": each stage runs a microbatch's backward as soon as its cotangent
arrives, so a stage holds the layer residuals of at most 2S - 1 microbatches, not every
iteration's (legend: pipeline.py).

A microbatch's backward can start before the others' forwards end only if its loss exists by
then, so this schedule takes the step's objective with it: the Decoder hands it a `Tail` (the
final norm, the LM head and the fused loss with this microbatch's targets, a pure function of its
variables; models/llama.py) and the schedule returns the objective, not the stack's output. The
whole of it is one `custom_vjp` whose forward runs the schedule, computing the objective and every
gradient, and whose backward scales them by the objective's cotangent.

The schedule is lockstep, as an SPMD program is: in iteration t stage s runs the forward of
microbatch t - s and the backward of microbatch t - (2S - 2 - s) (pipeline_1f1b_order.py, which
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
named for the share of the iterations they run (`phase_scope`), which the communication and
FLOPs counts read. (S-1) F + M (F + B) + (S-1) B: GPipe's time, bubble (S-1)/(M+S-1), without gpipe_recompute's
third forward. Memory: stage s holds microbatch m from its forward (t = m + s) to its backward
(t = m + 2S - 2 - s), 2(S - s) - 1 microbatches, 2S - 1 on the first stage; every stage keeps a
buffer of min(2S - 1, M) slots (the stages are one vmapped program). GPipe's autodiff keeps
M + S - 1 iterations' residuals, the bubble's included. Standard (asynchronous) 1F1B holds S on
its first stage because a backward there takes two forward's time; in lockstep each iteration
is one forward and one backward, and a microbatch's cotangent needs S - 1 iterations to come back.

Interleaved (pipeline.repeats = R > 1): each device holds R chunks of L/(S R) layers, chunk r of
device s being virtual stage r S + s, and the same loop runs pipeline_1f1b_order's order: the
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
(pipeline_tail.py). With untied embeddings the table is stored on the first stage and the head on
the last, a row per stage (pipeline_layout.ends_on_their_stages), so neither gradient crosses `stage`.

Router losses and fp8 delayed state: the layers' sown router losses enter the objective
linearly (means times a weight), so their cotangent is known before the loop (`Tail.of_sown`'s
gradient) and each backward takes its own. The fp8 state's updates arrive from each backward as
its cotangent and merge over the real (stage, microbatch) uses as fp8.combine_updates merges
micro-batches; a slot no real layer uses keeps its state.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
from flax import linen as nn
from jax.sharding import Mesh

from maxtext_rocm.models.llama import REMAT_POLICIES, Tail, TokenEmbedding
from maxtext_rocm.models.moe import AUX_LOSSES
from maxtext_rocm.numerics import fp8
from maxtext_rocm.numerics.fp8 import FP8_COLLECTION
from maxtext_rocm.parallel.pipeline import (
    STAGE_AXIS, STATE_AXES, TOKEN_AXES, Schedule, _is_first, _permute, _real_work,
    embedded_per_stage, run_chunk, schedule_for, split_microbatches, stage_stack)
from maxtext_rocm.parallel.pipeline_1f1b_order import OneFOneBOrder
from maxtext_rocm.parallel.pipeline_gather import GatheredOnce
from maxtext_rocm.parallel.pipeline_layout import ends_on_their_stages
from maxtext_rocm.parallel.pipeline_recompute import SAVED_AXES, _read, _write
from maxtext_rocm.parallel.pipeline_tail import TailOnLastStage

Array = jax.Array


@dataclasses.dataclass(frozen=True)
class OneFOneB:
    """The Decoder's `layer_stack` strategy under pipeline.schedule="1f1b": it takes the Decoder's
    `Tail` and returns ((objective, sums), {AUX_LOSSES: what the real layers sowed}) instead of
    the stack's output (models/llama.py). `remat`: model.remat."""

    schedule: Schedule
    remat: str
    gather_once: bool = False
    # The embedding table stored on the first stage and the head on the last (pipeline_layout.py's
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
        gathered = GatheredOnce.of(stack.chunk_layers, staged[0, 0], positions, segment_ids, schedule.mesh)
        chunk = functools.partial(run_chunk, stack.chunk_layers, stack.padded)
        if self.remat == "none":  # see the module's docstring: no residual may depend on the weights alone
            chunk = jax.checkpoint(chunk, policy=REMAT_POLICIES["save_dots"])
        split = functools.partial(split_microbatches, n=schedule.microbatches)
        rows = jax.tree_util.tree_map(split, tail.rows)
        pos_in, seg_in = (None if a is None else split(a) for a in (positions, segment_ids))
        loop = _Loop(schedule, chunk, stack.real, TailOnLastStage.of(tail, schedule.mesh, self.ends_on_their_stages),
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
    zero is its gradient everywhere. `real_work`: _Loop.real_work."""
    def share(sown):
        kept = jax.tree_util.tree_map(real_work, sown)
        return of_sown({AUX_LOSSES: kept})
    zeros = jax.tree_util.tree_map(lambda s: jnp.zeros(s.shape, s.dtype), sown_shape)
    return jax.tree_util.tree_map(lambda a: jnp.swapaxes(a, 0, 1), jax.grad(share)(zeros))


def _pipelined_objective(loop: "_Loop") -> Callable:
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


class _Result(NamedTuple):
    objective: Array
    sums: dict
    sown: object  # [R M + S - 1, S, K, ...] per leaf, by forward iteration (_Loop.real_work reads it)
    d_params: object
    d_fp8: object
    d_staged: Array
    d_tail: object


class _Pullback(NamedTuple):
    """How a stage's forward `jax.vjp` is rebuilt for its backward: the pullback's tree, and for
    each of its leaves the index of the stage input it is (weights, positions, segments, which
    the backward supplies), or None (a residual, kept in the microbatch's slot)."""
    treedef: object
    source: tuple


class _Loop:
    """The schedule's loop (module docstring) for `schedule` (its stages, repeats and
    microbatches, in pipeline_1f1b_order's order), `chunk` (pipeline.run_chunk's contract, its
    layers bound), `real` [S, R, K] (False: an empty slot) and `tail` (pipeline_tail.py).
    `gathered`: a GatheredOnce when pipeline.weight_gather="once"; `stored`: the weights' stored
    NamedShardings, the gradient's layout in every iteration."""

    def __init__(self, schedule: Schedule, chunk: Callable, real: Array, tail: TailOnLastStage,
                 gathered: GatheredOnce | None, stored):
        self.schedule, self.mesh = schedule, schedule.mesh
        self.stages, self.repeats, self.microbatches = schedule.stages, schedule.repeats, schedule.microbatches
        self.order = OneFOneBOrder(self.stages, self.repeats, self.microbatches)
        self.chunk, self.real, self.tail = chunk, real, tail
        self.gathered, self.stored = gathered, stored
        self.pullback: _Pullback | None = None  # set by the first trace of a stage's forward

    def real_work(self, leaf: Array) -> Array:
        """pipeline._real_work in this order: a sown leaf [R M + S - 1, S, K, ...] -> [M L, ...]."""
        table = self.order.forward_table()
        return _real_work(self.schedule.layout, self.microbatches, leaf, passes=(table.repeat, table.real))

    # One stage's work (vmapped over the stages)

    def _pick(self, stage_vars, stage_real, repeat):
        """The chunk `repeat` of one stage's [R, K, ...] block and its [K] slots' reality, as the
        schedule picks it (GPipe's static index with one repeat, Circular's dynamic one)."""
        pick = functools.partial(self.schedule.pick_chunk, repeat=repeat)
        return jax.tree_util.tree_map(pick, stage_vars), pick(stage_real)

    def _stage(self, stage_vars, stage_real, repeat, h, pos, seg):
        """One stage's forward: its chunk `repeat` on `h`; (out, sown)."""
        return self.chunk(*self._pick(stage_vars, stage_real, repeat), h, pos, seg)

    def _forward_keeping(self, stage_vars, stage_real, repeat, h, pos, seg):
        """(out, sown, the residuals to keep): one stage's forward under jax.vjp. The chunk is
        taken out of the stage's [R, K, ...] block first, so that the weights the pullback keeps
        are the chunk itself, which _backward supplies again, not a slice of it made inside."""
        chunk_vars, chunk_real = self._pick(stage_vars, stage_real, repeat)
        (out, sown), pull = jax.vjp(lambda v, x: self.chunk(v, chunk_real, x, pos, seg), chunk_vars, h)
        leaves, treedef = jax.tree_util.tree_flatten(pull)
        inputs = self._inputs(chunk_vars, chunk_real, pos, seg)
        source = tuple(next((j for j, known in enumerate(inputs) if leaf is known), None) for leaf in leaves)
        if self.pullback is None:
            self.pullback = _Pullback(treedef, source)
        elif source != self.pullback.source:  # every trace of the same stage must agree
            raise AssertionError("a stage's forward kept different residuals in two traces")
        return out, sown, [leaf for leaf, j in zip(leaves, source) if j is None]

    def _backward(self, stage_vars, stage_real, repeat, kept, pos, seg, d_out, d_sown):
        """(the chunk variables' cotangents [K, ...], the input's): one stage's pullback, rebuilt
        from its slot."""
        chunk_vars, chunk_real = self._pick(stage_vars, stage_real, repeat)
        inputs, residuals = self._inputs(chunk_vars, chunk_real, pos, seg), iter(kept)
        leaves = [next(residuals) if j is None else inputs[j] for j in self.pullback.source]
        return jax.tree_util.tree_unflatten(self.pullback.treedef, leaves)((d_out, d_sown))

    @staticmethod
    def _inputs(chunk_vars, chunk_real, pos, seg) -> list:
        return [*jax.tree_util.tree_leaves(chunk_vars), chunk_real, pos, *([] if seg is None else [seg])]

    # The schedule

    def _tokens(self, pos_in, seg_in, micro):
        pos = nn.with_logical_constraint(jnp.take(pos_in, micro, axis=0), TOKEN_AXES)
        seg = None if seg_in is None else nn.with_logical_constraint(jnp.take(seg_in, micro, axis=0), TOKEN_AXES)
        return pos, seg

    def _variables(self, params, fp8_state):
        return {"params": params} if fp8_state is None else {"params": params, FP8_COLLECTION: fp8_state}

    def _into_chunk(self, total, chunk_d, repeat):
        """`total` [S, R, K, ...] plus each stage's `chunk_d` [S, K, ...] at its chunk `repeat` [S]."""
        if self.repeats == 1:
            return total + chunk_d[:, None].astype(total.dtype)
        def add(block, d, r):
            at = jax.lax.dynamic_index_in_dim(block, r, axis=0, keepdims=True)
            return jax.lax.dynamic_update_index_in_dim(block, at + d[None].astype(block.dtype), r, axis=0)
        return jax.vmap(add, spmd_axis_name=STAGE_AXIS)(total, chunk_d, repeat)

    def sown_shape(self, params, fp8_state, staged, pos_in, seg_in):
        """The sown values' shapes, [R M + S - 1, S, K, ...] (nothing is computed)."""
        def one(params, fp8_state, staged, pos_in, seg_in):
            first = jnp.zeros((self.stages,), jnp.int32)
            pos, seg = self._tokens(pos_in, seg_in, first)
            run = jax.vmap(self._stage, spmd_axis_name=STAGE_AXIS)
            _, sown = run(self._variables(params, fp8_state), self.real, first, staged[:, 0], pos, seg)
            return sown
        per_iteration = jax.eval_shape(one, params, fp8_state, staged, pos_in, seg_in)
        n = self.order.n_forward_iterations
        return jax.tree_util.tree_map(lambda s: jax.ShapeDtypeStruct((n, *s.shape), s.dtype), per_iteration)

    def run(self, params, fp8_state, staged, tail_variables, rows, pos_in, seg_in, sown_cotangent, *,
            with_backward: bool) -> _Result:
        S, R, M, mesh, order = self.stages, self.repeats, self.microbatches, self.mesh, self.order
        stage_ids = jnp.arange(S)
        if self.gathered is not None:
            params = jax.tree_util.tree_map(jax.lax.with_sharding_constraint, params, self.gathered.gathered)
        stage_vars = self._variables(params, fp8_state)
        tail_variables = self.tail.gathered(tail_variables)  # once, before the loop
        forward_keeping = jax.vmap(self._forward_keeping, spmd_axis_name=STAGE_AXIS)
        forward_only = jax.vmap(self._stage, spmd_axis_name=STAGE_AXIS)
        backward = jax.vmap(self._backward, spmd_axis_name=STAGE_AXIS)
        per_stage_read, per_stage_write = (jax.vmap(f, spmd_axis_name=STAGE_AXIS) for f in (_read, _write))
        is_last = (stage_ids == S - 1).reshape(-1, 1, 1, 1)
        # Plain 1F1B sends activations one stage on and cotangents one back; interleaved, both go
        # round the ring (the last stage's output is stage 0's next chunk's input, and back).
        forward_pairs = [(s, (s + 1) % S) for s in range(S if R > 1 else S - 1)]
        backward_pairs = [(b, a) for a, b in forward_pairs]

        def per_stage(mask, tree):  # tree's leaves [S, ...] where mask [S], zeros elsewhere
            return jax.tree_util.tree_map(
                lambda a: jnp.where(mask.reshape(-1, *(1,) * (a.ndim - 1)), a, jnp.zeros_like(a)), tree)

        def forward_step(carry, t):
            work = order.forward(t, stage_ids)
            fresh = jax.lax.dynamic_index_in_dim(staged, work.micro[0], axis=1, keepdims=False)
            takes_fresh = _is_first(carry["out"]) & (work.repeat[0] == 0)
            h = jnp.where(takes_fresh, fresh, _permute(carry["out"], mesh, forward_pairs))
            h = nn.with_logical_constraint(h, STATE_AXES)
            pos, seg = self._tokens(pos_in, seg_in, work.micro)
            if not with_backward:
                out, sown = forward_only(stage_vars, self.real, work.repeat, h, pos, seg)
            else:
                out, sown, kept = forward_keeping(stage_vars, self.real, work.repeat, h, pos, seg)
                slot = order.slot(work.micro, work.repeat)
                carry["slots"] = [per_stage_write(buffer, leaf, slot, work.real)
                                  for buffer, leaf in zip(carry["slots"], kept)]
            carry["out"] = nn.with_logical_constraint(out, STATE_AXES)
            return carry, sown

        def tail_step(carry, t):
            """The last stage's output (a microbatch's last chunk) through the tail, on that stage;
            the cotangent it sends back [S, mb, seq, d] (zeros on the other stages)."""
            _, micro = order.tail(t)
            rows_now = jax.tree_util.tree_map(lambda r: jax.lax.dynamic_index_in_dim(r, micro, 0, False), rows)
            objective, sums, d_tail, d_y = self.tail(carry["out"], tail_variables, rows_now, with_backward)
            carry["objective"] = carry["objective"] + objective
            carry["sums"] = jax.tree_util.tree_map(jnp.add, carry["sums"], sums)
            if with_backward:
                carry["d_tail"] = jax.tree_util.tree_map(jnp.add, carry["d_tail"], d_tail)
            return carry, d_y

        def backward_step(carry, t, d_y):
            """Each stage differentiates its backward pass; the last stage's last chunk from `d_y`."""
            work = order.backward(t, stage_ids)
            from_next = _permute(carry["d_h"], mesh, backward_pairs)
            from_tail = is_last & (work.repeat == R - 1).reshape(-1, 1, 1, 1)
            d_out = from_next if d_y is None else jnp.where(from_tail, d_y, from_next)
            d_out = nn.with_logical_constraint(per_stage(work.real, d_out), STATE_AXES)
            d_sown = jax.tree_util.tree_map(lambda c: per_stage_read(c, work.forward_iteration), sown_cotangent)
            d_sown = per_stage(work.real, d_sown)
            slot = order.slot(work.micro, work.repeat)
            kept = [per_stage_read(buffer, slot) for buffer in carry["slots"]]
            pos, seg = self._tokens(pos_in, seg_in, work.micro)
            d_vars, d_h = backward(stage_vars, self.real, work.repeat, kept, pos, seg, d_out, d_sown)
            # A clamped pass's slot holds another's residuals (or none): its results are dropped.
            d_vars, d_h = per_stage(work.real, d_vars), per_stage(work.real, d_h)
            carry["d_params"] = jax.tree_util.tree_map(
                jax.lax.with_sharding_constraint,
                jax.tree_util.tree_map(functools.partial(self._into_chunk, repeat=work.repeat),
                                       carry["d_params"], d_vars["params"]),
                self.stored)
            if fp8_state is not None:  # a real layer of the chunk run, on a real microbatch: [S, R, K]
                uses = (work.real[:, None] & (work.repeat[:, None] == jnp.arange(R)))[..., None] & self.real
                update = jax.tree_util.tree_map(lambda d: d[:, None], d_vars[FP8_COLLECTION])
                carry["d_fp8"] = _merged(carry["d_fp8"], update, uses)
            carry["d_h"] = nn.with_logical_constraint(d_h, STATE_AXES)
            # Stage 0's cotangent of its first chunk's input is the embeddings'.
            carry["d_first"] = per_stage_write(carry["d_first"], carry["d_h"], work.micro,
                                               work.real & (work.repeat == 0))
            return carry

        def iteration(carry, t):
            """Iteration t: a forward while microbatches pass (t < R M + S - 1), the tail where the
            last stage finishes a microbatch's last chunk, a backward once cotangents arrive
            (t >= R S - 1). Each part is a `cond` on t, the same on every device, so an iteration
            runs only the parts its phase has."""
            with phase_scope(order.n_forward_iterations, iterations):
                carry, sown = jax.lax.cond(t < order.n_forward_iterations, lambda c: forward_step(c, t),
                                           lambda c: (c, _zeros(sown_now)), carry)
            with phase_scope(M, iterations):
                carry, d_y = jax.lax.cond(order.tail(t)[0], lambda c: tail_step(c, t),
                                          lambda c: (c, None if d_y_now is None else _zeros(d_y_now)), carry)
            if with_backward:
                with phase_scope(iterations - order.backward_offset, iterations):
                    carry = jax.lax.cond(t >= order.backward_offset, lambda c: backward_step(c, t, d_y),
                                         lambda c: c, carry)
            return carry, sown

        activations = jnp.zeros((S, *staged.shape[2:]), staged.dtype)
        first_rows = jax.tree_util.tree_map(lambda r: r[0], rows)
        sums_shape = jax.eval_shape(lambda v, x: self.tail.apply(self.tail.local(v), x, first_rows)[1],
                                    tail_variables, staged[0, 0])
        devices = self.tail.devices  # the tail's partial sums, one per device
        carry = {"out": activations, "objective": jnp.zeros((devices,), jnp.float32),
                 "sums": jax.tree_util.tree_map(lambda s: jnp.zeros((devices, *s.shape), s.dtype), sums_shape)}
        first = jnp.zeros((S,), jnp.int32)
        if with_backward:
            kept_shapes = jax.eval_shape(lambda *a: forward_keeping(*a)[2], stage_vars, self.real, first,
                                         staged[:, 0], *self._tokens(pos_in, seg_in, first))
            carry.update(
                slots=[jnp.zeros((s.shape[0], order.n_slots, *s.shape[1:]), s.dtype) for s in kept_shapes],
                d_h=activations, d_first=nn.with_logical_constraint(jnp.zeros_like(staged), SAVED_AXES),
                d_params=jax.tree_util.tree_map(jnp.zeros_like, params),
                d_tail=self.tail.zeros(tail_variables),
                d_fp8=None if fp8_state is None else fp8.merge_identity(fp8_state))
        sown_now = jax.tree_util.tree_map(lambda a: jax.ShapeDtypeStruct(a.shape[1:], a.dtype),
                                          self.sown_shape(params, fp8_state, staged, pos_in, seg_in))
        d_y_now = jax.ShapeDtypeStruct(activations.shape, activations.dtype) if with_backward else None
        iterations = order.n_iterations if with_backward else order.n_forward_iterations
        carry, sown = jax.lax.scan(iteration, carry, jnp.arange(iterations))
        sown = jax.tree_util.tree_map(lambda a: a[:order.n_forward_iterations], sown)  # the forward iterations'

        # Each device's share (only the last stage's are not zero): one sum over the stage and the
        # batch axes a step, for the tail's variables a reduction of the head's gradient.
        objective, sums = carry["objective"].sum(0), jax.tree_util.tree_map(lambda a: a.sum(0), carry["sums"])
        if not with_backward:
            return _Result(objective, sums, sown, None, None, None, None)
        # Stage 0's input cotangents are the embeddings'; the other stages' rows are no input's.
        d_first = carry["d_first"]
        d_staged = nn.with_logical_constraint(jnp.where(_is_first(d_first), d_first, jnp.zeros_like(d_first)),
                                              SAVED_AXES)
        d_fp8 = None
        if fp8_state is not None:  # a slot no real layer used keeps its state
            used = self.schedule.layout.real  # numpy: [S, R, K]
            d_fp8 = jax.tree_util.tree_map(
                lambda new, old: jnp.where(used.reshape(*used.shape, *(1,) * (old.ndim - used.ndim)), new, old),
                carry["d_fp8"], fp8_state)
        d_tail = self.tail.reduced(carry["d_tail"])
        return _Result(objective, sums, sown, carry["d_params"], d_fp8, d_staged, d_tail)


def phase_scope(runs: int, of: int):
    """A name for the `cond` of a schedule phase that runs in `runs` of its loop's `of` iterations.
    XLA's program shows a conditional inside a loop as running in every iteration; the
    communication and FLOPs counts (planner/comm.py, scripts/dcn_bytes.py) read this name from the
    conditional's op_name and count its larger branch `runs` times, not `of`."""
    return jax.named_scope(f"phase_runs_{runs}_of_{of}")


def _zeros(shapes):
    return jax.tree_util.tree_map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)


def _merged(combined, update, uses: Array):
    """fp8.combine_updates of `combined` [S, R, K, ...] and one backward's `update` [S, 1, K, ...]
    where `uses` [S, R, K] (a real layer of the chunk run, on a real microbatch), `combined`
    elsewhere."""
    merged = fp8.combine_updates(combined, update)
    return jax.tree_util.tree_map(
        lambda new, old: jnp.where(uses.reshape(*uses.shape, *(1,) * (old.ndim - uses.ndim)), new, old),
        merged, combined)


def layer_stack(cfg, mesh: Mesh) -> OneFOneB | None:
    """pipeline.layer_stack's counterpart under pipeline.schedule="1f1b"; None on one stage."""
    schedule = schedule_for(cfg.pipeline, cfg.model, mesh)
    if schedule is None:
        return None
    return OneFOneB(schedule, cfg.model.remat, gather_once=cfg.pipeline.weight_gather == "once",
                    ends_on_their_stages=ends_on_their_stages(cfg, mesh).head)
