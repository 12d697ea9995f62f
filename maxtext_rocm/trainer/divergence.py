"""When training diverges: the loss or gradients inf/NaN (train.on_nonfinite), or too many
skipped steps in a row (train.max_skipped_steps). The train step freezes the state at the last
good step (step.train_step); the Trainer saves it and stops with one of these sentences."""

from __future__ import annotations


class TrainingDiverged(RuntimeError):
    """The loss or gradients became inf/NaN under train.on_nonfinite='stop', or for
    train.max_skipped_steps steps in a row under 'skip' (exit status 3)."""


def skip_limit_reached(train_cfg, skipped_in_a_row: int) -> bool:
    return train_cfg.on_nonfinite == "skip" and skipped_in_a_row >= train_cfg.max_skipped_steps


def skipped_too_many(train_cfg, step: int, saved: bool) -> TrainingDiverged:
    limit = train_cfg.max_skipped_steps
    where = f"checkpoint {step} holds the last good state" if saved else "nothing was saved"
    return TrainingDiverged(
        f"the loss or gradients were inf/NaN in {limit} steps in a row (steps {step - limit + 1}-{step}, "
        f"train.max_skipped_steps={limit}); {where} (lower optimizer.lr and resume from an earlier "
        "checkpoint, or raise train.max_skipped_steps to skip on)")


def became_nonfinite(good_step: int, saved: bool) -> TrainingDiverged:
    where = f"checkpoint {good_step} holds the last good state" if saved else "nothing was saved"
    return TrainingDiverged(f"the loss or gradients became inf/NaN after step {good_step}; {where} "
                            "(train.on_nonfinite='skip' would drop such steps and go on)")


def bad_checkpoint(error, newest_good: int | None) -> TrainingDiverged:
    """A save refused because the state holds inf/NaN (checkpoint.NonFiniteState)."""
    where = (f"checkpoint {newest_good} is the newest good one" if newest_good is not None
             else "no checkpoint was written before")
    return TrainingDiverged(f"{error}; {where}")
