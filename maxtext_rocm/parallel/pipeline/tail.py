"""The tail of a pipeline: the final norm, the LM head and the loss, run by the last stage alone,
under pipeline.schedule="1f1b" (parallel/pipeline/one_f_one_b.py) on one microbatch at a time, under
gpipe and gpipe_recompute on the whole batch after the loop (`objective_on_the_last_stage`).

A shard_map manual over `stage` and the batch axes whose `cond` on the stage's index skips the
tail on every other stage: the stack's output never leaves the last stage and the head's FLOPs are
not repeated (in lockstep the other stages wait for it). Each device runs it on its own rows with
the head gathered once before the loop (`gathered`), so the head is neither gathered again nor
its gradient reduced per microbatch: each device sums its own (`zeros`, one row per device) and
`reduced` reduces the sum once a step, over the batch axes into the stored layout first (a
reduce-scatter over fsdp), then over `stage` (an all-reduce of that shard), unless the head is
stored on the last stage (layout.ends_on_their_stages: `owned`), whose row is then the
only one with a gradient and nothing crosses `stage`. Measured on the comm layout stage=2 x fsdp=4, M=16:
the head per microbatch on every stage 5.45x the minimum, per device with the head gathered once
1.28x, reduced in that order 1.14x, with the table and the head on their stages 1.04x
(docs/figures.md).
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import linen as nn
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from maxtext_rocm.parallel.pipeline.axes import STAGE_AXIS
from maxtext_rocm.parallel.sharding import LOGICAL_RULES, nested_mesh, present_axes, rules_without_zero3

Array = jax.Array


@dataclasses.dataclass(frozen=True)
class TailOnLastStage:
    """`apply(variables, hidden [mb, seq, d], rows) -> (objective, sums)` (models/llama.py's
    Tail) on `mesh`'s last stage; `axes`: the logical axes of the variables' leaves."""

    apply: Callable
    axes: dict
    mesh: Mesh
    # True for a variable stored [S, ...] with a row per stage (the head on its stage:
    # layout.ends_on_their_stages), False for one replicated over `stage`; None: all False.
    owned: dict | None = None

    @classmethod
    def of(cls, tail, mesh: Mesh, head_on_its_stage: bool) -> "TailOnLastStage":
        """For the Decoder's `tail` (models/llama.py's Tail), its head stored [S, ...] where
        `head_on_its_stage` (layout.ends_on_their_stages), its final norm replicated."""
        owned = {"final_norm": jax.tree_util.tree_map(lambda _: False, tail.variables["final_norm"]),
                 "head": head_on_its_stage}
        return cls(tail.apply, tail.axes, mesh, owned)

    @property
    def stages(self) -> int:
        return self.mesh.shape[STAGE_AXIS]

    @property
    def manual_axes(self) -> tuple[str, ...]:
        """The stages and the axes that split the batch's rows: the tail is manual over these."""
        return (STAGE_AXIS, *present_axes(self.mesh, "activation_batch"))

    @property
    def devices(self) -> int:
        return int(np.prod([self.mesh.shape[a] for a in self.manual_axes]))

    def _owned(self) -> dict:
        if self.owned is not None:
            return self.owned
        return jax.tree_util.tree_map(lambda _: False, self.axes, is_leaf=lambda a: isinstance(a, tuple))

    def _specs(self, rules) -> dict:
        """Each variable's PartitionSpec as one stage holds it (no row per stage)."""
        return jax.tree_util.tree_map(lambda axes: nn.logical_to_mesh_axes(axes, rules), self.axes,
                                      is_leaf=lambda a: isinstance(a, tuple))

    def _layouts(self, rules) -> dict:
        """Each variable's NamedSharding as stored: an owned one's rows over `stage`."""
        return jax.tree_util.tree_map(
            lambda spec, owned: NamedSharding(self.mesh, P(STAGE_AXIS, *spec) if owned else spec),
            self._specs(rules), self._owned(), is_leaf=lambda a: isinstance(a, P))

    def gathered(self, variables):
        """The variables without their ZeRO-3 split (the tensor split kept), once before the loop."""
        return jax.tree_util.tree_map(jax.lax.with_sharding_constraint, variables, self._layouts(rules_without_zero3()))

    def local(self, variables):
        """The variables as the tail applies them on a stage: an owned one's own row."""
        return jax.tree_util.tree_map(lambda v, owned: v[0] if owned else v, variables, self._owned())

    def zeros(self, variables):
        """Per-device sums of the variables' cotangents [devices, ...], one row per device, each
        leaf as a stage applies it."""
        def one(leaf, owned):
            shape = leaf.shape[1:] if owned else leaf.shape
            spec = P(self.manual_axes, *(P.UNCONSTRAINED,) * len(shape))
            return jax.lax.with_sharding_constraint(jnp.zeros((self.devices, *shape), leaf.dtype),
                                                    NamedSharding(self.mesh, spec))
        return jax.tree_util.tree_map(one, variables, self._owned())

    def reduced(self, per_device):
        """The per-device sums [devices, ...] of the variables' cotangents, reduced once: over the
        batch axes into each variable's stored layout, then over `stage`, but for an owned
        variable, whose rows are the stages' own: [S, ...] as stored, no sum over `stage`."""
        def one(a, spec, owned):
            per_stage = a.reshape(self.stages, -1, *a.shape[1:]).sum(1)
            per_stage = jax.lax.with_sharding_constraint(per_stage, NamedSharding(self.mesh, P(STAGE_AXIS, *spec)))
            return per_stage if owned else jax.lax.with_sharding_constraint(per_stage.sum(0),
                                                                            NamedSharding(self.mesh, spec))
        return jax.tree_util.tree_map(one, per_device, self._specs(LOGICAL_RULES), self._owned())

    def __call__(self, out, variables, rows, with_backward: bool):
        """The tail on the last stage's row of `out` [S, mb, seq, d] with `rows` (this
        microbatch's). Returns (objective [devices], sums {name: [devices]}, the variables'
        cotangents [devices, ...], the output's cotangent [S, mb, seq, d]), zeros off the last
        stage (the cotangents None without `with_backward`)."""
        last, batch = self.stages - 1, self.manual_axes[1:]

        def local(block, variables, rows):
            y, variables = block[0], self.local(variables)

            def run(_):
                if not with_backward:
                    return self.apply(variables, y, rows)
                (objective, sums), pull = jax.vjp(lambda v, x: self.apply(v, x, rows), variables, y)
                d_variables, d_y = pull((jnp.ones_like(objective), jax.tree_util.tree_map(jnp.zeros_like, sums)))
                return objective, sums, d_variables, d_y[None]

            shapes = jax.eval_shape(run, None)
            zeros = lambda _: jax.tree_util.tree_map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)  # noqa: E731
            result = jax.lax.cond(jax.lax.axis_index(STAGE_AXIS) == last, run, zeros, None)
            if not with_backward:
                return jax.tree_util.tree_map(lambda a: a[None], result)
            objective, sums, d_variables, d_y = result
            return (*jax.tree_util.tree_map(lambda a: a[None], (objective, sums, d_variables)), d_y)

        per_device = P(self.manual_axes)
        out_specs = (per_device, per_device) + ((per_device, P(STAGE_AXIS, batch)) if with_backward else ())
        # check_vma off: the loss's own shard_map (parallel/loss.py) nests inside this one, as the
        # layers' do inside the stages' vmap (varying.check_vma).
        variable_specs = jax.tree_util.tree_map(lambda owned: P(STAGE_AXIS) if owned else P(), self._owned())
        result = jax.shard_map(local, mesh=nested_mesh(self.mesh),
                               in_specs=(P(STAGE_AXIS, batch), variable_specs, P(batch)), out_specs=out_specs,
                               axis_names=frozenset(self.manual_axes), check_vma=False)(out, variables, rows)
        return result if with_backward else (*result, None, None)


def objective_on_the_last_stage(tail: TailOnLastStage) -> Callable:
    """objective(y [S, B, seq, d], variables, rows) -> (objective, sums): `tail` on the last stage's
    row of `y` (the stack's outputs where the last stage made them), differentiable in `y` and the
    variables (as stored), for a schedule whose backward is the loop's autodiff (gpipe) or its own
    (gpipe_recompute). A custom_vjp: its forward gathers the variables and takes the tail's own vjp
    on the last stage (each device's head gradient summed where it is, `reduced` once into the
    stored layout), its backward scales by the objective's cotangent. Autodiff through the
    shard_map instead would sum the gathered head's gradient whole over the batch axes and `stage`
    (an all-reduce where a reduce-scatter does), and through the gather, gather that gradient again."""
    @jax.custom_vjp
    def objective(y, variables, rows):
        total, sums, _, _ = tail(y, tail.gathered(variables), rows, with_backward=False)
        return total.sum(0), jax.tree_util.tree_map(lambda a: a.sum(0), sums)

    def forward(y, variables, rows):
        total, sums, d_variables, d_y = tail(y, tail.gathered(variables), rows, with_backward=True)
        return (total.sum(0), jax.tree_util.tree_map(lambda a: a.sum(0), sums)), (tail.reduced(d_variables), d_y)

    def backward(residuals, cotangents):
        d_variables, d_y = residuals
        g = cotangents[0]  # the objective's; the sums are reported, not differentiated
        times_g = lambda d: (d * g).astype(d.dtype)  # noqa: E731
        return times_g(d_y), jax.tree_util.tree_map(times_g, d_variables), None

    objective.defvjp(forward, backward)
    return objective
