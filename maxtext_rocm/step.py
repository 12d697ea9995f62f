"""The training state, the loss and the train/eval steps, as pure functions.

`train.py` jits these with explicit shardings; nothing here knows about meshes or hosts.

The loss is summed over tokens and divided by the token count of the whole global batch once,
after gradient accumulation, so `grad_accum=4` computes exactly the gradient of one 4x batch.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import linen as nn
from flax import struct

Array = jax.Array
Batch = dict[str, Array]


class TrainState(struct.PyTreeNode):
    step: Array
    params: Any
    opt_state: Any


def create_state(rng: Array, model: nn.Module, tx: optax.GradientTransformation,
                 batch_shape: tuple[int, int]) -> TrainState:
    """Fresh parameters and optimizer state (still boxed with their logical axes)."""
    params = model.init(rng, jnp.zeros(batch_shape, jnp.int32))["params"]
    return TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=tx.init(params))


def token_losses(logits: Array, targets: Array) -> tuple[Array, Array]:
    """Per-token cross-entropy and log-partition (for z-loss), both in fp32."""
    logits = logits.astype(jnp.float32)
    log_z = jax.nn.logsumexp(logits, axis=-1)
    target_logit = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
    return log_z - target_logit, log_z


def summed_loss(params, model: nn.Module, batch: Batch, z_loss_weight: float):
    """The objective summed (not averaged) over tokens, and the sums the metrics need."""
    logits = model.apply({"params": params}, batch["inputs"], batch.get("positions"),
                         batch.get("segment_ids"))
    ce, log_z = token_losses(logits, batch["targets"])
    weights = batch["weights"].astype(jnp.float32)
    sums = {
        "ce": jnp.sum(ce * weights),
        "z_loss": jnp.sum(jnp.square(log_z) * weights),
        "tokens": jnp.sum(weights),
    }
    return sums["ce"] + z_loss_weight * sums["z_loss"], sums


def split_micro_batches(batch: Batch, n: int) -> Batch:
    """[B, ...] -> [n, B/n, ...] taking every n-th row, so each micro-batch keeps every
    device's share of the batch (a plain reshape would put micro-batch i on 1/n of them)."""
    def split(x):
        return jnp.swapaxes(x.reshape(x.shape[0] // n, n, *x.shape[1:]), 0, 1)
    return jax.tree_util.tree_map(split, batch)


def gradients(params, model: nn.Module, batch: Batch, grad_accum: int, z_loss_weight: float):
    """Token-mean gradients over the whole batch and the loss sums, accumulating micro-batches."""
    grad_fn = jax.value_and_grad(summed_loss, has_aux=True)
    if grad_accum == 1:
        (_, sums), grads = grad_fn(params, model, batch, z_loss_weight)
    else:
        def accumulate(carry, micro):
            grads_acc, sums_acc = carry
            (_, sums), grads = grad_fn(params, model, micro, z_loss_weight)
            return (jax.tree_util.tree_map(jnp.add, grads_acc, grads),
                    jax.tree_util.tree_map(jnp.add, sums_acc, sums)), None

        zeros = jax.tree_util.tree_map(jnp.zeros_like, params)
        zero_sums = {k: jnp.zeros((), jnp.float32) for k in ("ce", "z_loss", "tokens")}
        (grads, sums), _ = jax.lax.scan(
            accumulate, (zeros, zero_sums), split_micro_batches(batch, grad_accum))
    tokens = jnp.maximum(sums["tokens"], 1.0)
    grads = jax.tree_util.tree_map(lambda g: g / tokens, grads)
    return grads, {"loss": sums["ce"] / tokens, "z_loss": sums["z_loss"] / tokens, "tokens": sums["tokens"]}


def train_step(state: TrainState, batch: Batch, *, model: nn.Module,
               tx: optax.GradientTransformation, schedule: optax.Schedule, train_cfg):
    grads, metrics = gradients(state.params, model, batch, train_cfg.grad_accum, train_cfg.z_loss_weight)
    updates, opt_state = tx.update(grads, state.opt_state, state.params)
    new_state = state.replace(
        step=state.step + 1, params=optax.apply_updates(state.params, updates), opt_state=opt_state)
    metrics.update(grad_norm=optax.tree.norm(grads), lr=schedule(state.step))
    return new_state, metrics


def eval_step(params, batch: Batch, *, model: nn.Module):
    _, sums = summed_loss(params, model, batch, 0.0)
    return {"loss": sums["ce"] / jnp.maximum(sums["tokens"], 1.0), "tokens": sums["tokens"]}
