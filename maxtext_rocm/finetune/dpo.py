"""Direct Preference Optimization (Rafailov et al., 2023), TRL's sigmoid loss, as a pure objective.

The batch holds pairs: row 2i is the chosen sequence (prompt + chosen response), row 2i+1 the
rejected one for the same prompt; `weights` is 1 on the response's target tokens only, so a row's
log-probability is sum_t weights x log p(target). With r = beta x (log pi(y|x) - log pi_ref(y|x))
for each response, a pair's loss is

    -(1 - eps) log sigmoid(r_chosen - r_rejected) - eps log sigmoid(r_rejected - r_chosen)

Packed rows (data.packing="best_fit", data/packed_pairs.py) hold several pairs instead, each
sequence its own segment: `pair_ids` gives each position's pair in its row (k + 1 for the k-th,
0 on padding) and the segment's parity its side (odd: chosen), and each sequence's
log-probability is the sum over its own positions (`packed_logprobs`). The per-sequence values
are then laid out as unpacked rows are (chosen, rejected, chosen, ...: a row's pair slots in
order, the empty ones masked like empty rows), so the loss, the rewards and the metrics below are
one computation for both layouts.

(eps = dpo.label_smoothing, 0 by default: the plain DPO loss), averaged over the pairs of the
global batch. Like the LM loss (trainer/step.py), the step sums it over pairs, through gradient
accumulation and over the mesh, and divides by the global pair count once; micro-batches are cut
between pairs, never inside one, so grad_accum=n computes exactly the gradient of one n x batch.

The reference policy pi_ref is the starting point. Without LoRA it is `make_reference`: a frozen
copy of the initial parameters in the compute dtype, held in the train state beside the
parameters (not in the optimizer: no gradients, no moments), sharded like them, saved in
checkpoints and so restored on resume. It costs 2 bytes per parameter under bf16 (4 under fp32)
and one forward pass per step without gradients (about a third more FLOPs than the step alone).
Computing the reference's log-probabilities once up front would save that forward pass but bind
the run to one pass over a fixed data order and add a data dependency to resume; the copy works
with any data source. With LoRA the reference is the base model without its adapters and needs no
copy: `reference_params` is the one place that decides which parameters the reference runs with.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from maxtext_rocm.finetune import lora
from maxtext_rocm.models import moe
from maxtext_rocm.models.llama import lm_head_weight
from maxtext_rocm.numerics import cross_entropy
from maxtext_rocm.parallel import loss

Array = jax.Array

# The sums a step accumulates over micro-batches (their metric means divide by "pairs").
SUM_KEYS = ("dpo_loss", "chosen_reward", "rejected_reward", "correct", "pairs", "tokens", *moe.ROUTER_LOSS_WEIGHTS)
# Those an evaluation adds up over its batches (eval_metrics turns them into pair means).
EVAL_SUM_KEYS = ("dpo_loss", "chosen_reward", "rejected_reward", "correct", "pairs")


def make_reference(params, compute_dtype):
    """The frozen reference: every matrix of `params` in the compute dtype, which is what the
    model computes with anyway; vectors (norm scales) stay as they are, since the model reads
    them in fp32 and they are tiny. So the reference's forward pass is the starting policy's, bit
    for bit, and the first step's loss is ln 2 exactly. Works on boxed (logically partitioned)
    parameters too, keeping their axes: the reference shards like the parameters."""
    return jax.tree_util.tree_map(lambda x: x.astype(compute_dtype) if x.ndim >= 2 else x, params)


def reference_params(state) -> Any:
    """The parameters the reference policy runs with: under LoRA the frozen base, applied without
    its adapters (no second copy); otherwise the frozen copy the state holds (`make_reference`)."""
    return getattr(state, "frozen", None) or state.reference


def refreshed_reference(reference, params):
    """`reference` remade from new starting `params` (checkpoint.load_params_from), each leaf in
    the dtype the reference holds it in, and always a buffer of its own: `astype` to the dtype an
    array already has returns that same array (the fp32 norm scales), and the train step, which
    donates the state, must never be handed one buffer as both a parameter and the reference."""
    return jax.tree_util.tree_map(lambda r, p: p.astype(r.dtype) if p.dtype != r.dtype else jnp.copy(p),
                                  reference, params)


class SequenceLogprobs(NamedTuple):
    """A forward pass's per-sequence log-probabilities and the MoE router losses (batch means)."""
    logps: Array  # [sequences] fp32: sum over a sequence's tokens of weights x log p(target)
    router: dict


def sequence_logprobs(params, model, batch: dict, *, fused: bool, fp8_state=None, frozen=None,
                      dropout_key=None) -> SequenceLogprobs:
    """Each row's log-probability of its weighted targets under `params`, differentiable. `fused`:
    whether the loss applies the LM head itself, in chunks (trainer/step.py's fused_head_loss),
    which works on every mesh (parallel/loss.py); else from the model's full logits. Under LoRA
    `params` are the adapters and `frozen` the base (finetune/lora.py)."""
    out, aux = lora.apply_model(model, params, batch, frozen=frozen, fp8_state=fp8_state, dropout_key=dropout_key,
                                return_hidden=fused)
    weights = batch["weights"].astype(jnp.float32)
    packed = PAIR_IDS in batch
    if fused:
        head_weight, vocab_axis = lm_head_weight(frozen or params, model.cfg)
        chunk = cross_entropy.chunk_length(out.shape[1], model.cfg.loss_chunk_len)
        if packed:
            target = loss.token_logprobs(out, head_weight, batch["targets"], vocab_axis, chunk)
        else:
            logps = loss.sequence_logprobs(out, head_weight, batch["targets"], weights, vocab_axis, chunk)
    else:
        log_probs = jax.nn.log_softmax(out.astype(jnp.float32), axis=-1)
        target = jnp.take_along_axis(log_probs, batch["targets"][..., None], axis=-1)[..., 0]
        logps = jnp.sum(target * weights, axis=1)
    if packed:
        logps = packed_logprobs(target * weights, batch)
    return SequenceLogprobs(logps, moe.router_losses(aux))


PAIR_IDS = "pair_ids"  # the batch key of packed rows (data/packed_pairs.py)


def _sequence_slots(batch: dict) -> Array:
    """[rows, seq] int32: each position's sequence in its row's pair slots, 2k for the chosen and
    2k + 1 for the rejected sequence of pair k; 2 x seq (one past the last slot) on padding. A row
    of seq positions holds at most seq pairs (each takes one position or more)."""
    pair, segment = batch[PAIR_IDS], batch["segment_ids"]
    slot = 2 * (pair - 1) + (segment - 1) % 2
    return jnp.where(pair > 0, slot, 2 * pair.shape[1])


def packed_logprobs(token_logps: Array, batch: dict) -> Array:
    """[rows x seq x 2] fp32: the log-probability of each sequence slot of packed rows (the sum of
    `token_logps` over its positions; 0 for a slot no pair fills), in the unpacked rows' order:
    row by row, pair by pair, chosen then rejected."""
    slots = 2 * token_logps.shape[1]
    per_row = jax.vmap(lambda values, index: jax.ops.segment_sum(values, index, num_segments=slots + 1))
    return per_row(token_logps, _sequence_slots(batch))[:, :slots].reshape(-1)


class PairTerms(NamedTuple):
    """Per pair [pairs], fp32: its loss and the implicit rewards beta x (policy - reference)."""
    losses: Array
    chosen_rewards: Array
    rejected_rewards: Array


def pair_terms(policy_logps: Array, reference_logps: Array, beta: float, label_smoothing: float = 0.0) -> PairTerms:
    """TRL's sigmoid DPO loss of each pair from per-row log-probabilities (rows: chosen, rejected,
    chosen, ...)."""
    rewards = beta * (policy_logps - reference_logps)
    chosen, rejected = rewards[0::2], rewards[1::2]
    margin = chosen - rejected
    losses = -(1.0 - label_smoothing) * jax.nn.log_sigmoid(margin) - label_smoothing * jax.nn.log_sigmoid(-margin)
    return PairTerms(losses, chosen, rejected)


def real_pairs(batch: dict, pairs: int) -> Array:
    """[pairs] fp32: 1 for a pair, 0 for the empty rows that complete an epoch's last batch under
    data.buckets (data/bucketed.py: no token, segment id 0 throughout), which then count in no
    sum and no pair mean; in packed rows, the pair slots no pair fills. A batch without segment ids
    holds pairs only."""
    if PAIR_IDS in batch:
        filled = jax.vmap(lambda index: jax.ops.segment_sum(jnp.ones(index.shape, jnp.float32), index,
                                                            num_segments=2 * index.shape[0] + 1))
        return (filled(_sequence_slots(batch))[:, :-1].reshape(-1, 2).sum(axis=1) > 0).astype(jnp.float32)
    if "segment_ids" not in batch:
        return jnp.ones((pairs,), jnp.float32)
    return jnp.any(batch["segment_ids"].reshape(pairs, -1) != 0, axis=1).astype(jnp.float32)  # rows 2i, 2i+1


def summed_loss(params, reference, model, batch: dict, dpo_cfg, *, fused: bool, fp8_state=None, frozen=None,
                dropout_key=None):
    """(objective, sums): the DPO loss summed over this batch's pairs (plus the MoE router losses
    scaled alike) and the sums of SUM_KEYS. The reference's pass carries no gradient. Under LoRA
    `params` are the adapters, `frozen` the base, and `reference` that same base without adapters."""
    policy = sequence_logprobs(params, model, batch, fused=fused, fp8_state=fp8_state, frozen=frozen,
                               dropout_key=dropout_key)
    ref = jax.lax.stop_gradient(sequence_logprobs(reference, model, batch, fused=fused, fp8_state=fp8_state).logps)
    terms = pair_terms(policy.logps, ref, dpo_cfg.beta, dpo_cfg.label_smoothing)
    real = real_pairs(batch, terms.losses.shape[0])
    terms = PairTerms(*(term * real for term in terms))
    pairs = jnp.sum(real)
    # Router losses are batch means: times the pair count they average over micro-batches like
    # the DPO loss once the step divides by the global pair count.
    router = {name: value * pairs for name, value in policy.router.items()}
    objective = jnp.sum(terms.losses)
    sums = {"dpo_loss": objective, "chosen_reward": jnp.sum(terms.chosen_rewards),
            "rejected_reward": jnp.sum(terms.rejected_rewards),
            "correct": jnp.sum((terms.chosen_rewards > terms.rejected_rewards).astype(jnp.float32)),
            "pairs": pairs, "tokens": jnp.sum(batch["weights"].astype(jnp.float32)),
            **router}
    return objective + moe.weighted_router_loss(router, model.cfg), sums


def metrics(sums: dict) -> dict:
    """Pair means of the summed terms. "loss" is the DPO loss (what the console prints and the
    divergence check reads); the reward margin is chosen minus rejected reward; the accuracy the
    fraction of pairs whose chosen reward is the higher (0 at the first step, where all are 0)."""
    pairs = jnp.maximum(sums["pairs"], 1.0)
    return {"loss": sums["dpo_loss"] / pairs,
            "dpo_reward_margin": (sums["chosen_reward"] - sums["rejected_reward"]) / pairs,
            "dpo_accuracy": sums["correct"] / pairs, "dpo_chosen_reward": sums["chosen_reward"] / pairs,
            "dpo_rejected_reward": sums["rejected_reward"] / pairs, "tokens": sums["tokens"], "pairs": sums["pairs"],
            **{name: sums[name] / pairs for name in moe.ROUTER_LOSS_WEIGHTS}}


def eval_metrics(sums: dict) -> dict:
    """An evaluation's row from its summed EVAL_SUM_KEYS (host floats): pair means, and the pair count."""
    pairs = max(sums["pairs"], 1.0)
    return {"eval_loss": sums["dpo_loss"] / pairs, "eval_dpo_accuracy": sums["correct"] / pairs,
            "eval_dpo_reward_margin": (sums["chosen_reward"] - sums["rejected_reward"]) / pairs,
            "eval_pairs": sums["pairs"]}
