#!/usr/bin/env python
"""DPO's two row layouts side by side: preference pairs packed into rows (data.packing=best_fit)
against one sequence per row padded to buckets (data.packing=none, data.buckets=auto).

    python scripts/dpo_packing_speed.py [--pairs 2000] [--steps 40] [--rounds 2] [--out DIR]

Writes `--pairs` synthetic byte-tokenized pairs of varied lengths (prompt 20-120 characters, each
response 10-130: a pair's two sequences fit a row of 512 together), then trains tiny_llama with
train.objective=dpo, train.seq_len=512, on one CPU device, each layout in its own process, the
layouts interleaved for `--rounds` rounds. Both see about the same positions a step: 8 rows of a
bucket (4 pairs) against 4 packed rows of 512. A shared persistent compilation cache is filled by
one run of each first, so the timed rounds do not compile. From each run's metrics.jsonl
(log.every=1; the first 3 steps left out): the padding fraction and the real (non-padding) tokens a
second, summed over the timed steps. Prints a table and the faster layout.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
LAYOUTS = {"packed (best_fit)": ["--config.data.packing=best_fit", "--config.train.per_device_batch_size=4"],
           "bucketed (none, auto)": ["--config.data.packing=none", "--config.data.buckets=auto",
                                     "--config.train.per_device_batch_size=8"]}
SKIPPED = 3  # the first steps (start-up, the cache's loads) are not timed


def write_pairs(path: Path, count: int, seed: int = 0) -> None:
    rng = np.random.default_rng(seed)
    words = "the a preference model answer question good bad helpful wrong right short long".split()

    def text(n):
        return " ".join(rng.choice(words, size=n))[:n]

    with open(path, "w") as f:
        for i in range(count):
            f.write(json.dumps({"prompt": f"{i}: " + text(int(rng.integers(20, 120))),
                                "chosen": text(int(rng.integers(10, 130))),
                                "rejected": text(int(rng.integers(10, 130)))}) + "\n")


def run(layout: str, data: Path, out: Path, steps: int, cache: Path) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-m", "maxtext_rocm.train", str(REPO / "configs" / "tiny_llama.py"),
               "--config.train.objective=dpo", "--config.data.source=files", "--config.data.format=preference",
               f"--config.data.paths={data}", "--config.train.seq_len=512", f"--config.train.steps={steps}",
               "--config.log.every=1", "--config.checkpoint.every=0", f"--config.output_dir={out}",
               f"--config.train.compilation_cache={cache}", "--config.precision.policy=fp32", *LAYOUTS[layout]]
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="", PYTHONPATH=str(REPO))
    subprocess.run(command, check=True, env=env, stdout=subprocess.DEVNULL)
    rows = [json.loads(line) for line in open(out / "metrics.jsonl")]
    rows = [r for r in rows if "step_time_s" in r and r.get("step", 0) > SKIPPED]
    times = np.array([r["step_time_s"] for r in rows])
    real = np.array([r["real_tokens_per_s_per_device"] for r in rows]) * times
    return {"padding": float(np.mean([r["padding_fraction"] for r in rows])), "real_tokens": float(real.sum()),
            "seconds": float(times.sum()), "steps": len(rows)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=2000)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    out = Path(args.out or tempfile.mkdtemp(prefix="dpo_packing_"))
    out.mkdir(parents=True, exist_ok=True)
    data = out / "pairs.jsonl"
    write_pairs(data, args.pairs)
    cache = out / "compilation_cache"
    for layout in LAYOUTS:  # fills the compilation cache: every bucket's program, the packed one
        run(layout, data, out / f"warm-{layout.split()[0]}", args.steps, cache)
    totals = {layout: [] for layout in LAYOUTS}
    for round_ in range(args.rounds):
        for layout in LAYOUTS:
            totals[layout].append(run(layout, data, out / f"round{round_}-{layout.split()[0]}", args.steps, cache))
    print("| layout | padding fraction | real tokens/s | per round |")
    print("|---|---|---|---|")
    speed = {}
    for layout, results in totals.items():
        speed[layout] = sum(r["real_tokens"] for r in results) / sum(r["seconds"] for r in results)
        rounds = ", ".join(f"{r['real_tokens'] / r['seconds']:.0f}" for r in results)
        print(f"| {layout} | {np.mean([r['padding'] for r in results]):.3f} | {speed[layout]:.0f} | {rounds} |")
    best = max(speed, key=speed.get)
    print(f"faster: {best}, {speed[best] / min(speed.values()):.2f}x")


if __name__ == "__main__":
    main()
