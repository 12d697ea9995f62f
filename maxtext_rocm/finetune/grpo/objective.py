"""GRPO's loss on fixed samples: the clipped surrogate of PPO with group-relative advantages and
an optional KL penalty to a reference policy, as TRL's GRPOTrainer defines it.

For each completion token t of row b, with r = exp(log pi(t) - log pi_old(t)) and the row's
advantage A_b:

    loss_bt = -min(r A_b, clip(r, 1 - eps, 1 + eps) A_b) + beta kl_bt,
    kl_bt   = exp(ref - logp) - (ref - logp) - 1      (the k3 estimator of KL(pi || pi_ref))

pi_old is the policy that sampled the batch: with grpo.updates_per_batch=1 it is the policy being
differentiated, so r = 1 in value (stop_gradient) and only its gradient acts; with more updates
per batch its log-probabilities are computed once, before the first update (step.py).

Normalisation (grpo.normalization):
- "token" (the default): the sum of loss_bt over every completion token of the global batch,
  divided by their count. Every token weighs the same, so a long completion is not worth less per
  token than a short one (DAPO's argument, and TRL's default since it adopted it); the step's
  count is "tokens", summed over micro-batches and devices like the LM loss's.
- "sequence": each row's mean over its own tokens, then the mean over rows (the GRPO paper's
  1/G sum_i 1/|o_i| sum_t); the count is "sequences".
Either way the step sums over micro-batches and divides once, so grad_accum changes nothing.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from maxtext_rocm.finetune import lora
from maxtext_rocm.models import moe
from maxtext_rocm.models.llama import lm_head_weight
from maxtext_rocm.numerics import cross_entropy
from maxtext_rocm.parallel import loss

Array = jax.Array

SUM_KEYS = ("grpo_loss", "kl", "clipped", "ratio", "tokens", "sequences", *moe.ROUTER_LOSS_WEIGHTS)
# What the batch carries beside the tokens: each row's advantage on its every position, and, where
# the step computed them, the sampling policy's and the reference's log-probabilities.
ADVANTAGES, OLD_LOGPS, REF_LOGPS = "advantages", "old_logps", "ref_logps"


def token_logprobs(params, model, batch: dict, *, fused: bool, fp8_state=None, frozen=None,
                   dropout_key=None) -> tuple[Array, dict]:
    """([rows, seq] fp32 log p(target) at each position, the MoE router losses), differentiable.
    `fused`: through the chunked LM head (parallel/loss.py), else from the model's full logits.
    Under LoRA `params` are the adapters and `frozen` the base."""
    out, aux = lora.apply_model(model, params, batch, frozen=frozen, fp8_state=fp8_state, dropout_key=dropout_key,
                                return_hidden=fused)
    if fused:
        head_weight, vocab_axis = lm_head_weight(frozen or params, model.cfg)
        chunk = cross_entropy.chunk_length(out.shape[1], model.cfg.loss_chunk_len)
        logps = loss.token_logprobs(out, head_weight, batch["targets"], vocab_axis, chunk)
    else:
        log_probs = jax.nn.log_softmax(out.astype(jnp.float32), axis=-1)
        logps = jnp.take_along_axis(log_probs, batch["targets"][..., None], axis=-1)[..., 0]
    return logps, moe.router_losses(aux)


class TokenTerms(NamedTuple):
    """Per position [rows, seq] fp32, meaningful where the completion mask is 1."""
    losses: Array  # the clipped surrogate's negation, plus beta x kl
    kl: Array  # k3 estimate of KL(pi || pi_ref); zeros without a reference
    clipped: Array  # 1 where the clip bounds the ratio (it moved past 1 +- eps the way A pushes it)
    ratio: Array  # pi / pi_old


def token_terms(logps: Array, old_logps: Array, advantages: Array, epsilon: float, beta: float,
                ref_logps: Array | None = None) -> TokenTerms:
    """GRPO's per-token loss (see the module's doc) from log-probabilities and advantages."""
    ratio = jnp.exp(logps - old_logps)
    unclipped, clipped = ratio * advantages, jnp.clip(ratio, 1.0 - epsilon, 1.0 + epsilon) * advantages
    losses = -jnp.minimum(unclipped, clipped)
    was_clipped = ((ratio < 1.0 - epsilon) & (advantages < 0)) | ((ratio > 1.0 + epsilon) & (advantages > 0))
    kl = jnp.zeros_like(logps)
    if ref_logps is not None:
        gap = ref_logps - logps
        kl = jnp.exp(gap) - gap - 1.0
        if beta:
            losses = losses + beta * kl
    return TokenTerms(losses, kl, was_clipped.astype(jnp.float32), ratio)


def summed_and_count(losses: Array, mask: Array, normalization: str) -> tuple[Array, Array]:
    """(the batch's sum, the count it is a mean over): the masked token losses summed ("token", over
    the completion tokens) or each row's token mean summed ("sequence", over the rows). The step
    divides the sum, accumulated over micro-batches and devices, by the global count once."""
    if normalization == "sequence":
        per_row = jnp.sum(losses * mask, axis=1) / jnp.maximum(jnp.sum(mask, axis=1), 1.0)
        return jnp.sum(per_row), jnp.asarray(mask.shape[0], jnp.float32)
    return jnp.sum(losses * mask), jnp.sum(mask)


def summed_loss(params, model, batch: dict, grpo_cfg, *, fused: bool, fp8_state=None, frozen=None,
                dropout_key=None):
    """(objective, sums): GRPO's loss summed over the batch's completion tokens ("token") or rows
    ("sequence"), the MoE router losses scaled alike, and the sums of SUM_KEYS."""
    logps, router = token_logprobs(params, model, batch, fused=fused, fp8_state=fp8_state, frozen=frozen,
                                   dropout_key=dropout_key)
    mask = batch["weights"].astype(jnp.float32)
    old = batch[OLD_LOGPS] if OLD_LOGPS in batch else jax.lax.stop_gradient(logps)
    terms = token_terms(logps, old, batch[ADVANTAGES], grpo_cfg.epsilon, grpo_cfg.beta, batch.get(REF_LOGPS))
    objective, count = summed_and_count(terms.losses, mask, grpo_cfg.normalization)
    tokens, rows = jnp.sum(mask), jnp.asarray(mask.shape[0], jnp.float32)
    # Router losses are batch means: times the count they average like the loss once divided by it.
    router = {name: value * count for name, value in router.items()}
    sums = {"grpo_loss": objective, "kl": jnp.sum(terms.kl * mask), "clipped": jnp.sum(terms.clipped * mask),
            "ratio": jnp.sum(terms.ratio * mask), "tokens": tokens, "sequences": rows, **router}
    return objective + moe.weighted_router_loss(router, model.cfg), sums


def metrics(sums: dict, count_key: str) -> dict:
    """The step's GRPO metrics: "loss" (the objective's mean by `count_key`), and token means of the
    KL estimate, the clipped fraction and the probability ratio."""
    count, tokens = jnp.maximum(sums[count_key], 1.0), jnp.maximum(sums["tokens"], 1.0)
    return {"loss": sums["grpo_loss"] / count, "grpo_kl": sums["kl"] / tokens,
            "grpo_clip_fraction": sums["clipped"] / tokens, "grpo_ratio": sums["ratio"] / tokens,
            "tokens": sums["tokens"], **{name: sums[name] / count for name in moe.ROUTER_LOSS_WEIGHTS}}
