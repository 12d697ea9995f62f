#!/usr/bin/env python
"""Benchmarks a preset: tokens/s/device, step time, launch-to-first-step time and peak memory.

    python scripts/benchmark.py configs/tiny_llama.py --steps 30 [--config.KEY=VALUE ...] [--json out.json]
    python scripts/benchmark.py configs/tiny_mixtral.py --config.model.moe_impl=capacity
    python scripts/benchmark.py --suite seed [--out DIR]   # the published MI355X comparison's rows
    python scripts/benchmark.py --suite one_gpu [--out DIR] # the 8B-shaped seed rows, 8 layers, one GPU
    python scripts/benchmark.py --suite cpu [--out DIR]    # the tiny presets on this CPU

A suite runs each row in its own process (this script's single-config mode) and writes
DIR/results.json plus DIR/results.md, a table of tokens/s/GPU, TFLOP/s/GPU and MFU. The seed
suite needs a node of 8 GPUs; without one, each row is AOT-checked for mi355x:8 by
`python -m maxtext_rocm.compile` (memory fit, per-device batch, remat) and skipped with the reason.
The one_gpu suite runs the seed's 8B-shaped rows with 8 of their 32 layers, so that parameters,
AdamW state and activations fit one GPU of 80 GB or more; without a GPU they are skipped with the
reason. Attention is the presets' "auto": cuDNN's fused kernel on CUDA, the blockwise one on ROCm
(and in the seed rows' AOT check for AMD GPUs).

Steps are timed as a block (one device sync at the end), the way a real run pipelines them; the
first step (compilation) and `--warmup` more are excluded. Launch is measured cold: the persistent
compilation cache is off unless an override turns it on (`--config.train.compilation_cache=auto`
times a restart that finds its programs compiled). The last line has the same shape as
../shared/bench/maxtext_cpu.sh's, for side-by-side runs.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ONE_GPU_ROW = ["--config.model.n_layers=8", "--config.model.remat=none"]
# (row name, CONFIG[:VARIANT], extra overrides). The seed rows: one node of 8 GPUs, each row's
# per-device batch and remat chosen by the fit check (the preset's batch, with the least
# recomputation that fits it; the largest batch that fits otherwise).
SUITES = {
    "seed": [
        ("Llama3 8B fp8", "llama3_8b:fp8", []),
        ("Llama3 8B bf16", "llama3_8b:bf16", []),
        ("Llama3 70B fp8", "llama3_70b:fp8", []),
        ("Llama3 70B bf16", "llama3_70b:bf16", []),
        ("Llama3.1 8B fp8", "llama3_1_8b:fp8", []),
        ("Llama3.1 70B fp8", "llama3_1_70b:fp8", []),
        ("Mixtral 8x7B bf16", "mixtral_8x7b:bf16", []),
    ],
    # 8 of 32 layers: 2.8B parameters, ~67 GiB per GPU at batch 2 x 8192 without remat (the fit
    # check's analytic estimate for h200:1); per token the work is still an 8B layer's.
    "one_gpu": [
        ("Llama3 8B-shaped bf16, 8 layers", "llama3_8b:bf16", ONE_GPU_ROW),
        ("Llama3 8B-shaped fp8, 8 layers", "llama3_8b:fp8", ONE_GPU_ROW),
        ("Llama3.1 8B-shaped fp8, 8 layers", "llama3_1_8b:fp8", ONE_GPU_ROW),
        ("Llama3 8B-shaped bf16, 8 layers, batch 4", "llama3_8b:bf16",
         [*ONE_GPU_ROW, "--config.train.per_device_batch_size=4"]),
    ],
    "cpu": [
        ("tiny_llama", "tiny_llama", []),
        ("tiny_mixtral", "tiny_mixtral", []),
    ],
}
SEED_TARGET = "mi355x:8"
GPU_BACKENDS = ("gpu", "cuda", "rocm")


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


def _probe_devices() -> dict:
    """The backend, device count and kind, asked in a child process (so this one never holds a GPU)."""
    code = ("import jax, json; d = jax.devices(); "
            "print(json.dumps({'backend': jax.default_backend(), 'count': len(d), 'kind': d[0].device_kind, "
            "'platform_version': d[0].client.platform_version}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    try:
        return json.loads(out.stdout.strip().splitlines()[-1])
    except (IndexError, ValueError):
        return {"backend": "unknown", "count": 0, "kind": "unknown"}


def _fit_check(spec: str, overrides: list[str], target: str) -> dict:
    """The AOT fit check of one row (python -m maxtext_rocm.compile ... --search)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "fit.json")
        proc = subprocess.run([sys.executable, "-m", "maxtext_rocm.compile", spec, f"--target={target}",
                               "--search", "--max-compiles=1", f"--json={out}", *overrides],
                              capture_output=True, text=True, cwd=REPO, timeout=1800)
        if proc.returncode or not os.path.exists(out):
            return {"error": (proc.stderr.strip().splitlines() or ["compile failed"])[-1]}
        with open(out) as f:
            report = json.load(f)
    search = report.get("search") or {}
    remat = search.get("remat_for_configured_batch")
    batch = report["per_device_batch_size"]
    if remat is None and search.get("largest_batch"):
        remat, batch = search["largest_batch_remat"], search["largest_batch"]
    report["chosen"] = {"remat": remat, "per_device_batch_size": batch} if remat else None
    for confirmed in search.get("confirmed", []):  # the chosen setting's own estimate, when compiled
        if report["chosen"] and (confirmed["remat"], confirmed["per_device_batch_size"]) == (remat, batch):
            report["chosen"].update(analytic_total_bytes=confirmed["analytic_total_bytes"],
                                    xla_total_bytes=confirmed["xla_total_bytes"])
    return report


def _markdown(rows: list[dict], suite: str, devices: dict) -> str:
    def num(value, fmt):
        return "-" if value is None else format(value, fmt)

    lines = [f"## Benchmark suite `{suite}` ({devices['count']} x {devices['kind']}, {devices['backend']})", "",
             "| row | config | status | devices | batch/device | remat | tokens/s/GPU | TFLOP/s/GPU | MFU | note |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        mfu = None if r.get("mfu") is None else 100 * r["mfu"]
        lines.append(
            f"| {r['row']} | `{r['config']}` | {r['status']} | {r.get('devices') or '-'} | "
            f"{r.get('per_device_batch_size') or '-'} | {r.get('remat') or '-'} | "
            f"{num(r.get('tokens_per_s_per_device'), ',.0f')} | {num(r.get('tflops_per_s_per_device'), '.2f')} | "
            f"{num(mfu, '.1f')}{'%' if mfu is not None else ''} | {r.get('note', '')} |")
    return "\n".join(lines) + "\n"


def run_row(spec: str, run_dir: str, steps: int, warmup: int, overrides: list[str], timeout: float) -> dict:
    """One row in its own process (this script's single-config mode); its output goes to RUN_DIR.log."""
    os.makedirs(os.path.dirname(run_dir), exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "row.json")
        # A fresh run directory and no checkpoints: a benchmark must never resume one.
        command = [sys.executable, os.path.abspath(__file__), spec, f"--steps={steps}", f"--warmup={warmup}",
                   f"--json={out}", f"--config.output_dir={run_dir}", "--config.checkpoint.enabled=false", *overrides]
        with open(f"{run_dir}.log", "w") as log:
            try:
                proc = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, cwd=REPO, timeout=timeout)
            except subprocess.TimeoutExpired:
                return {"status": "failed", "note": f"no result within {timeout:.0f} s (--row-timeout)"}
        if proc.returncode or not os.path.exists(out):
            with open(f"{run_dir}.log") as log:
                return {"status": "failed", "note": ([*log.read().strip().splitlines(), "?"])[-1][:200]}
        with open(out) as f:
            result = json.load(f)
    row = {k: result[k] for k in (
        "devices", "device_kind", "policy", "global_batch", "seq_len", "step_time_s", "tokens_per_s_per_device",
        "tflops_per_s_per_device", "mfu", "launch_to_first_step_s", "peak_rss_mib", "device_peak_mib",
        "final_loss", "attention", "library_calls", "xla_flags", "glibc_tunables")}
    row.update(status="ran", per_device_batch_size=result["global_batch"] // result["devices"],
               remat=result.get("remat"))
    return row


def write_results(rows: list[dict], suite: str, devices: dict, out_dir: str) -> str:
    """OUT_DIR/results.json and results.md; returns the markdown table."""
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "results.json"), "w") as f:
        json.dump({"suite": suite, "devices": devices, "rows": rows}, f, indent=2)
    table = _markdown(rows, suite, devices)
    with open(os.path.join(out_dir, "results.md"), "w") as f:
        f.write(table)
    return table


def run_suite(suite: str, out_dir: str, steps: int, warmup: int, extra: list[str], only: str | None = None,
              row_timeout: float = 3600) -> int:
    devices = _probe_devices()
    on_gpus = devices["backend"] in GPU_BACKENDS and devices["count"] >= 8
    rows = []
    for name, spec, overrides in SUITES[suite]:
        if only and only.lower() not in name.lower():
            continue
        overrides = [*overrides, *extra]
        row = {"row": name, "config": spec, "overrides": overrides, "status": "skipped", "note": ""}

        def skip(note):
            row["note"] = note
            rows.append(row)
            print(f"{name}: {note}", flush=True)

        if suite == "seed":
            fit = _fit_check(spec, overrides, SEED_TARGET)
            if "error" in fit:
                skip(f"fit check failed: {fit['error']}")
                continue
            row["fit"] = {k: fit.get(k) for k in ("target", "analytic_total_bytes", "xla_total_bytes",
                                                   "target_memory_bytes", "fits", "compile_s", "search")}
            if not fit["chosen"]:
                skip(f"does not fit {SEED_TARGET} under any remat policy or batch")
                continue
            chosen = dict(fit["chosen"])
            total_gib = chosen.pop("analytic_total_bytes", fit["analytic_total_bytes"]) / 2 ** 30
            row["fit"]["chosen_xla_total_bytes"] = chosen.pop("xla_total_bytes", None)
            row.update(chosen, devices=8)
            overrides = [*overrides, f"--config.model.remat={row['remat']}",
                         f"--config.train.per_device_batch_size={row['per_device_batch_size']}"]
            if not on_gpus:
                skip(f"skipped: no 8-GPU node here ({devices['count']} x {devices['kind']}); "
                     f"AOT check for {SEED_TARGET}: fits at batch {row['per_device_batch_size']}, "
                     f"remat {row['remat']} (~{total_gib:.0f} GiB/GPU analytic; as configured: "
                     f"{'fits' if fit['fits'] else 'does not fit'})")
                continue
        if suite == "one_gpu":
            if devices["backend"] not in GPU_BACKENDS:
                skip(f"skipped: needs a GPU ({devices['count']} x {devices['kind']} here)")
                continue
        run_dir = os.path.abspath(os.path.join(out_dir, "".join(ch if ch.isalnum() else "_" for ch in name)))
        row.update(run_row(spec, run_dir, steps, warmup, overrides, row_timeout))
        rows.append(row)
        print(f"{name}: {row['status']} {row.get('tokens_per_s_per_device') or ''} {row['note']}", flush=True)
        write_results(rows, suite, devices, out_dir)  # after every row, so a killed suite keeps its rows
    table = write_results(rows, suite, devices, out_dir)
    print(table)
    print(f"wrote {out_dir}/results.json and {out_dir}/results.md")
    return 1 if any(r["status"] == "failed" for r in rows) else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("config", nargs="?", help="CONFIG.py[:VARIANT] or a preset name")
    parser.add_argument("--suite", choices=sorted(SUITES), help="run a suite of rows instead of one config")
    parser.add_argument("--rows", help="only the suite's rows whose name contains this (case-insensitive)")
    parser.add_argument("--out", help="the suite's output folder (default runs/benchmark/SUITE)")
    parser.add_argument("--steps", type=int, default=30, help="timed steps")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps after the first")
    parser.add_argument("--row-timeout", type=float, default=3600,
                        help="seconds a suite's row may take before it is stopped and marked failed")
    parser.add_argument("--json", help="also write the results to this file")
    parser.add_argument("--checkpoint-every", type=int, default=0,
                        help="save an (async) checkpoint every N timed steps, waiting for the last one "
                             "inside the timing; 0 (default) writes none")
    args, overrides = parser.parse_known_args()
    if args.suite:
        return run_suite(args.suite, args.out or f"runs/benchmark/{args.suite}", args.steps, args.warmup,
                         overrides, args.rows, args.row_timeout)
    if not args.config:
        parser.error("give a CONFIG or --suite")

    import jax

    import maxtext_rocm as mr
    from maxtext_rocm.trainer import compilation
    from maxtext_rocm.reporting import metrics as metrics_lib
    from maxtext_rocm.models import count_active_params

    total = 1 + args.warmup + args.steps
    try:
        checkpoints = ["--config.checkpoint.enabled=false"]
        if args.checkpoint_every:  # into a fresh directory, so nothing resumes or collides
            checkpoints = [f"--config.checkpoint.every={args.checkpoint_every}", "--config.checkpoint.resume=never",
                           f"--config.output_dir={tempfile.mkdtemp(prefix='benchmark_checkpoints_')}"]
        cfg = mr.load_config(args.config, [f"--config.train.steps={total}", "--config.log.tensorboard=false",
                                           "--config.train.compilation_cache=off", *overrides, *checkpoints])
        trainer = mr.Trainer(cfg, log=lambda *_: None)
    except mr.UserError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2

    jax.block_until_ready(trainer.step())
    first_step_s, first_step_unix = seconds_since_launch(), time.time()
    for _ in range(args.warmup):
        trainer.step()
    jax.block_until_ready(trainer.state)
    start = time.perf_counter()
    for _ in range(args.steps):
        last = trainer.step()
        if args.checkpoint_every and trainer.step_count % args.checkpoint_every == 0:
            trainer.save_checkpoint()
    loss = float(jax.device_get(last["loss"]))
    if args.checkpoint_every:
        trainer.checkpointer.wait()
    step_s = (time.perf_counter() - start) / args.steps
    if args.checkpoint_every:
        shutil.rmtree(cfg.output_dir, ignore_errors=True)

    calls = compilation.library_calls(trainer.compiled_step.as_text())
    tokens_per_step = trainer.global_batch * cfg.train.seq_len
    tokens_per_s_per_device = tokens_per_step / step_s / trainer.n_devices
    tflops = trainer.flops_per_token * tokens_per_s_per_device / 1e12
    result = {
        "config": args.config, "overrides": overrides, "devices": trainer.n_devices,
        "device_kind": jax.devices()[0].device_kind, "policy": cfg.precision.policy,
        "params": mr.count_params(cfg), "active_params": count_active_params(trainer.cfg),
        "moe_impl": trainer.cfg.model.moe_impl if cfg.model.n_experts > 1 else None,
        "global_batch": trainer.global_batch, "seq_len": cfg.train.seq_len, "remat": cfg.model.remat,
        "step_time_s": step_s, "tokens_per_s": tokens_per_step / step_s,
        "tokens_per_s_per_device": tokens_per_s_per_device, "tflops_per_s_per_device": tflops,
        "mfu": metrics_lib.mfu(tflops, trainer.peak_tflops),
        "launch_to_first_step_s": first_step_s, "first_step_done_unix": first_step_unix,
        "flops_per_token": trainer.flops_per_token, "peak_rss_mib": metrics_lib.peak_rss_mib(),
        "device_peak_mib": metrics_lib.device_peak_memory_mib(jax.devices()[0]), "final_loss": loss,
        "attention": cfg.model.attention, "xla_flags": os.environ.get("XLA_FLAGS", ""), "library_calls": calls,
        # The host allocator's settings move CPU step times by up to ~17% (README, "Speed against
        # the reference"), so a figure carries them.
        "glibc_tunables": os.environ.get("GLIBC_TUNABLES", ""),
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
