#!/usr/bin/env python
"""Benchmarks a preset: tokens/s/device, step time, launch-to-first-step time and peak memory.

    python scripts/benchmark.py configs/tiny_llama.py --steps 30 [--config.KEY=VALUE ...] [--json out.json]
    python scripts/benchmark.py configs/tiny_mixtral.py --config.model.moe_impl=capacity

Steps are timed as a block (one device sync at the end), the way a real run pipelines them; the
first step (compilation) and `--warmup` more are excluded. The last line has the same shape as
../shared/bench/maxtext_cpu.sh's, for side-by-side runs.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time


def seconds_since_launch() -> float | None:
    """Wall time since this process started (Linux), so interpreter start-up and imports count."""
    try:
        with open("/proc/self/stat") as f:
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return uptime - start_ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("config", help="CONFIG.py[:VARIANT] or a preset name")
    parser.add_argument("--steps", type=int, default=30, help="timed steps")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps after the first")
    parser.add_argument("--json", help="also write the results to this file")
    args, overrides = parser.parse_known_args()

    import jax

    import maxtext_rocm as mr
    from maxtext_rocm import metrics as metrics_lib
    from maxtext_rocm.models import count_active_params
    from maxtext_rocm.models.moe import resolve_implementation

    total = 1 + args.warmup + args.steps
    try:
        cfg = mr.load_config(args.config, [f"--config.train.steps={total}", "--config.log.tensorboard=false",
                                           *overrides])
        trainer = mr.Trainer(cfg, log=lambda *_: None)
    except mr.UserError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2

    jax.block_until_ready(trainer.step())
    first_step_s = seconds_since_launch()
    for _ in range(args.warmup):
        trainer.step()
    jax.block_until_ready(trainer.state)
    start = time.perf_counter()
    for _ in range(args.steps):
        last = trainer.step()
    loss = float(jax.device_get(last["loss"]))
    step_s = (time.perf_counter() - start) / args.steps

    tokens_per_step = trainer.global_batch * cfg.train.seq_len
    tokens_per_s_per_device = tokens_per_step / step_s / trainer.n_devices
    tflops = trainer.flops_per_token * tokens_per_s_per_device / 1e12
    result = {
        "config": args.config, "overrides": overrides, "devices": trainer.n_devices,
        "device_kind": jax.devices()[0].device_kind, "policy": cfg.precision.policy,
        "params": mr.count_params(cfg), "active_params": count_active_params(cfg),
        "moe_impl": resolve_implementation(cfg.model.moe_impl) if cfg.model.n_experts > 1 else None,
        "global_batch": trainer.global_batch, "seq_len": cfg.train.seq_len,
        "step_time_s": step_s, "tokens_per_s": tokens_per_step / step_s,
        "tokens_per_s_per_device": tokens_per_s_per_device, "tflops_per_s_per_device": tflops,
        "mfu": metrics_lib.mfu(tflops, trainer.peak_tflops),
        "launch_to_first_step_s": first_step_s, "peak_rss_mib": metrics_lib.peak_rss_mib(),
        "device_peak_mib": metrics_lib.device_peak_memory_mib(jax.devices()[0]), "final_loss": loss,
    }
    for key, value in result.items():
        print(f"{key:>26}: {value:,.4g}" if isinstance(value, float) else f"{key:>26}: {value}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    print(f"maxtext_rocm tokens_per_s={result['tokens_per_s']:.1f} step_s={step_s:.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
