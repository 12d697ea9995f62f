"""GRPO's train step: one batch of scored samples, grpo.updates_per_batch optimizer updates over it.

A step of a GRPO run is one batch of samples, so train.steps counts batches and a resumed run
needs nothing of the previous batch. Before the first update the step computes, without
gradients, the reference policy's log-probabilities (grpo.beta > 0: the frozen copy, or a LoRA
run's base without its adapters) and, with more than one update per batch, the sampling policy's
(the parameters as they are before the first update), which every update's ratio divides by;
both over the whole batch at once, not per train.grad_accum micro-batch (a forward pass without
gradients keeps one layer's activations at a time).
The updates are trainer/step.py's train_step over the same batch (a `lax.scan`: one compiled
body), each advancing the optimizer's count, so the learning-rate schedule runs in updates
(optimizer.hyperparameters' updates_per_step stretches it to match). The state's `step` moves on
by one per batch (not per update); the logged metrics are the updates' means.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from maxtext_rocm.finetune import dpo
from maxtext_rocm.finetune.grpo.objective import OLD_LOGPS, REF_LOGPS, token_logprobs
from maxtext_rocm.trainer.optimizer import learning_rate
from maxtext_rocm.trainer.step import frozen_base, fused_head_loss, train_step

# Step metrics that count over the run rather than average over the updates.
_COUNTERS = ("nonfinite_steps", "skipped_in_a_row")


def grpo_train_step(state, batch: dict, hyperparameters: dict, *, model, clip: bool, train_cfg, grpo_cfg):
    """(state after the batch's updates, the step's metrics)."""
    fused = fused_head_loss(model.cfg, model.policy.fp8_lm_head)
    batch = dict(batch)

    def logps(params, frozen=None):
        return jax.lax.stop_gradient(token_logprobs(params, model, batch, fused=fused, fp8_state=state.fp8,
                                                    frozen=frozen)[0])

    if grpo_cfg.beta > 0:
        batch[REF_LOGPS] = logps(dpo.reference_params(state))
    updates = grpo_cfg.updates_per_batch
    if updates > 1:
        batch[OLD_LOGPS] = logps(state.params, frozen_base(state) or None)

    def update(current, _):
        return train_step(current, batch, hyperparameters, model=model, clip=clip, train_cfg=train_cfg,
                          grpo_cfg=grpo_cfg)

    if updates == 1:
        new_state, metrics = update(state, None)
    else:
        new_state, stacked = jax.lax.scan(update, state, None, length=updates)
        metrics = {k: v[-1] if k in _COUNTERS else jnp.mean(v, axis=0) for k, v in stacked.items()}
    moved = jnp.minimum(new_state.step - state.step, 1)
    metrics["lr"] = learning_rate(state.step * updates, hyperparameters)
    return new_state.replace(step=state.step + moved), metrics
