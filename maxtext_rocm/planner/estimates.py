"""The analytic side of `python -m maxtext_rocm.compile`: activations per device (per pipeline
stage), and the dot FLOPs the compiled step should run, which the report holds the compiled
program's own count to (maxtext_rocm/planner/comm.py walks the HLO for both collectives and FLOPs).

Activations (symbols in maxtext_rocm/planner/report.py's docstring) without a pipeline:
    L*saved + 2*layer_all + logits (+ the gathered weights, in compile.py)

With a GPipe pipeline of S stages and M microbatches (maxtext_rocm/parallel/pipeline/), each
device holds K = L/S layers and runs the loop's I = M + S - 1 iterations on T/M tokens at a time
(circular schedules and stacks that do not divide: `loop_shape`); the loop's autodiff saves every
iteration's residuals, the bubble's included:
    I * (K*saved + T_mb*d*c)            each iteration: its K layers' saved tensors + the stage's input
    + 2*layer_all(T_mb)                 one layer recomputed + its gradients, a microbatch at a time
    + I*T_mb*d*c                        the last stage's outputs the loop stacks
    + logits (T tokens)                 the LM head and loss run after the loop on the whole batch shard
with T_mb = T/M. pipeline.schedule="gpipe_recompute" (parallel/pipeline/gpipe_recompute.py) runs GPipe's
order without differentiating the loop and recomputes each stage per microbatch in its backward:
    K*saved/M + 2*layer_all/M           one microbatch's residuals of the K layers, one at a time
    + T*d*c                             the stage input it saved per microbatch (M x T_mb)
    + T*d*c                             the last stage's outputs (docs/figures.md, "Pipelines:
                                        recomputing stages against gpipe": 70B, 4 stages, M=16,
                                        remat full: 43.5 GB against XLA:CPU's 46.4)
and one more forward of the stack in FLOPs (stage_recompute_flops). pipeline.schedule="1f1b"
(parallel/pipeline/one_f_one_b.py) keeps each microbatch's residuals of a chunk of K layers from its
forward to its backward in W slots (parallel/pipeline/one_f_one_b_order.py: min(2S - 1, M) with one chunk
per device; interleaved, R chunks of L/(S R) layers, about S (1 + 1/R) stages' worth), two more in
flight (the forward's before it is written, the slot the backward reads), and runs the head per
microbatch:
    (W+2)*K*saved/M + 2*layer_all/M     (remat "none": saved as under "save_dots", its stage checkpoint)
    + 2*T*d*c                           the embeddings and their cotangents, per microbatch
    + logits/M (+ the head's gradient, whole) + the head gathered once, in fp32 (each device sums
                                        its own rows' head gradient: the tail runs per device)
with GPipe's FLOPs.
Under a pipeline remat "minimal" keeps what it keeps without one: the stages run
as a vmap, so every projection gains the stage axis as a batch dimension, and the policy finds them
by the names Policy.dot_general gives them (precision.py) rather than by their batch dimensions.

The stage's state: sharding.py maps only the stacked layers' "layers" axis to `stage`; the
embedding, the LM head and the final norm are replicated over it, so every stage holds them
(sharded by fsdp/tensor as without a pipeline) and every stage is alike: `per_stage` says so,
from the abstract state's shardings rather than by assumption.
"""

from __future__ import annotations

import dataclasses
import math

import jax

from maxtext_rocm import config as config_lib
from maxtext_rocm.config.checks import chunks_per_device
from maxtext_rocm.config.choices import feed_forward_dim
from maxtext_rocm.numerics import cross_entropy
from maxtext_rocm.parallel.pipeline.one_f_one_b_order import OneFOneBOrder
from maxtext_rocm.parallel.pipeline.layout import loss_on_the_last_stage
from maxtext_rocm.reporting import metrics
from maxtext_rocm.trainer.step import fused_head_loss

def loop_shape(pipeline_cfg, n_layers: int, stages: int, microbatches: int) -> tuple[int, int]:
    """(iterations, layer slots each device runs per iteration) of the pipeline loop: GPipe
    M + S - 1 iterations of ceil(L/S) slots; a circular schedule of R repeats R M + S - 1 of
    ceil(L/(S R)). A stack that does not divide is padded with empty slots, which run the layer on
    zeros like any other (parallel/pipeline/), so they count in memory and FLOPs."""
    R = chunks_per_device(pipeline_cfg)
    return R * microbatches + stages - 1, math.ceil(n_layers / (stages * R))


def analytic_activations(cfg, axis_sizes: dict[str, int], n_devices: int, microbatches: int = 1) -> dict[str, float]:
    """The activation estimate of compile.py's docstring (and this module's, under a pipeline),
    per device, in bytes. (A circular schedule's buffer, which holds the last stage's output until
    stage 0 is free, is not counted: one microbatch's block output per device. Its chunk weights
    saved per iteration are, in compile.py, from the state's shardings.)"""
    m, tr = cfg.model, cfg.train
    c = 4 if cfg.precision.policy == "fp32" else 2
    t, S_p = axis_sizes["tensor"], axis_sizes.get("stage", 1)
    batch_shards = axis_sizes["data"] * axis_sizes["fsdp"] * axis_sizes["expert"]
    b = tr.per_device_batch_size * n_devices / tr.grad_accum / batch_shards
    s = tr.seq_len
    T = b * s / axis_sizes["sequence"]
    d, L, V = m.d_model, m.n_layers, m.vocab_size
    q = m.n_heads * m.head_dim / t
    kv = 2 * m.n_kv_heads * m.head_dim / t
    f = feed_forward_dim(m) / t
    if m.n_experts > 1:
        f *= m.experts_per_token * m.moe_capacity_factor
    S = b * (m.n_heads / t) * s * (s / axis_sizes["sequence"])
    if m.attention != "xla":  # fused flash attention keeps only the softmax statistics
        S = b * (m.n_heads / t) * s * 4 / (4 + c)
    layer_all = T * c * (4 * d + 2 * q + kv + 3 * f) + S * (4 + c)
    minimal = T * c * (2 * d + q + kv + 2 * f) + T * d * c
    remat = m.remat
    saved_by = {"full": T * d * c, "minimal": minimal, "save_dots": minimal + S * 4 + T * q * c, "none": layer_all}
    saved = saved_by[remat]
    head_gradient = 0.0
    if fused_head_loss(m, cfg.precision.policy == "fp8" and cfg.precision.fp8_lm_head):
        chunk = cross_entropy.chunk_length(s, m.loss_chunk_len)
        head_gradient = 4 * d * V / t
        logits = T * chunk / s * V / t * (c + 8) + head_gradient
    else:
        logits = T * V / t * (c + 8)
    if S_p <= 1:
        return {"layers": L * saved + 2 * layer_all, "logits": logits}
    M = microbatches
    I, K = loop_shape(cfg.pipeline, L, S_p, M)
    T_mb = T / M  # saved and layer_all are linear in the tokens
    # The loss on the last stage (pipeline.layout.loss_on_the_last_stage) reads the head gathered
    # once, in fp32 (pipeline.tail.TailOnLastStage), beside each device's sum of its gradient.
    tail = {"gathered head": 4 * d * V / t} if loss_on_the_last_stage(cfg) else {}
    if cfg.pipeline.schedule == "gpipe_recompute":
        # The forward keeps each microbatch's stage input (M x T_mb = T tokens) and the stack's
        # outputs; the backward holds one microbatch's residuals of the stage's K layers at a time.
        return {"layers": K * saved / M + 2 * layer_all / M, "stage inputs": T * d * c,
                "pipeline loop": T * d * c, "logits": logits, **tail}
    if cfg.pipeline.schedule == "1f1b":
        # The slots' residuals of a chunk's K layers each (OneFOneBOrder.n_slots; remat
        # "none": the stage checkpointed with save_dots's policy), the embeddings and their
        # cotangents per microbatch, and the head and loss run on one microbatch at a time.
        # Beside the slots, two microbatches' residuals in flight: the forward's, made before they
        # are written to their slot, and the slot the backward reads (XLA materialises both).
        slots = OneFOneBOrder(S_p, chunks_per_device(cfg.pipeline), M).n_slots + 2
        kept = saved_by["save_dots"] if remat == "none" else saved
        return {"layers": slots * K * kept / M + 2 * layer_all / M, "stage inputs": 2 * T * d * c,
                "logits": (logits - head_gradient) / M + head_gradient, "gathered head": 4 * d * V / t}
    return {"layers": I * (K * saved / M + T_mb * d * c) + 2 * layer_all / M,
            "pipeline loop": I * T_mb * d * c, "logits": logits, **tail}


def layer_param_bytes(cfg, axis_sizes) -> float:
    """One layer's parameters in fp32, gathered (tensor and expert parallelism still split them)."""
    m = cfg.model
    per_layer = metrics._attention_params(m) + (  # expert weights stay split over `expert`
        3 * m.d_model * feed_forward_dim(m) * m.n_experts / axis_sizes["expert"] + m.d_model * m.n_experts
        if m.n_experts > 1 else metrics._ffn_params(m))
    return 4 * per_layer / axis_sizes["tensor"]


def gathered_stage_weights_bytes(cfg, axis_sizes) -> float:
    """pipeline.weight_gather="once" (parallel/pipeline/gather.py): every layer slot a device runs
    (its R chunks of K slots, empty ones included) gathered whole in fp32 before the pipeline loop
    and held for the step, and under a bf16 or fp8 policy its bf16 cast too, which XLA hoists out
    of the loop as loop-invariant (70B's compiled step holds bf16[20,1,8192,28672] beside the fp32
    stack). The gradient sums in the stored, sharded layout (counted with the gradients), and
    "gathered_weights" still counts a layer's gradient before its reduce-scatter."""
    S = axis_sizes["stage"]
    R = chunks_per_device(cfg.pipeline)
    slots = math.ceil(cfg.model.n_layers / (S * R)) * R
    with_cast = 1.0 if cfg.precision.policy == "fp32" else 1.5
    return with_cast * slots * layer_param_bytes(cfg, axis_sizes)


def unreduced_stage_gradient_bytes(cfg, axis_sizes) -> float:
    """pipeline.gradient_reduce="once" (parallel/pipeline/gather.per_batch_shard): each device's
    own sum of its layer slots' gradient, whole and in fp32, until the one reduce-scatter after the
    loop."""
    return gathered_stage_weights_bytes(cfg, axis_sizes) / (1.0 if cfg.precision.policy == "fp32" else 1.5)


def weight_gather_terms(cfg, axis_sizes) -> dict[str, float]:
    """The activation terms of gathered weights, for the fit check and --plan alike: one layer's
    weights and gradient gathered at a time under ZeRO-3 ("gathered_weights", 0 without it), and
    under a pipeline the once-options' stage held whole ("gathered stage weights", "unreduced stage
    gradient", present only when set)."""
    zero3 = axis_sizes["fsdp"] * axis_sizes["sequence"] * axis_sizes["expert"] > 1
    terms = {"gathered_weights": 2 * layer_param_bytes(cfg, axis_sizes) if zero3 else 0.0}
    if axis_sizes["stage"] > 1 and zero3 and cfg.pipeline.weight_gather == "once":
        terms["gathered stage weights"] = gathered_stage_weights_bytes(cfg, axis_sizes)
        if cfg.pipeline.gradient_reduce == "once":
            terms["unreduced stage gradient"] = unreduced_stage_gradient_bytes(cfg, axis_sizes)
    return terms


@dataclasses.dataclass
class StageSplit:
    """Per-device parameter bytes of one pipeline stage, split over `stage` or replicated over it."""
    stages: int
    layer_param_bytes: int  # the leaves split over `stage`: each stage holds its own share (or row)
    other_param_bytes: int  # the leaves replicated over `stage`: every stage holds them whole
    replicated_over_stage: list[str]  # those leaves' paths
    note: str  # the report's sentence about them


def per_stage(params, stages: int, loss_on_last: bool = False) -> StageSplit:
    """Per-device parameter bytes of a pipeline stage, read from the abstract state's shardings: the
    leaves split over `stage` (each stage holds its own share) and the leaves replicated over it
    (every stage holds them whole, as split by the other axes), named. `loss_on_last`: the head and
    loss run on the last stage alone (pipeline.layout.loss_on_the_last_stage)."""
    split = replicated = 0
    names, owned = [], []
    for path, leaf in jax.tree_util.tree_leaves_with_path(params):
        shard = leaf.sharding.shard_shape(leaf.shape) if leaf.sharding is not None else leaf.shape
        size = math.prod(shard) * leaf.dtype.itemsize
        spec = getattr(leaf.sharding, "spec", ())
        axes = {a for entry in spec if entry for a in ((entry,) if isinstance(entry, str) else entry)}
        name = "/".join(str(getattr(k, "key", k)) for k in path)
        if "stage" in axes:
            split += size
            if not name.startswith("layers"):  # a row per stage (parallel/pipeline/layout.ends_on_their_stages)
                owned.append(name)
        else:
            replicated += size
            names.append(name)
    on_their_stages = (f"; {' and '.join(owned)} stored on their stages (a row per stage, zero but on the "
                       "first stage's for the table, the last stage's for the head)") if owned else ""
    return StageSplit(stages=stages, layer_param_bytes=split, other_param_bytes=replicated,
                      replicated_over_stage=names,
                      note=f"{', '.join(names) or 'nothing'} replicated over `stage` (sharding.py maps only the "
                           "stacked layers' axis to it): every stage holds them, and " + (
                               "the head and loss run on the last stage alone (the others wait for it, as "
                               "lockstep stages do)" if loss_on_last else
                               "the head and loss run on every stage's batch shard, so all stages are alike")
                           + on_their_stages)


# ----------------------------------------------------------------------------------------------
# FLOPs


@dataclasses.dataclass
class DotFlops:
    """Dot FLOPs per device per step that the compiled step should run (analytic_device_flops)."""
    terms: dict[str, float]  # per term of metrics.executed_flops_per_token ("LM head", "remat recompute", ...)
    total: float  # their sum
    convention_per_device: float  # the 6N + attention convention's FLOPs (metrics.train_flops_per_token)
    bubble_factor: float  # a pipeline loop's layer passes per real one (1.0 without a pipeline)
    remat: str  # the remat policy whose recompute the terms hold
    redundant_head: float  # the LM head FLOPs of every stage but one (0.0 without a pipeline)


def stage_recompute_flops(terms: dict[str, float]) -> float:
    """gpipe_recompute's extra dot FLOPs per token: its backward runs every stage's forward again
    from the saved stage input, one forward of the stack, whatever model.remat is: a third of the
    layers' and attention's forward + backward (remat "full" recomputes each layer once more on top,
    inside that stage's backward, which the "remat recompute" term already counts)."""
    return (terms["layers"] + terms["causal attention"] + terms["masked attention"]) / 3


def analytic_device_flops(cfg, axis_sizes: dict[str, int], n_devices: int,
                          microbatches: int = 1) -> DotFlops | None:
    """Dot FLOPs per device per step that the compiled train step should run: the one formula's
    terms (metrics.executed_flops_per_token) for the step's tokens, split over the devices, with a
    pipeline's layers x (M + S - 1)/M (the bubble's iterations compute on dropped data; see
    loop_shape for circular schedules and padded stacks), gpipe_recompute's stage recompute
    (stage_recompute_flops, with the same bubble) and its LM
    head x S (it runs on every stage's share of S x the tokens: see per_stage; where the loss runs
    on the last stage, on that stage's alone, no less per device of it). None for a MoE model, whose executed FLOPs
    depend on the implementation (capacity slots, every expert on the dense path)."""
    if cfg.model.n_experts > 1:
        return None
    S = axis_sizes.get("stage", 1)
    remat = cfg.model.remat
    # Where the loss runs on the last stage alone (1f1b; gpipe and gpipe_recompute with the fused
    # loss) its devices still run the head on S x their share of the tokens (the batch is not
    # split over `stage`), and lockstep, the others wait for it.
    head_on_last = loss_on_the_last_stage(cfg)
    terms = metrics.executed_flops_per_token(cfg.model, cfg.train.seq_len, remat)
    if cfg.model.attention != "xla":  # the blockwise/flash kernels skip the masked blocks
        terms["masked attention"] = 0.0
    tokens = config_lib.global_batch_size(cfg, n_devices) * cfg.train.seq_len
    bubble = 1.0
    if S > 1:  # layer passes per device against the L/S x M of a schedule without a bubble
        I, K = loop_shape(cfg.pipeline, cfg.model.n_layers, S, microbatches)
        bubble = I * K * S / (cfg.model.n_layers * microbatches)
        if cfg.pipeline.schedule == "gpipe_recompute":
            terms["stage recompute"] = stage_recompute_flops(terms)
    per_device = {k: v * tokens / n_devices * (S if k == "LM head" else bubble) for k, v in terms.items()}
    convention = metrics.train_flops_per_token(cfg.model, cfg.train.seq_len) * tokens / n_devices
    return DotFlops(terms=per_device, total=sum(per_device.values()), convention_per_device=convention,
                    bubble_factor=bubble, remat=remat,
                    redundant_head=per_device["LM head"] * (S - 1) / S if S > 1 and not head_on_last else 0.0)
