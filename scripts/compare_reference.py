#!/usr/bin/env python
"""maxtext_rocm against the reference trainer (MaxText, ../shared/bench/maxtext_cpu.sh) on this
machine: the same model dimensions, precision, remat and layer scan, run in alternation
(A B A B ...) so both see the same machine load, plus this CPU's own matmul rate measured in the
same run.

    python scripts/compare_reference.py [--rounds 2] [--rows dense] [--out runs/compare] [--warm]

Per row and round: tokens/s (the reference: median step after 3 warm-up steps; ours: a block of
steps timed end to end after 2 warm-up steps), launch-to-first-step (both from the moment this
script starts the process to the end of the first training step), peak resident memory (the
process's maxrss), and the FLOP rate that tokens/s means (FLOPs/token of FLOPS_CONVENTION,
identical for both since the model is) as a fraction of the matmul rate. Both launch cold (no
persistent compilation cache). `--warm` also times a restart: each round's cold runs write a
fresh compilation cache (JAX's, which both trainers use), and one more launch per side reads
it. Writes OUT/compare.json and OUT/compare.md; the ratios are per round, the summary takes the
median.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REFERENCE = os.path.join(os.path.dirname(REPO), "shared", "bench", "maxtext_cpu.sh")

# The reference script's defaults, which these rows keep unless a row says otherwise.
DIMS = dict(EMB=256, HEADS=4, KV_HEADS=4, MLP=1024, LAYERS=4, HEAD_DIM=64, VOCAB=32000, SEQ=256, BATCH=4)
OURS_DIMS = [
    "--config.model.d_model=256", "--config.model.n_heads=4", "--config.model.n_kv_heads=4",
    "--config.model.mlp_dim=1024", "--config.model.n_layers=4", "--config.model.head_dim=64",
    "--config.model.vocab_size=32000", "--config.train.seq_len=256", "--config.train.per_device_batch_size=4",
    "--config.model.remat=full", "--config.model.scan_layers=true", "--config.data.source=synthetic",
    "--config.model.tie_embeddings=false",
]
MOE = ["--config.model.family=mixtral", "--config.model.n_experts=8", "--config.model.experts_per_token=2"]
# (row, reference env, our preset, our overrides)
ROWS = [
    ("dense bf16", dict(DTYPE="bfloat16"), "tiny_llama", ["--config.precision.policy=bf16"]),
    ("dense fp32", dict(DTYPE="float32"), "tiny_llama", ["--config.precision.policy=fp32"]),
    ("MoE 8x top-2 bf16, dropless", dict(DTYPE="bfloat16", EXPERTS=8, TOPK=2, MOE_IMPL="ragged"), "tiny_mixtral",
     ["--config.precision.policy=bf16", *MOE, "--config.model.moe_impl=dropless"]),
    ("MoE 8x top-2 fp32, dropless", dict(DTYPE="float32", EXPERTS=8, TOPK=2, MOE_IMPL="ragged"), "tiny_mixtral",
     ["--config.precision.policy=fp32", *MOE, "--config.model.moe_impl=dropless"]),
    ("MoE 8x top-2 bf16, capacity 1.25", dict(DTYPE="bfloat16", EXPERTS=8, TOPK=2, MOE_IMPL="dense", CAPACITY=1.25),
     "tiny_mixtral", ["--config.precision.policy=bf16", *MOE, "--config.model.moe_impl=capacity",
                      "--config.model.moe_capacity_factor=1.25"]),
]

MATMUL_PROBE = r"""
import json, time, jax, jax.numpy as jnp
out = {}
for name, dtype in (("fp32", jnp.float32), ("bf16", jnp.bfloat16)):
    best = 0.0
    for m, k, n in ((1024, 1024, 1024), (2048, 2048, 2048), (1024, 256, 1024)):
        a, b = jnp.ones((m, k), dtype), jnp.ones((k, n), dtype)
        f = jax.jit(lambda a, b: jnp.dot(a, b, preferred_element_type=jnp.float32))
        f(a, b).block_until_ready()
        start = time.perf_counter()
        for _ in range(8):
            r = f(a, b)
        r.block_until_ready()
        best = max(best, 2 * m * k * n * 8 / (time.perf_counter() - start))
    out[name] = best
print(json.dumps(out))
"""


def _run(cmd: list[str], env: dict | None = None) -> tuple[float, int, str, float]:
    """(seconds from launch to exit, exit status, combined output, peak RSS MiB), with the
    child's own maxrss from wait4."""
    start = time.time()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, **(env or {})}, cwd=REPO)
    output = proc.stdout.read()
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    return start, proc.returncode, output, usage.ru_maxrss / 1024


def run_reference(script: str, env: dict, steps: int, cache: str = "") -> dict:
    start, rc, output, _ = _run(["bash", script], {"PYENV_VERSION": "3.12.1", "STEPS": str(steps),
                                                       "JAX_CACHE_DIR": cache,
                                                       **{k: str(v) for k, v in {**DIMS, **env}.items()}})
    line = next((l for l in output.splitlines() if "steps_parsed=" in l), None)
    if rc or line is None:
        return {"error": output.strip().splitlines()[-1] if output.strip() else f"exit {rc}"}
    fields = dict(re.findall(r"(\w+)=([\d.]+)", line))
    step_s = float(fields["step_s_median"])
    return {"tokens_per_s": DIMS["BATCH"] * DIMS["SEQ"] / step_s, "step_s": step_s,
            "launch_to_first_step_s": float(fields["launch_to_step0_logged_s"]),
            "peak_rss_mib": float(fields["peak_rss_MiB"])}


def run_ours(preset: str, overrides: list[str], steps: int, cache: str = "") -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "ours.json")
        start, rc, output, rss = _run([sys.executable, os.path.join(REPO, "scripts", "benchmark.py"),
                                       f"configs/{preset}.py", f"--steps={steps}", "--warmup=2", f"--json={out}",
                                       f"--config.output_dir={tmp}/run", *OURS_DIMS, *overrides,
                                       # benchmark.py launches cold unless given a cache
                                       *([f"--config.train.compilation_cache={cache}"] if cache else [])])
        if rc or not os.path.exists(out):
            return {"error": output.strip().splitlines()[-1] if output.strip() else f"exit {rc}"}
        with open(out) as f:
            result = json.load(f)
    return {"tokens_per_s": result["tokens_per_s"], "step_s": result["step_time_s"],
            "launch_to_first_step_s": result["first_step_done_unix"] - start, "peak_rss_mib": rss,
            "flops_per_token": result["flops_per_token"]}


def matmul_rate() -> dict:
    out = subprocess.run([sys.executable, "-c", MATMUL_PROBE], capture_output=True, text=True, cwd=REPO)
    return json.loads(out.stdout.strip().splitlines()[-1])


def _median(values):
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--rows", help="only rows whose name contains this (case-insensitive)")
    parser.add_argument("--ref-steps", type=int, default=20, help="reference steps (3 warm-up steps dropped)")
    parser.add_argument("--steps", type=int, default=15, help="our timed steps (after the first and 2 warm-up)")
    parser.add_argument("--out", default="runs/compare")
    parser.add_argument("--reference", default=REFERENCE, help="the reference's run script")
    parser.add_argument("--warm", action="store_true",
                        help="also time each side's launch from a compilation cache its cold run filled")
    args = parser.parse_args()
    if not os.path.exists(args.reference):
        print(f"error: the reference script {args.reference} does not exist; give its path with --reference",
              file=sys.stderr)
        return 2

    rows = [r for r in ROWS if not args.rows or args.rows.lower() in r[0].lower()]
    rates = [matmul_rate()]
    results = []
    for name, ref_env, preset, overrides in rows:
        rounds = []
        for i in range(args.rounds):
            with tempfile.TemporaryDirectory() as caches:
                cache = {side: os.path.join(caches, side) if args.warm else "" for side in ("reference", "ours")}
                ref = run_reference(args.reference, ref_env, args.ref_steps, cache["reference"])
                ours = run_ours(preset, overrides, args.steps, cache["ours"])
                if args.warm:
                    ref["warm_launch_to_first_step_s"] = run_reference(
                        args.reference, ref_env, args.ref_steps, cache["reference"]).get("launch_to_first_step_s")
                    ours["warm_launch_to_first_step_s"] = run_ours(
                        preset, overrides, args.steps, cache["ours"]).get("launch_to_first_step_s")
            rounds.append({"reference": ref, "ours": ours})
            print(f"{name} round {i + 1}: reference {ref}\n    ours {ours}", flush=True)
        rates.append(matmul_rate())
        results.append({"row": name, "reference_env": ref_env, "ours_overrides": [*OURS_DIMS, *overrides],
                        "rounds": rounds})
    rate = {k: max(r[k] for r in rates) for k in rates[0]}

    warm = " warm launch ref s | warm launch ours s | ours/ref |" if args.warm else ""
    lines = [f"Matmul rate of this CPU (best of {len(rates)} probes, fp32 accumulate): "
             f"fp32 {rate['fp32'] / 1e9:.0f} GFLOP/s, bf16 {rate['bf16'] / 1e9:.0f} GFLOP/s", "",
             "| row | tokens/s ref | tokens/s ours | ours/ref | launch ref s | launch ours s | ours/ref | "
             f"peak RSS ref MiB | peak RSS ours MiB | ours/ref | matmul-rate fraction ref / ours |{warm}",
             "|---" * (11 + 3 * args.warm) + "|"]
    metrics = ("tokens_per_s", "launch_to_first_step_s", "peak_rss_mib") + (
        ("warm_launch_to_first_step_s",) if args.warm else ())
    for row in results:
        ok = [r for r in row["rounds"] if "error" not in r["reference"] and "error" not in r["ours"]]
        if not ok:
            lines.append(f"| {row['row']} | failed: {row['rounds'][0]} |")
            continue
        peak = rate["fp32" if "fp32" in row["row"] else "bf16"]
        flops = ok[0]["ours"]["flops_per_token"]
        med = {side: {k: _median([r[side].get(k) for r in ok]) for k in metrics} for side in ("reference", "ours")}
        ratio = {k: _median([r["ours"][k] / r["reference"][k] for r in ok if r["ours"].get(k) and r["reference"].get(k)])
                 for k in metrics}
        row["summary"] = {"median": med, "median_ratio_ours_over_reference": ratio,
                          "matmul_fraction": {s: med[s]["tokens_per_s"] * flops / peak for s in med}}
        frac = row["summary"]["matmul_fraction"]
        warm_cells = ""
        if args.warm:
            key = "warm_launch_to_first_step_s"
            cells = [(med["reference"][key], 1), (med["ours"][key], 1), (ratio[key], 2)]
            warm_cells = " " + " | ".join("failed" if v is None else f"{v:.{digits}f}" for v, digits in cells) + " |"
        lines.append(
            f"| {row['row']} | {med['reference']['tokens_per_s']:,.0f} | {med['ours']['tokens_per_s']:,.0f} | "
            f"{ratio['tokens_per_s']:.2f}x | {med['reference']['launch_to_first_step_s']:.1f} | "
            f"{med['ours']['launch_to_first_step_s']:.1f} | {ratio['launch_to_first_step_s']:.2f} | "
            f"{med['reference']['peak_rss_mib']:,.0f} | {med['ours']['peak_rss_mib']:,.0f} | "
            f"{ratio['peak_rss_mib']:.2f} | {100 * frac['reference']:.1f}% / {100 * frac['ours']:.1f}% |"
            + warm_cells)
    lines += ["", f"{args.rounds} rounds per row, alternating reference and ours; medians over rounds, "
              "ratios taken per round. FLOPs/token as maxtext_rocm reports it (no recomputation counted)."
              + (" Warm launch: the same launch from the compilation cache the round's cold run wrote."
                 if args.warm else "")]
    table = "\n".join(lines) + "\n"
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "compare.json"), "w") as f:
        json.dump({"matmul_flops_per_s": rate, "rows": results}, f, indent=2)
    with open(os.path.join(args.out, "compare.md"), "w") as f:
        f.write(table)
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
