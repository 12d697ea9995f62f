"""pipeline.weight_gather="once": each stage's ZeRO-3-sharded weights gathered once per step,
before the pipeline loop, instead of in each of its M + S - 1 iterations (legend: __init__.py);
pipeline.gradient_reduce="once": their gradient reduce-scattered once, after it.

Under "per_iteration" GSPMD gathers a stage's weights over fsdp (and sequence and expert, which
also ZeRO-3-shard dense weights: sharding.ZERO3_AXES) where the layers use them, inside the loop:
g times an iteration (g = 2 under remat, the backward gathers again), the bubble's iterations
too. Here the stacked weights [S, R, K, ...] are constrained before the loop to their layout
without the ZeRO-3 axes (stage, tensor and expert splits kept: those split the work itself), so
the loop's body finds them gathered; XLA keeps the loop-invariant copy for the whole step.

The gradient: each iteration's weight gradient is a sum over the batch shard's tokens, which
the batch axes split, so GSPMD reduces it in the iteration that computes it. Left to itself it
reduces it to the gathered layout (an all-reduce, 2x a reduce-scatter's bytes, per iteration)
and sums it there; `in_stage` asks for the stored, ZeRO-3-sharded layout instead, so each
iteration reduce-scatters and the loop sums shards. GSPMD over Auto mesh axes cannot keep a
partial sum unreduced across the loop; pipeline.gradient_reduce="once" (`per_batch_shard`) gets
that by running the loop manual over the batch axes: each device then sums its own gradient, and
shard_map's transpose reduces the sum once after the loop. It costs that sum's memory (the stage's
gradient whole in fp32 per device) and a local view of the batch inside the loop, which MoE
routing statistics, fp8's amaxes and context parallelism do not have (refused in
config/checks.py).

Dtype: the gathered copy is in the parameters' own dtype (fp32 under every policy), not the
compute dtype. The loop's autodiff sums a loop-invariant input's cotangent in that input's dtype,
so a bf16 copy would sum the microbatches' weight gradients in bf16; the layers cast to the
compute dtype inside their dots as they would anyway, so the forward is the same either way. The
price is memory: the stage's weights whole in fp32 for the step (planner/estimates.py).
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax
from flax import linen as nn
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from maxtext_rocm.parallel.sharding import LOGICAL_RULES, constrained_both_ways, rules_without_zero3


@dataclasses.dataclass(frozen=True)
class GatheredOnce:
    """The layouts of a stage stack's weights: `gathered`, NamedShardings of the stacked
    [S, R, K, ...] leaves without ZeRO-3; `stored`, the same leaves as the state stores them;
    `per_stage`, PartitionSpecs of one stage's [R, K, ...] block as stored (inside the stages'
    vmap, which adds `stage` in front)."""

    gathered: object
    stored: object
    per_stage: object

    @classmethod
    def of(cls, chunk_layers: nn.Module, x, positions, segment_ids, mesh: Mesh,
           layer_args: tuple = ()) -> "GatheredOnce":
        """From the layers' logical axes, read off an abstract init of one chunk (`chunk_layers`,
        unbound, on one row of the stack's inputs and `layer_args`, stages.StageStack's
        first_chunk_args; nothing is computed): a stored leaf [S R K, ...] is ("layers", *rest),
        viewed by the pipeline as [S, R, K, *rest]."""
        key = jax.random.key(0)
        seg = None if segment_ids is None else segment_ids[:1]
        boxed = jax.eval_shape(lambda: chunk_layers.init({"params": key, "dropout": key}, x[:1], positions[:1], seg,
                                                         *layer_args))
        logical = nn.get_partition_spec(boxed)["params"]

        def layer_axes(spec) -> tuple:
            # A scan's leaves lead with its "layers" axis; one unscanned layer's (a padded stack's
            # chunk_layers, stages.StageStack) have none.
            spec = tuple(spec)
            return spec[1:] if spec and spec[0] == "layers" else spec

        def layout(rules, lead):
            return lambda spec: nn.logical_to_mesh_axes((*lead, *layer_axes(spec)), rules)
        stacked = ("activation_stage", None, None)
        specs = {name: jax.tree_util.tree_map(layout(rules, lead), logical, is_leaf=lambda a: isinstance(a, P))
                 for name, rules, lead in (("gathered", rules_without_zero3(), stacked),
                                           ("stored", LOGICAL_RULES, stacked),
                                           ("per_stage", LOGICAL_RULES, (None, None)))}
        named = lambda tree: jax.tree_util.tree_map(lambda s: NamedSharding(mesh, s), tree,  # noqa: E731
                                                    is_leaf=lambda a: isinstance(a, P))
        return cls(gathered=named(specs["gathered"]), stored=named(specs["stored"]), per_stage=specs["per_stage"])

    def before_loop(self, params):
        """`params` [S, R, K, ...] gathered; their cotangent (the loop's summed, already
        reduce-scattered gradient) kept in the stored layout: a plain sharding constraint's
        transpose would gather it to the gathered layout, one more all-gather a step."""
        return constrained_both_ways(params, self.gathered, self.stored)

    def in_stage(self, stage_params):
        """One stage's gathered block, unchanged; its cotangent in this iteration asked for in the
        stored layout, so that GSPMD reduce-scatters it rather than all-reducing it whole."""
        return constrained_both_ways(stage_params, None, self.per_stage)


def per_batch_shard(loop: Callable, mesh: Mesh, axes: tuple[str, ...]) -> Callable:
    """pipeline.gradient_reduce="once": `loop` (loop.run_loop's contract) run on each batch
    shard's own rows, manual over the batch mesh `axes` (data, fsdp, expert of more than one
    device), with the stage's weights gathered and replicated over them. Each device then sums its
    own, unreduced weight gradients over the loop's iterations, and shard_map's transpose reduces
    that sum over `axes` once, after the loop (an all-reduce the stored layout slices: a
    reduce-scatter). Inside, the batch axes are manual, so the layers' logical constraints see the
    batch unsharded (their rows are already this shard's). The price: the stage's gradient held
    whole in fp32 on every device for the step, beside the gathered weights."""
    if not axes:  # no batch axis splits the batch: the gradient needs no reduction
        return loop
    rules = tuple((name, None if name in BATCH_AXES else target) for name, target in rules_without_zero3())

    def run(schedule, run_stage, params, fp8_per_iteration, real, staged, positions, segment_ids):
        # `real` (a constant) is closed over, not passed: gpipe_recompute's backward closes over it
        # and is traced after this shard_map's forward, where a traced copy would have leaked.
        def local(params, staged, positions, *segments):
            with nn.logical_axis_rules(rules):
                return loop(schedule, run_stage, params, None, real, staged, positions,
                            segments[0] if segments else None)
        rows = P(axes)
        # staged [S, M, mb, seq, d]: a microbatch's rows are every M-th of the batch
        # (microbatches.split_microbatches), so each batch shard's are its own rows' microbatches.
        staged_rows = P(None, None, axes)
        segments = () if segment_ids is None else (segment_ids,)
        # check_vma off: the layers' own scans carry values that vary over the manual axes, which
        # the type check would ask every carry to declare; the gradient is held to one device's by
        # tests/test_pipeline_gather.py.
        return jax.shard_map(local, mesh=mesh, in_specs=(P(), staged_rows, rows, *(rows,) * len(segments)),
                             out_specs=(rows, P()), axis_names=frozenset(axes), check_vma=False)(
            params, staged, positions, *segments)
    return run


# The logical axes that split the batch's rows: manual inside per_batch_shard.
BATCH_AXES = ("activation_batch", "activation_exp_batch")
