"""What a run says about itself: the description printed before the first step, and the row of
scalars logged at each logging step (to the console, metrics.jsonl, TensorBoard and W&B)."""

from __future__ import annotations

import jax
import numpy as np

from maxtext_rocm.numerics import fp8
from maxtext_rocm.reporting import metrics as metrics_lib
from maxtext_rocm.parallel import sharding
from maxtext_rocm.parallel import pipeline


# What a DPO step logs beside its loss (pair means; finetune/dpo.py).
DPO_METRICS = ("dpo_reward_margin", "dpo_accuracy", "dpo_chosen_reward", "dpo_rejected_reward")


def objective_description(cfg) -> str:
    """What the run minimises, for its first line."""
    if cfg.train.objective == "grpo":
        g = cfg.grpo
        reference = ("none (beta 0)" if not g.beta else
                     "the frozen base without its adapters" if cfg.lora.rank else "frozen copy of the starting parameters")
        return (f"objective grpo (group {g.group_size}, epsilon {g.epsilon:g}, beta {g.beta:g}, {g.normalization} "
                f"normalization, {g.updates_per_batch} update(s) per batch; reference: {reference})")
    if cfg.train.objective != "dpo":
        return "objective lm"
    smoothing = f", label_smoothing {cfg.dpo.label_smoothing:g}" if cfg.dpo.label_smoothing else ""
    # Under LoRA the frozen base is the reference, with no copy of it (trainer/launch.py).
    reference = ("the frozen base without its adapters" if cfg.lora.rank
                 else "frozen copy of the starting parameters")
    return f"objective dpo (beta {cfg.dpo.beta:g}{smoothing}; reference: {reference})"


def warmup_warning(cfg) -> str | None:
    """One sentence where the learning rate never reaches optimizer.lr: a warmup as long as the run
    or longer is cut to the run's length (trainer/optimizer.py), so the rate rises to its last step
    and never decays. A warning, not a refusal: short trial runs of a preset made for a long one
    (and the defaults' 100 steps of warmup) are legitimate, and nothing is wrong with the schedule
    but that it is not the one the numbers suggest."""
    warmup, steps, lr = cfg.optimizer.warmup_steps, cfg.train.steps, cfg.optimizer.lr
    if warmup < steps:
        return None
    peak = lr * (steps - 1) / steps  # optimizer step s (0-based) runs at lr * s / warmup while warming up
    decay = ", and the cosine decay never starts" if cfg.optimizer.schedule == "cosine" else ""
    return (f"optimizer.warmup_steps={warmup} is not below train.steps={steps}: the warmup is cut to the run's "
            f"{steps} steps, so the learning rate rises for the whole run to {peak:.3g} at the last step, never "
            f"reaching optimizer.lr={lr:g}{decay}; set optimizer.warmup_steps below {steps} to reach it")


def logged_row(cfg, step_metrics: dict, step_time: float | None, global_batch: int, n_devices: int,
               flops_per_token: float, peak_tflops: float | None, timed_padding: float | None = None,
               timed_row_lengths=None, goodput: float | None = None) -> dict:
    """The logged row for the step just taken, from its fetched metrics and its time per step.

    Speeds are per device over the steps `step_time` timed: `tokens_per_s_per_device` counts every
    position the step computes (a row's positions: train.seq_len, or under buckets the mean of
    `timed_row_lengths`, those steps' row lengths; padding included), and so do the TFLOP/s and MFU
    (what the hardware did: `flops_per_token` is at train.seq_len, and a shorter row's attention
    does less); `real_tokens_per_s_per_device` counts the positions that hold a token (segment id not 0: a
    masked prompt is real, padding is not), from `timed_padding`, the padding fraction of those
    steps' positions (the logged step's own where not given). `goodput`: the run's so far
    (reporting/timeline.py)."""
    tokens_per_s = real_tokens_per_s = tflops = None
    padding = float(step_metrics.get("padding", 0.0))
    lengths = (timed_row_lengths if timed_row_lengths is not None and len(timed_row_lengths)
               else [step_metrics.get("row_length") or cfg.train.seq_len])
    if step_time:
        tokens_per_s = global_batch * float(np.mean(lengths)) / step_time / n_devices
        real_tokens_per_s = tokens_per_s * (1.0 - (padding if timed_padding is None else timed_padding))
        flops_per_token = metrics_lib.flops_per_token_over_rows(cfg.model, flops_per_token, cfg.train.seq_len, lengths)
        tflops = flops_per_token * tokens_per_s / 1e12
    row = {
        "loss": float(step_metrics["loss"]), "lr": float(step_metrics["lr"]),
        "grad_norm": float(step_metrics["grad_norm"]), "step_time_s": step_time,
        "tokens_per_s_per_device": tokens_per_s, "real_tokens_per_s_per_device": real_tokens_per_s,
        "tflops_per_s_per_device": tflops,
        "mfu": metrics_lib.mfu(tflops, peak_tflops) if tflops else None,
        "nonfinite_steps": int(step_metrics["nonfinite_steps"]),
        # Positions of the step's batch that hold no token (segment id 0), global over processes.
        "padding_fraction": padding,
        "goodput": goodput,
    }
    if cfg.train.z_loss_weight:
        row["z_loss"] = float(step_metrics["z_loss"])
    if cfg.train.objective == "dpo":  # "loss" is the DPO loss; its rewards (finetune/dpo.py's metrics)
        row.update({key: float(step_metrics[key]) for key in DPO_METRICS})
    if cfg.train.objective == "grpo":  # "loss" is GRPO's; its samples' rewards, lengths and times
        row.update({key: float(value) for key, value in step_metrics.items() if key.startswith("grpo_")})
    if cfg.model.n_experts > 1:  # router losses, unweighted (a dense model has none)
        row["moe_aux_loss"] = float(step_metrics["moe_aux_loss"])
        row["moe_z_loss"] = float(step_metrics["moe_z_loss"])
    return row


def fp8_description(policy, fp8_scaling: str) -> str:
    if not policy.fp8_format:
        return ""
    e4m3, e5m2 = (jax.numpy.dtype(t).name for t in fp8.FORMATS[policy.fp8_format])
    return f" ({policy.fp8_format}: {e4m3}/{e5m2}, {fp8_scaling} scaling)"


def describe(trainer) -> str:
    """The run's description: model, precision, devices and mesh, batch, FLOPs, output."""
    from maxtext_rocm.models import count_active_params, count_params

    cfg = trainer.cfg
    moe = (f" ({count_active_params(cfg) / 1e6:,.1f}M active; {cfg.model.n_experts} experts, "
           f"top {cfg.model.experts_per_token}, moe_impl {cfg.model.moe_impl})"
           if cfg.model.n_experts > 1 else "")
    peak = (f"{trainer.peak_tflops} TFLOP/s/device" if trainer.peak_tflops
            else "unknown for this device (set log.peak_tflops)")
    accum = f" in {cfg.train.grad_accum} micro-batches" if cfg.train.grad_accum > 1 else ""
    return "\n".join([
        f"run {cfg.name}: {count_params(cfg) / 1e6:,.1f}M parameters{moe}, {cfg.model.n_layers} layers, "
        f"policy {trainer.policy.name}{fp8_description(trainer.policy, cfg.precision.fp8_scaling)}, "
        f"remat {cfg.model.remat}, attention {cfg.model.attention}, {objective_description(cfg)}; "
        f"{pipeline.describe(cfg.pipeline, trainer.mesh.shape['stage'], cfg.model.n_layers)}",
        f"devices: {trainer.n_devices} x {jax.devices()[0].device_kind} ({jax.default_backend()}), "
        f"mesh {sharding.describe(trainer.mesh)}",
        f"batch: {trainer.global_batch} x {cfg.train.seq_len} tokens{accum}; data: {trainer.data.describe()}",
        f"FLOPs: {trainer.flops_per_token / 1e9:.3f} GFLOP/token; {metrics_lib.FLOPS_CONVENTION}",
        f"MFU peak: {peak}",
        f"output: {cfg.output_dir}; compilation cache: {trainer.compilation_cache or 'off'}",
    ])
