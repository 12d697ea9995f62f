"""The lockstep loop of pipeline.schedule="1f1b" (one_f_one_b.py says what it computes and why;
legend: __init__.py). Iteration t runs up to three parts, each a `cond` on t: a
forward while microbatches pass, the tail where the last stage finishes one, a backward once
cotangents arrive. The order (which microbatch and chunk each stage runs in each part) is
one_f_one_b_order.py's; what passes from one iteration to the next is a `Carry`."""

from __future__ import annotations

import functools
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
from flax import linen as nn

from maxtext_rocm.numerics import fp8
from maxtext_rocm.numerics.fp8 import FP8_COLLECTION
from maxtext_rocm.parallel.pipeline.axes import STAGE_AXIS, STATE_AXES, TOKEN_AXES
from maxtext_rocm.parallel.pipeline.gather import GatheredOnce
from maxtext_rocm.parallel.pipeline.gpipe_recompute import SAVED_AXES, read_row, write_row
from maxtext_rocm.parallel.pipeline.one_f_one_b_order import OneFOneBOrder
from maxtext_rocm.parallel.pipeline.real_work import real_work
from maxtext_rocm.parallel.pipeline.schedules import Schedule
from maxtext_rocm.parallel.pipeline.stages import Slots
from maxtext_rocm.parallel.pipeline.tail import TailOnLastStage
from maxtext_rocm.parallel.pipeline.transfers import is_first, permute

Array = jax.Array


class LoopResult(NamedTuple):
    """What one run of the loop computed; the gradients None where it ran forwards only."""
    objective: Array
    sums: dict
    sown: object  # [R M + S - 1, S, K, ...] per leaf, by forward iteration (OneFOneBLoop.real_work reads it)
    d_params: object
    d_fp8: object
    d_staged: Array
    d_tail: object


class Carry(NamedTuple):
    """What passes from one iteration of the loop to the next. The backward's fields are None in a
    run of forwards only."""
    out: Array  # each stage's last forward output [S, mb, seq, d]
    objective: Array  # [devices]: each device's share of the objective (the tail's partial sums)
    sums: dict  # the tail's other sums, [devices, ...] likewise
    slots: list | None = None  # per residual leaf kept by a forward, [S, slots, ...]: the order's buffer
    d_h: Array | None = None  # each stage's last input cotangent [S, mb, seq, d], sent one stage back
    d_first: Array | None = None  # [S, M, mb, seq, d]: stage 0's row, the embeddings' cotangents
    d_params: object = None  # the weights' cotangent so far, [S, R, K, ...] as stored
    d_tail: object = None  # the tail variables' cotangent so far, per device
    d_fp8: object = None  # the fp8 state's updates merged so far, [S, R, K, ...] (None without fp8)


class RunInputs(NamedTuple):
    """What every iteration of one run reads: the stages' variables {collection: [S, R, K, ...]},
    the tail's (gathered), each stage's embeddings `staged` [S, M, mb, seq, d], the tail's `rows`
    and the positions and segments [M, mb, seq] per microbatch, the objective's cotangent by each
    sown value, and whether the run differentiates."""
    stage_vars: dict
    tail_variables: object
    staged: Array
    rows: object
    pos_in: Array
    seg_in: Array | None
    sown_cotangent: object
    with_backward: bool


class _Pullback(NamedTuple):
    """How a stage's forward `jax.vjp` is rebuilt for its backward: the pullback's tree, and for
    each of its leaves the index of the stage input it is (weights, positions, segments, which
    the backward supplies), or None (a residual, kept in the microbatch's slot)."""
    treedef: object
    source: tuple


class OneFOneBLoop:
    """The schedule's loop for `schedule` (its stages, repeats and microbatches, in
    one_f_one_b_order's order), `chunk` (stages.run_chunk's contract, its layers bound), `slots`
    [S, R, K] (stages.Slots: which are empty, which layer each holds) and `tail` (tail.py).
    `gathered`: a GatheredOnce when pipeline.weight_gather="once"; `stored`: the weights' stored
    NamedShardings, the gradient's layout in every iteration."""

    def __init__(self, schedule: Schedule, chunk: Callable, slots: Slots, tail: TailOnLastStage,
                 gathered: GatheredOnce | None, stored):
        self.schedule, self.mesh = schedule, schedule.mesh
        self.stages, self.repeats, self.microbatches = schedule.stages, schedule.repeats, schedule.microbatches
        self.order = OneFOneBOrder(self.stages, self.repeats, self.microbatches)
        self.chunk, self.slots, self.tail = chunk, slots, tail
        self.gathered, self.stored = gathered, stored
        self.pullback: _Pullback | None = None  # set by the first trace of a stage's forward
        # Plain 1F1B sends activations one stage on and cotangents one back; interleaved, both go
        # round the ring (the last stage's output is stage 0's next chunk's input, and back).
        senders = self.stages if self.repeats > 1 else self.stages - 1
        self.forward_pairs = [(s, (s + 1) % self.stages) for s in range(senders)]
        self.backward_pairs = [(b, a) for a, b in self.forward_pairs]
        self.stage_ids = jnp.arange(self.stages)
        over_stages = functools.partial(jax.vmap, spmd_axis_name=STAGE_AXIS)
        self._all_forward_keeping, self._all_forward = over_stages(self._forward_keeping), over_stages(self._stage)
        self._all_backward = over_stages(self._backward)
        self._all_read, self._all_write = over_stages(read_row), over_stages(write_row)

    def real_work(self, leaf: Array) -> Array:
        """real_work.real_work in this order: a sown leaf [R M + S - 1, S, K, ...] -> [M L, ...]."""
        table = self.order.forward_table()
        return real_work(self.schedule.layout, self.microbatches, leaf, passes=(table.repeat, table.real))

    # One stage's work (vmapped over the stages)

    def _pick(self, stage_vars, stage_real, repeat):
        """The chunk `repeat` of one stage's [R, K, ...] block and its [K] slots' reality, as the
        schedule picks it (GPipe's static index with one repeat, Circular's dynamic one)."""
        pick = functools.partial(self.schedule.pick_chunk, repeat=repeat)
        return jax.tree_util.tree_map(pick, (stage_vars, stage_real))

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
        return [*jax.tree_util.tree_leaves((chunk_vars, chunk_real)), pos, *([] if seg is None else [seg])]

    # The schedule

    def _tokens(self, pos_in, seg_in, micro):
        pos = nn.with_logical_constraint(jnp.take(pos_in, micro, axis=0), TOKEN_AXES)
        seg = None if seg_in is None else nn.with_logical_constraint(jnp.take(seg_in, micro, axis=0), TOKEN_AXES)
        return pos, seg

    def variables(self, params, fp8_state):
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
            _, sown = self._all_forward(self.variables(params, fp8_state), self.slots, first, staged[:, 0],
                                        *self._tokens(pos_in, seg_in, first))
            return sown
        per_iteration = jax.eval_shape(one, params, fp8_state, staged, pos_in, seg_in)
        n = self.order.n_forward_iterations
        return jax.tree_util.tree_map(lambda s: jax.ShapeDtypeStruct((n, *s.shape), s.dtype), per_iteration)

    def run(self, params, fp8_state, staged, tail_variables, rows, pos_in, seg_in, sown_cotangent, *,
            with_backward: bool) -> LoopResult:
        """The loop over `params` [S, R, K, ...] and the fp8 state (None without delayed scaling),
        each stage's embeddings `staged` and the tail's variables and `rows`; with_backward: the
        gradients too, each microbatch's backward in the iterations the order gives it."""
        if self.gathered is not None:
            params = jax.tree_util.tree_map(jax.lax.with_sharding_constraint, params, self.gathered.gathered)
        tail_variables = self.tail.gathered(tail_variables)  # once, before the loop
        inputs = RunInputs(self.variables(params, fp8_state), tail_variables, staged, rows, pos_in, seg_in,
                           sown_cotangent, with_backward)
        sown_now = jax.tree_util.tree_map(lambda a: jax.ShapeDtypeStruct(a.shape[1:], a.dtype),
                                          self.sown_shape(params, fp8_state, staged, pos_in, seg_in))
        iterations = self.order.n_iterations if with_backward else self.order.n_forward_iterations
        iteration = functools.partial(self._iteration, inputs, sown_now, iterations)
        carry, sown = jax.lax.scan(iteration, self._first_carry(inputs), jnp.arange(iterations))
        sown = jax.tree_util.tree_map(lambda a: a[:self.order.n_forward_iterations], sown)  # the forward iterations'
        return self._result(inputs, carry, sown)

    def _first_carry(self, inputs: RunInputs) -> Carry:
        staged, params = inputs.staged, inputs.stage_vars["params"]
        fp8_state = inputs.stage_vars.get(FP8_COLLECTION)
        activations = jnp.zeros((self.stages, *staged.shape[2:]), staged.dtype)
        first_rows = jax.tree_util.tree_map(lambda r: r[0], inputs.rows)
        sums_shape = jax.eval_shape(lambda v, x: self.tail.apply(self.tail.local(v), x, first_rows)[1],
                                    inputs.tail_variables, staged[0, 0])
        devices = self.tail.devices  # the tail's partial sums, one per device
        carry = Carry(out=activations, objective=jnp.zeros((devices,), jnp.float32),
                      sums=jax.tree_util.tree_map(lambda s: jnp.zeros((devices, *s.shape), s.dtype), sums_shape))
        if not inputs.with_backward:
            return carry
        first = jnp.zeros((self.stages,), jnp.int32)
        kept_shapes = jax.eval_shape(lambda *a: self._all_forward_keeping(*a)[2], inputs.stage_vars, self.slots, first,
                                     staged[:, 0], *self._tokens(inputs.pos_in, inputs.seg_in, first))
        return carry._replace(
            slots=[jnp.zeros((s.shape[0], self.order.n_slots, *s.shape[1:]), s.dtype) for s in kept_shapes],
            d_h=activations, d_first=nn.with_logical_constraint(jnp.zeros_like(staged), SAVED_AXES),
            d_params=jax.tree_util.tree_map(jnp.zeros_like, params), d_tail=self.tail.zeros(inputs.tail_variables),
            d_fp8=None if fp8_state is None else fp8.merge_identity(fp8_state))

    def _iteration(self, inputs: RunInputs, sown_now, iterations: int, carry: Carry, t):
        """Iteration t: a forward while microbatches pass (t < R M + S - 1), the tail where the
        last stage finishes a microbatch's last chunk, a backward once cotangents arrive
        (t >= R S - 1). Each part is a `cond` on t, the same on every device, so an iteration
        runs only the parts its phase has."""
        order = self.order
        d_y_now = jax.ShapeDtypeStruct(carry.out.shape, carry.out.dtype) if inputs.with_backward else None
        with phase_scope(order.n_forward_iterations, iterations):
            carry, sown = jax.lax.cond(t < order.n_forward_iterations, lambda c: self._forward_step(inputs, c, t),
                                       lambda c: (c, _zeros(sown_now)), carry)
        with phase_scope(self.microbatches, iterations):
            carry, d_y = jax.lax.cond(order.tail(t)[0], lambda c: self._tail_step(inputs, c, t),
                                      lambda c: (c, None if d_y_now is None else _zeros(d_y_now)), carry)
        if inputs.with_backward:
            with phase_scope(iterations - order.backward_offset, iterations):
                carry = jax.lax.cond(t >= order.backward_offset, lambda c: self._backward_step(inputs, c, t, d_y),
                                     lambda c: c, carry)
        return carry, sown

    def _forward_step(self, inputs: RunInputs, carry: Carry, t) -> tuple[Carry, object]:
        """Each stage's forward pass of iteration t (stage 0 on a fresh microbatch where its chunk
        is the first); with the backward, its residuals kept in the microbatch's slot."""
        work = self.order.forward(t, self.stage_ids)
        fresh = jax.lax.dynamic_index_in_dim(inputs.staged, work.micro[0], axis=1, keepdims=False)
        takes_fresh = is_first(carry.out) & (work.repeat[0] == 0)
        h = jnp.where(takes_fresh, fresh, permute(carry.out, self.mesh, self.forward_pairs))
        h = nn.with_logical_constraint(h, STATE_AXES)
        pos, seg = self._tokens(inputs.pos_in, inputs.seg_in, work.micro)
        if not inputs.with_backward:
            out, sown = self._all_forward(inputs.stage_vars, self.slots, work.repeat, h, pos, seg)
        else:
            out, sown, kept = self._all_forward_keeping(inputs.stage_vars, self.slots, work.repeat, h, pos, seg)
            slot = self.order.slot(work.micro, work.repeat)
            carry = carry._replace(slots=[self._all_write(buffer, leaf, slot, work.real)
                                          for buffer, leaf in zip(carry.slots, kept)])
        return carry._replace(out=nn.with_logical_constraint(out, STATE_AXES)), sown

    def _tail_step(self, inputs: RunInputs, carry: Carry, t) -> tuple[Carry, Array | None]:
        """The last stage's output (a microbatch's last chunk) through the tail, on that stage;
        the cotangent it sends back [S, mb, seq, d] (zeros on the other stages)."""
        _, micro = self.order.tail(t)
        rows_now = jax.tree_util.tree_map(lambda r: jax.lax.dynamic_index_in_dim(r, micro, 0, False), inputs.rows)
        objective, sums, d_tail, d_y = self.tail(carry.out, inputs.tail_variables, rows_now, inputs.with_backward)
        carry = carry._replace(objective=carry.objective + objective,
                               sums=jax.tree_util.tree_map(jnp.add, carry.sums, sums))
        if inputs.with_backward:
            carry = carry._replace(d_tail=jax.tree_util.tree_map(jnp.add, carry.d_tail, d_tail))
        return carry, d_y

    def _backward_step(self, inputs: RunInputs, carry: Carry, t, d_y) -> Carry:
        """Each stage differentiates its backward pass; the last stage's last chunk from `d_y`."""
        work = self.order.backward(t, self.stage_ids)
        from_next = permute(carry.d_h, self.mesh, self.backward_pairs)
        last_chunk_on_last_stage = (self.stage_ids == self.stages - 1) & (work.repeat == self.repeats - 1)
        from_tail = last_chunk_on_last_stage.reshape(-1, 1, 1, 1)
        d_out = from_next if d_y is None else jnp.where(from_tail, d_y, from_next)
        d_out = nn.with_logical_constraint(_where(work.real, d_out), STATE_AXES)
        d_sown = jax.tree_util.tree_map(lambda c: self._all_read(c, work.forward_iteration), inputs.sown_cotangent)
        d_sown = _where(work.real, d_sown)
        slot = self.order.slot(work.micro, work.repeat)
        kept = [self._all_read(buffer, slot) for buffer in carry.slots]
        pos, seg = self._tokens(inputs.pos_in, inputs.seg_in, work.micro)
        d_vars, d_h = self._all_backward(inputs.stage_vars, self.slots, work.repeat, kept, pos, seg, d_out, d_sown)
        # A clamped pass's slot holds another's residuals (or none): its results are dropped.
        d_vars, d_h = _where(work.real, d_vars), _where(work.real, d_h)
        d_params = jax.tree_util.tree_map(
            jax.lax.with_sharding_constraint,
            jax.tree_util.tree_map(functools.partial(self._into_chunk, repeat=work.repeat), carry.d_params,
                                   d_vars["params"]),
            self.stored)
        d_fp8 = carry.d_fp8
        if d_fp8 is not None:  # a real layer of the chunk run, on a real microbatch: [S, R, K]
            chunk_run = work.real[:, None] & (work.repeat[:, None] == jnp.arange(self.repeats))
            uses = chunk_run[..., None] & self.slots.real
            d_fp8 = _merged(d_fp8, jax.tree_util.tree_map(lambda d: d[:, None], d_vars[FP8_COLLECTION]), uses)
        d_h = nn.with_logical_constraint(d_h, STATE_AXES)
        # Stage 0's cotangent of its first chunk's input is the embeddings'.
        d_first = self._all_write(carry.d_first, d_h, work.micro, work.real & (work.repeat == 0))
        return carry._replace(d_h=d_h, d_first=d_first, d_params=d_params, d_fp8=d_fp8)

    def _result(self, inputs: RunInputs, carry: Carry, sown) -> LoopResult:
        # Each device's share (only the last stage's are not zero): one sum over the stage and the
        # batch axes a step, for the tail's variables a reduction of the head's gradient.
        objective, sums = carry.objective.sum(0), jax.tree_util.tree_map(lambda a: a.sum(0), carry.sums)
        if not inputs.with_backward:
            return LoopResult(objective, sums, sown, None, None, None, None)
        # Stage 0's input cotangents are the embeddings'; the other stages' rows are no input's.
        d_staged = nn.with_logical_constraint(
            jnp.where(is_first(carry.d_first), carry.d_first, jnp.zeros_like(carry.d_first)), SAVED_AXES)
        d_fp8 = None
        if carry.d_fp8 is not None:  # a slot no real layer used keeps its state
            used = self.schedule.layout.real  # numpy: [S, R, K]
            d_fp8 = jax.tree_util.tree_map(
                lambda new, old: jnp.where(used.reshape(*used.shape, *(1,) * (old.ndim - used.ndim)), new, old),
                carry.d_fp8, inputs.stage_vars[FP8_COLLECTION])
        return LoopResult(objective, sums, sown, carry.d_params, d_fp8, d_staged, self.tail.reduced(carry.d_tail))


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


def _where(mask: Array, tree):
    """`tree`'s leaves [S, ...] where `mask` [S], zeros elsewhere."""
    return jax.tree_util.tree_map(
        lambda a: jnp.where(mask.reshape(-1, *(1,) * (a.ndim - 1)), a, jnp.zeros_like(a)), tree)
