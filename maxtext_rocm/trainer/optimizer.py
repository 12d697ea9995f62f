"""The optimizer: global-norm clipping, then AdamW under a warmup + cosine (or constant) schedule.

Weight decay applies to kernels and embeddings, never to norm scales. The train step passes the
gradients' global norm, which it computes anyway for its metrics and its inf/NaN check, as
`tx.update(..., grad_norm=...)`: the clipping reads it instead of reducing over every gradient a
second time (XLA cannot share the two reductions, since the update runs inside a `lax.cond`).

The optimizer's numbers (learning rate and schedule, betas, eps, weight decay, clipping norm) reach
the train step as an argument, `hyperparameters(...)`, not as constants compiled into it. So a run
resumed with more `train.steps`, or a sweep over learning rates, runs the step that the first run
compiled (from the persistent compilation cache) instead of compiling its own. Only whether
clipping is on is fixed at compile time: it changes the optimizer state's layout, hence checkpoints.
"""

from __future__ import annotations

from typing import Mapping

import jax
import jax.numpy as jnp
import numpy as np
import optax

HYPERPARAMETERS = ("lr", "warmup_steps", "decay_steps", "min_lr_ratio", "b1", "b2", "eps", "weight_decay",
                   "clip_norm")


def hyperparameters(opt_cfg, total_steps: int, updates_per_step: int = 1) -> dict[str, np.ndarray]:
    """The train step's optimizer argument: each number as an fp32 scalar. Warmup is cut to the
    run's length; the cosine decays over the steps after it, and a constant schedule is a cosine
    whose floor is the learning rate itself. `updates_per_step`: optimizer updates per train step
    (GRPO's grpo.updates_per_batch), which stretch the schedule, counted in updates, so that it
    still spans the run's steps: warmup_steps stays a number of train steps."""
    warmup = min(opt_cfg.warmup_steps, total_steps) * updates_per_step
    total_steps *= updates_per_step
    values = dict(lr=opt_cfg.lr, warmup_steps=warmup, decay_steps=max(total_steps - warmup, 1),
                  min_lr_ratio=1.0 if opt_cfg.schedule == "constant" else opt_cfg.min_lr_ratio,
                  b1=opt_cfg.b1, b2=opt_cfg.b2, eps=opt_cfg.eps, weight_decay=opt_cfg.weight_decay,
                  clip_norm=opt_cfg.clip_norm)
    return {name: np.float32(values[name]) for name in HYPERPARAMETERS}


def learning_rate(step, hp: Mapping) -> jax.Array:
    """The learning rate of optimizer step `step`: linear from 0 to `lr` over `warmup_steps`, then
    a cosine from `lr` down to `lr * min_lr_ratio` over `decay_steps`, flat after that."""
    step = jnp.asarray(step, jnp.float32)
    warmup, decay_steps, floor = hp["warmup_steps"], hp["decay_steps"], hp["min_lr_ratio"]
    rising = hp["lr"] * step / jnp.maximum(warmup, 1.0)
    progress = jnp.clip(step - warmup, 0.0, decay_steps) / decay_steps
    falling = hp["lr"] * ((1.0 - floor) * 0.5 * (1.0 + jnp.cos(jnp.pi * progress)) + floor)
    return jnp.where(step < warmup, rising, falling)


def decay_mask(params):
    """True for every parameter but norm scales. Decided by name, not rank: a scanned stack of
    norm scales is two-dimensional."""
    def decays(path, _):
        names = [k.key for k in path if isinstance(k, jax.tree_util.DictKey)]
        return names[-1] != "scale"
    return jax.tree_util.tree_map_with_path(decays, params)


def clip_by_given_global_norm(max_norm) -> optax.GradientTransformationExtraArgs:
    """`optax.clip_by_global_norm` (the same empty state, so checkpoints are unchanged) with the
    norm given as the `grad_norm` extra argument rather than recomputed. Scaling is one multiply
    by max_norm / norm where optax divides each value: a divide is costly enough that XLA gave it
    a kernel of its own per parameter, whose output the moments' kernels then read; a multiply
    fuses into them. The values differ from optax's in the last bit at most."""

    def update(updates, state, params=None, *, grad_norm, **extra_args):
        del params, extra_args
        keep = grad_norm < max_norm
        factor = max_norm / grad_norm
        return jax.tree.map(lambda t: jax.lax.select(keep, t, t * factor.astype(t.dtype)), updates), state

    return optax.GradientTransformationExtraArgs(optax.init_empty_state, update)


def clips(opt_cfg) -> bool:
    """Whether the optimizer clips: the one setting compiled into the step and its state's layout."""
    return opt_cfg.clip_norm > 0


def build_optimizer(hp: Mapping, clip: bool) -> optax.GradientTransformationExtraArgs:
    """AdamW reading its numbers from `hp` (`hyperparameters(...)`, or inside the train step the
    traced arrays they became), after clipping to `hp["clip_norm"]` when `clip`. tx.update takes
    the gradients' global norm as `grad_norm=`. The state's layout depends on `clip` alone."""
    adamw = optax.adamw(lambda count: learning_rate(count, hp), b1=hp["b1"], b2=hp["b2"], eps=hp["eps"],
                        weight_decay=hp["weight_decay"], mask=decay_mask)
    if clip:
        return optax.chain(clip_by_given_global_norm(hp["clip_norm"]), adamw)
    return optax.with_extra_args_support(adamw)
