"""The optimizer: global-norm clipping, then AdamW under a warmup + cosine (or constant) schedule.

Weight decay applies to kernels and embeddings, never to norm scales. The train step passes the
gradients' global norm, which it computes anyway for its metrics and its inf/NaN check, as
`tx.update(..., grad_norm=...)`: the clipping reads it instead of reducing over every gradient a
second time (XLA cannot share the two reductions, since the update runs inside a `lax.cond`).
"""

from __future__ import annotations

import jax
import optax


def learning_rate_schedule(opt_cfg, total_steps: int) -> optax.Schedule:
    warmup = min(opt_cfg.warmup_steps, total_steps)
    warmup_fn = optax.linear_schedule(0.0, opt_cfg.lr, max(warmup, 1))
    if opt_cfg.schedule == "constant":
        after = optax.constant_schedule(opt_cfg.lr)
    else:
        after = optax.cosine_decay_schedule(
            opt_cfg.lr, max(total_steps - warmup, 1), alpha=opt_cfg.min_lr_ratio)
    return optax.join_schedules([warmup_fn, after], [warmup])


def decay_mask(params):
    """True for every parameter but norm scales. Decided by name, not rank: a scanned stack of
    norm scales is two-dimensional."""
    def decays(path, _):
        names = [k.key for k in path if isinstance(k, jax.tree_util.DictKey)]
        return names[-1] != "scale"
    return jax.tree_util.tree_map_with_path(decays, params)


def clip_by_given_global_norm(max_norm: float) -> optax.GradientTransformationExtraArgs:
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


def build_optimizer(opt_cfg, total_steps: int) -> tuple[optax.GradientTransformationExtraArgs, optax.Schedule]:
    """(tx, schedule); tx.update takes the gradients' global norm as `grad_norm=`."""
    schedule = learning_rate_schedule(opt_cfg, total_steps)
    adamw = optax.adamw(schedule, b1=opt_cfg.b1, b2=opt_cfg.b2, eps=opt_cfg.eps,
                        weight_decay=opt_cfg.weight_decay, mask=decay_mask)
    if opt_cfg.clip_norm > 0:
        return optax.chain(clip_by_given_global_norm(opt_cfg.clip_norm), adamw), schedule
    return optax.with_extra_args_support(adamw), schedule
