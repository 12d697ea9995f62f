"""The training state, the loss and the train/eval steps, as pure functions.

`train.py` jits these with explicit shardings; nothing here knows about meshes or hosts (the
fused head loss asks for the ambient mesh itself, maxtext_rocm/parallel/loss.py).

The loss is summed over tokens and divided by the token count of the whole global batch once,
after gradient accumulation, so `grad_accum=4` computes exactly the gradient of one 4x batch.
Under train.objective="dpo" (maxtext_rocm/finetune/dpo.py) the unit is the preference pair
instead of the token: summed over pairs, divided by the global pair count once (`Objective`);
under "grpo" (finetune/grpo/) the completion token or the completion.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import optax
from flax import linen as nn
from flax import struct

from maxtext_rocm.finetune import dpo, lora
from maxtext_rocm.finetune.grpo import objective as grpo
from maxtext_rocm.numerics import cross_entropy, fp8
from maxtext_rocm.numerics.fp8 import FP8_COLLECTION
from maxtext_rocm.models import moe
from maxtext_rocm.models.layers import ADAPTERS
from maxtext_rocm.models.llama import StackLoss, lm_head_weight
from maxtext_rocm.trainer.optimizer import build_optimizer, learning_rate
from maxtext_rocm.parallel import loss

Array = jax.Array
Batch = dict[str, Array]


class TrainState(struct.PyTreeNode):
    step: Array
    params: Any
    opt_state: Any
    nonfinite_steps: Array  # steps whose update was dropped for an inf/NaN loss or gradient
    # The latest run of consecutive dropped steps; at train.max_skipped_steps the state freezes
    # (on_nonfinite="skip"), so the host, which reads it only when it syncs anyway, finds the
    # last good state however late it looks.
    skipped_in_a_row: Array
    # Delayed-scaling fp8 state (maxtext_rocm/numerics/fp8.py); empty for other policies. Not a
    # parameter: the step overwrites it, the optimizer never sees it.
    fp8: Any = struct.field(default_factory=dict)
    # The DPO reference policy's frozen parameters (finetune/dpo.py's make_reference); empty for
    # other objectives. Not a parameter: no gradient, no optimizer state; checkpoints keep it.
    reference: Any = struct.field(default_factory=dict)


class LoraTrainState(TrainState):
    """A LoRA run's state (maxtext_rocm/finetune/lora.py): `params` are the adapters. A subclass,
    so that the checkpoints of every other run keep TrainState's tree."""
    # The frozen base in the compute dtype: never differentiated, never updated, not checkpointed
    # (the run's checkpoint.load_params_from, or train.seed, names it).
    frozen: Any = struct.field(default_factory=dict)


def frozen_base(state: TrainState):
    """A LoRA run's frozen base, or {} for any other state (or its sharding tree)."""
    return getattr(state, "frozen", {})


def without_base(state: TrainState) -> TrainState:
    """The state as checkpoints hold it: a LoRA run's without its base, which its config names."""
    return state.replace(frozen={}) if isinstance(state, LoraTrainState) else state


def create_state(rng: Array, model: nn.Module, tx: optax.GradientTransformation,
                 batch_shape: tuple[int, int], reference: bool = False) -> TrainState:
    """Fresh parameters and optimizer state (still boxed with their logical axes). A model whose
    policy adds adapters (LoRA) trains them alone: they become `params`, the base `frozen`.
    `reference`: with the DPO reference, a frozen copy of the parameters in the compute dtype."""
    variables = model.init(rng, jnp.zeros(batch_shape, jnp.int32))
    params, fields = variables["params"], {}
    if reference:
        fields["reference"] = dpo.make_reference(params, model.policy.compute_dtype)
    if variables.get(ADAPTERS):
        params, fields["frozen"] = variables[ADAPTERS], lora.to_compute_dtype(params, model.policy.compute_dtype)
    return (LoraTrainState if "frozen" in fields else TrainState)(
        step=jnp.zeros((), jnp.int32), params=params, opt_state=tx.init(params),
        nonfinite_steps=jnp.zeros((), jnp.int32), skipped_in_a_row=jnp.zeros((), jnp.int32),
        fp8=variables.get(FP8_COLLECTION, {}), **fields)


def token_losses(logits: Array, targets: Array) -> tuple[Array, Array]:
    """Per-token cross-entropy and log-partition (for z-loss), both in fp32."""
    logits = logits.astype(jnp.float32)
    log_z = jax.nn.logsumexp(logits, axis=-1)
    target_logit = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
    return log_z - target_logit, log_z


def fused_head_loss(model_cfg, fp8_lm_head: bool) -> bool:
    """Whether the loss applies the LM head itself, in chunks (maxtext_rocm/numerics/cross_entropy.py).
    An fp8 LM head keeps the model's own head, whose fp8 dot carries scaling state."""
    return model_cfg.loss_chunk_len > 0 and (model_cfg.tie_embeddings or not fp8_lm_head)


def summed_loss(params, model: nn.Module, batch: Batch, z_loss_weight: float, fp8_state=None, frozen=None,
                dropout_key=None):
    """The objective summed (not averaged) over tokens, and the sums the metrics need. Under LoRA
    `params` are the adapters and `frozen` the base; `dropout_key` turns the adapters' dropout on."""
    fused = fused_head_loss(model.cfg, model.policy.fp8_lm_head)
    weights = batch["weights"].astype(jnp.float32)
    if runs_the_loss(model):
        return _summed_loss_in_the_stack(params, model, batch, weights, z_loss_weight, fp8_state, frozen, dropout_key)
    out, aux = lora.apply_model(model, params, batch, frozen=frozen, fp8_state=fp8_state, dropout_key=dropout_key,
                                return_hidden=fused)
    if fused:
        head_weight, vocab_axis = lm_head_weight(frozen or params, model.cfg)
        objective, sums = loss.head_loss(  # on a mesh, each device on its own tokens (parallel/loss.py)
            out, head_weight, batch["targets"], weights, vocab_axis=vocab_axis, z_loss_weight=z_loss_weight,
            chunk=cross_entropy.chunk_length(out.shape[1], model.cfg.loss_chunk_len))
    else:
        ce, log_z = token_losses(out, batch["targets"])
        sums = {"ce": jnp.sum(ce * weights), "z_loss": jnp.sum(jnp.square(log_z) * weights)}
        objective = sums["ce"] + z_loss_weight * sums["z_loss"]
    tokens = jnp.sum(weights)
    router = _router_sums(aux, tokens)
    sums.update(tokens=tokens, **router)
    return objective + moe.weighted_router_loss(router, model.cfg), sums


def _router_sums(aux, tokens: Array) -> dict:
    """MoE router losses (zero for dense models) are means over this batch; times its token count
    they average over micro-batches like the rest once divided by the global token count."""
    return {name: value * tokens for name, value in moe.router_losses(aux).items()}


def runs_the_loss(model: nn.Module) -> bool:
    """Whether the model's layer stack runs the loss itself, per microbatch (pipeline.schedule="1f1b")."""
    return getattr(model.layer_stack, "runs_the_loss", False)


def _summed_loss_in_the_stack(params, model: nn.Module, batch: Batch, weights: Array, z_loss_weight: float,
                              fp8_state, frozen, dropout_key):
    """summed_loss's contract where the layer stack runs the fused head loss per microbatch: the
    model returns the objective, its router losses' share included (models/llama.py, StackLoss)."""
    def of_rows(head_weight, vocab_axis, hidden, rows):
        return loss.head_loss(hidden, head_weight, rows["targets"], rows["weights"], vocab_axis=vocab_axis,
                              z_loss_weight=z_loss_weight,
                              chunk=cross_entropy.chunk_length(hidden.shape[1], model.cfg.loss_chunk_len))

    def of_sown(aux):
        return moe.weighted_router_loss(_router_sums(aux, tokens), model.cfg)

    tokens = jnp.sum(weights)
    rows = {"targets": batch["targets"], "weights": weights}
    (objective, sums), aux = lora.apply_model(model, params, batch, frozen=frozen, fp8_state=fp8_state,
                                              dropout_key=dropout_key, loss=StackLoss(rows, of_rows, of_sown))
    sums = dict(sums, tokens=tokens, **_router_sums(aux, tokens))
    return objective, sums


def split_micro_batches(batch: Batch, n: int, rows_together: int = 1) -> Batch:
    """[B, ...] -> [n, B/n, ...] taking every n-th group of `rows_together` rows (a preference
    pair: 2), so each micro-batch keeps every device's share of the batch (a plain reshape would
    put micro-batch i on 1/n of them) and no group is cut."""
    def split(x):
        g = rows_together
        groups = x.reshape(x.shape[0] // (n * g), n, g, *x.shape[1:])
        return jnp.swapaxes(groups, 0, 1).reshape(n, x.shape[0] // n, *x.shape[1:])
    return jax.tree_util.tree_map(split, batch)


class Objective(NamedTuple):
    """What the step minimises, as a sum over the batch that the step divides once by a count."""
    summed_loss: Callable  # (params, batch, fp8_state, dropout_key) -> (summed objective, sums for the metrics)
    sum_keys: tuple  # the sums' keys (zeros start the accumulation)
    count_key: str  # the sum the mean divides by: "tokens" (LM) or "pairs" (DPO)
    rows_together: int  # rows that no micro-batch split may separate
    metrics: Callable  # sums -> the step's loss metrics, "loss" among them


def lm_objective(model: nn.Module, z_loss_weight: float, frozen=None) -> Objective:
    """Next-token cross-entropy; `frozen`: a LoRA run's base."""
    return Objective(lambda p, b, f, k: summed_loss(p, model, b, z_loss_weight, f, frozen, k),
                     ("ce", "z_loss", "tokens", *moe.ROUTER_LOSS_WEIGHTS), "tokens", 1, loss_metrics)


def dpo_objective(model: nn.Module, reference, dpo_cfg, frozen=None) -> Objective:
    """Preference pairs against `reference`; `frozen`: a LoRA run's base (then also the reference)."""
    fused = fused_head_loss(model.cfg, model.policy.fp8_lm_head)
    return Objective(lambda p, b, f, k: dpo.summed_loss(p, reference, model, b, dpo_cfg, fused=fused, fp8_state=f,
                                                        frozen=frozen, dropout_key=k),
                     dpo.SUM_KEYS, "pairs", 2, dpo.metrics)


def grpo_objective(model: nn.Module, grpo_cfg, frozen=None) -> Objective:
    """GRPO's clipped surrogate on a batch of scored samples (finetune/grpo/objective.py), a mean
    over completion tokens or over completions (grpo.normalization); `frozen`: a LoRA run's base."""
    fused = fused_head_loss(model.cfg, model.policy.fp8_lm_head)
    count_key = "sequences" if grpo_cfg.normalization == "sequence" else "tokens"
    return Objective(lambda p, b, f, k: grpo.summed_loss(p, model, b, grpo_cfg, fused=fused, fp8_state=f,
                                                         frozen=frozen, dropout_key=k),
                     grpo.SUM_KEYS, count_key, 1, lambda sums: grpo.metrics(sums, count_key))


def step_objective(state: TrainState, model: nn.Module, train_cfg, dpo_cfg=None, grpo_cfg=None) -> Objective:
    """train.objective's Objective for this state."""
    if train_cfg.get("objective", "lm") == "grpo":
        return grpo_objective(model, grpo_cfg, frozen_base(state))
    if train_cfg.get("objective", "lm") == "dpo":
        return dpo_objective(model, dpo.reference_params(state), dpo_cfg, frozen_base(state))
    return lm_objective(model, train_cfg.z_loss_weight, frozen_base(state))


class SummedGradients(NamedTuple):
    """The gradients of the objective summed over the batch's tokens, the fp8 state's update (it
    arrives as the "gradient" of the fp8 state) and the loss sums."""
    grads: Any
    fp8_update: Any
    sums: dict


def summed_gradients(params, model: nn.Module, batch: Batch, grad_accum: int, z_loss_weight: float,
                     fp8_state=None, objective: Objective | None = None, dropout_key=None) -> SummedGradients:
    """The summed gradients of `params`, accumulating micro-batches; `objective`: the LM loss unless
    given; `dropout_key`: the step's key for LoRA's adapter dropout (None: no dropout)."""
    fp8_state = fp8_state or {}
    objective = objective or lm_objective(model, z_loss_weight)
    grad_fn = jax.value_and_grad(objective.summed_loss, argnums=(0, 2), has_aux=True)
    if grad_accum == 1:
        (_, sums), (grads, fp8_update) = grad_fn(params, batch, fp8_state, dropout_key)
        return SummedGradients(grads, fp8_update, sums)

    def accumulate(carry, micro):
        grads_acc, fp8_acc, sums_acc = carry
        micro, index = micro
        key = None if dropout_key is None else jax.random.fold_in(dropout_key, index)
        (_, sums), (grads, fp8_update) = grad_fn(params, micro, fp8_state, key)
        return (jax.tree_util.tree_map(jnp.add, grads_acc, grads), fp8.combine_updates(fp8_acc, fp8_update),
                jax.tree_util.tree_map(jnp.add, sums_acc, sums)), None

    zeros = jax.tree_util.tree_map(jnp.zeros_like, params)
    fp8_start = fp8.merge_identity(fp8_state)
    zero_sums = {k: jnp.zeros((), jnp.float32) for k in objective.sum_keys}
    (grads, fp8_update, sums), _ = jax.lax.scan(
        accumulate, (zeros, fp8_start, zero_sums),
        (split_micro_batches(batch, grad_accum, objective.rows_together), jnp.arange(grad_accum)))
    return SummedGradients(grads, fp8_update, sums)


def token_count(sums: dict) -> jax.Array:
    return jnp.maximum(sums["tokens"], 1.0)


def loss_metrics(sums: dict) -> dict:
    """Token means of the summed losses."""
    tokens = token_count(sums)
    return {"loss": sums["ce"] / tokens, "z_loss": sums["z_loss"] / tokens, "tokens": sums["tokens"],
            **{name: sums[name] / tokens for name in moe.ROUTER_LOSS_WEIGHTS}}


def scaled(tree, factor: jax.Array):
    """Every array of `tree` times the scalar `factor` (a multiply, which XLA fuses into consumers)."""
    return jax.tree_util.tree_map(lambda x: x * factor.astype(x.dtype), tree)


def padding_fraction(batch: Batch) -> Array:
    """The share of the batch's positions that hold no token (segment id 0): what packing wasted.
    A masked prompt (weight 0 inside a segment) is not padding. A batch without segment ids (the
    synthetic and embedded sources) has none. A mean over the global batch array, so every process
    reports the global fraction, read on logging steps with the loss (no extra host sync)."""
    if "segment_ids" not in batch:
        return jnp.zeros((), jnp.float32)
    return jnp.mean((batch["segment_ids"] == 0).astype(jnp.float32))


class Gradients(NamedTuple):
    """Token-mean gradients over the whole batch, the fp8 state's update, the loss metrics."""
    grads: Any
    fp8_update: Any
    metrics: dict


def gradients(params, model: nn.Module, batch: Batch, grad_accum: int, z_loss_weight: float,
              fp8_state=None, objective: Objective | None = None, frozen=None) -> Gradients:
    """The token-mean (pair-mean for DPO) gradients over the whole batch, accumulating micro-batches
    (`frozen`: a LoRA base, whose gradient is never formed)."""
    objective = objective or lm_objective(model, z_loss_weight, frozen)
    summed = summed_gradients(params, model, batch, grad_accum, z_loss_weight, fp8_state, objective)
    count = jnp.maximum(summed.sums[objective.count_key], 1.0)
    return Gradients(scaled(summed.grads, 1.0 / count), summed.fp8_update, objective.metrics(summed.sums))


class StepDecision(NamedTuple):
    """What one step does with its update, and the counters it leaves (int32 scalars)."""
    apply: Array            # bool: run the optimizer update (else keep params, optimizer and fp8 state)
    step_increment: Array   # 0 or 1: whether `step` moves on
    nonfinite_steps: Array  # the new count of dropped non-finite steps
    skipped_in_a_row: Array  # the new length of the latest run of dropped steps


def decide_step(finite: Array, *, halting: bool, nonfinite_steps: Array, skipped_in_a_row: Array,
                max_skipped_steps: int) -> StepDecision:
    """The skip/halt rule, pure and traceable. An inf/NaN step must not poison the state.

    - The state is *frozen* under "stop" (`halting`) once any step was non-finite, and under
      "skip" once `max_skipped_steps` steps in a row were: a frozen state changes no more (no
      update, no count, `step` stays), so the host, however late it looks, finds the last good
      state, and divergence that skipping cannot cure stops the run (trainer/divergence.py)
      instead of being skipped silently to the end.
    - Otherwise a finite step applies its update and resets the run of skips; a non-finite one
      drops its update and counts in both counters.
    - `step` moves on with every step that is not frozen under "skip" (a skipped step is still a
      step of the schedule), but under "stop" only with an applied update.
    """
    frozen = (nonfinite_steps > 0) if halting else (skipped_in_a_row >= max_skipped_steps)
    apply = finite & ~frozen
    counts = (~finite & ~frozen).astype(jnp.int32)
    return StepDecision(
        apply=apply,
        step_increment=(apply if halting else ~frozen).astype(jnp.int32),
        nonfinite_steps=nonfinite_steps + counts,
        skipped_in_a_row=jnp.where(apply, 0, skipped_in_a_row + counts))


def train_step(state: TrainState, batch: Batch, hyperparameters: dict[str, Array], *, model: nn.Module,
               clip: bool, train_cfg, dpo_cfg=None, grpo_cfg=None):
    """One optimizer step. `hyperparameters` (optim.hyperparameters) are arrays, not constants of
    the compiled program, so runs that differ only in them share it; `clip`: whether the optimizer
    clips (its state's layout depends on it); `dpo_cfg`, `grpo_cfg`: the dpo and grpo groups, read
    under train.objective="dpo" and "grpo" (whose step is finetune/grpo/step.py's, around this one)."""
    tx = build_optimizer(hyperparameters, clip)
    objective = step_objective(state, model, train_cfg, dpo_cfg, grpo_cfg)
    summed = summed_gradients(state.params, model, batch, train_cfg.grad_accum, train_cfg.z_loss_weight,
                              state.fp8, objective, lora_dropout_key(model, train_cfg.seed, state.step))
    metrics = objective.metrics(summed.sums)
    # The token mean is taken inside the update branch below, where its multiply fuses into the
    # optimizer's kernels; before the branch it would be one more pass over every gradient (and
    # one more kernel per parameter for XLA to compile). The norm of the mean is the mean's norm.
    inv_tokens = 1.0 / jnp.maximum(summed.sums[objective.count_key], 1.0)
    grad_norm = optax.tree.norm(summed.grads) * inv_tokens

    decision = decide_step(jnp.isfinite(metrics["loss"]) & jnp.isfinite(grad_norm),
                           halting=train_cfg.on_nonfinite == "stop", nonfinite_steps=state.nonfinite_steps,
                           skipped_in_a_row=state.skipped_in_a_row,
                           max_skipped_steps=train_cfg.max_skipped_steps)

    # A branch rather than a select between old and new: the update then runs in place in the
    # donated buffers instead of beside a copy of parameters and optimizer state.
    def update(operands):
        params, opt_state, grads, fp8_update, _ = operands
        updates, opt_state = tx.update(scaled(grads, inv_tokens), opt_state, params, grad_norm=grad_norm)
        return optax.apply_updates(params, updates), opt_state, fp8_update

    def keep(operands):
        params, opt_state, _, _, fp8_state = operands
        return params, opt_state, fp8_state

    params, opt_state, fp8_state = jax.lax.cond(
        decision.apply, update, keep, (state.params, state.opt_state, summed.grads, summed.fp8_update, state.fp8))
    new_state = state.replace(
        step=state.step + decision.step_increment, params=params, opt_state=opt_state, fp8=fp8_state,
        nonfinite_steps=decision.nonfinite_steps, skipped_in_a_row=decision.skipped_in_a_row)
    metrics.update(grad_norm=grad_norm, lr=learning_rate(state.step, hyperparameters), padding=padding_fraction(batch),
                   nonfinite_steps=new_state.nonfinite_steps, skipped_in_a_row=new_state.skipped_in_a_row)
    return new_state, metrics


def lora_dropout_key(model: nn.Module, seed: int, step: Array):
    """The step's key for the adapters' dropout (a function of train.seed and the step, so a resumed
    run draws what the uninterrupted one would), or None when no layer drops anything."""
    if lora.dropout_rate(model.policy) == 0:
        return None
    return jax.random.fold_in(jax.random.key(seed), step)


def eval_step(params, batch: Batch, *, model: nn.Module, fp8_state=None, reference=None, dpo_cfg=None,
              frozen=None):
    """The LM loss's token mean and token count; under DPO (`dpo_cfg` given) the batch's DPO sums
    instead (finetune/dpo.py's SUM_KEYS), which evaluations add up. `frozen`: a LoRA run's base
    (`params` are then its adapters, and the DPO reference is the base alone)."""
    if dpo_cfg is not None:
        fused = fused_head_loss(model.cfg, model.policy.fp8_lm_head)
        _, sums = dpo.summed_loss(params, frozen or reference, model, batch, dpo_cfg, fused=fused,
                                  fp8_state=fp8_state, frozen=frozen)
        return {key: sums[key] for key in dpo.EVAL_SUM_KEYS}
    _, sums = summed_loss(params, model, batch, 0.0, fp8_state, frozen)
    return {"loss": sums["ce"] / jnp.maximum(sums["tokens"], 1.0), "tokens": sums["tokens"]}
