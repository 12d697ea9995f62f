#!/usr/bin/env python
"""Step time with data.source='files' against 'synthetic' on one preset, as a ratio from one process.

    python scripts/bench_data.py [configs/tiny_llama.py] [--steps 20] [--rounds 3] [--config.KEY=VALUE ...]

Writes a JSON Lines corpus (Python stdlib source files, one document each) to a temporary
directory, builds a Trainer on each source, and times blocks of `--steps` steps alternately
(synthetic, files, synthetic, files, ...) so that machine drift hits both alike. The ratio is
files / synthetic of the median block; 1.05 is the issue's limit.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import sysconfig
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def write_corpus(path: str, max_bytes: int = 4 << 20) -> int:
    root, used, n = sysconfig.get_paths()["stdlib"], 0, 0
    with open(path, "w") as out:
        for dirpath, dirnames, filenames in sorted(os.walk(root)):
            dirnames[:] = sorted(d for d in dirnames if d not in ("site-packages", "__pycache__"))
            for name in sorted(f for f in filenames if f.endswith(".py")):
                try:
                    text = open(os.path.join(dirpath, name), encoding="utf-8").read()
                except (OSError, UnicodeDecodeError):
                    continue
                out.write(json.dumps({"text": text}) + "\n")
                used, n = used + len(text), n + 1
                if used >= max_bytes:
                    return n
    return n


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("config", nargs="?", default="configs/tiny_llama.py")
    parser.add_argument("--steps", type=int, default=20, help="steps per timed block")
    parser.add_argument("--rounds", type=int, default=3, help="timed blocks per source")
    args, overrides = parser.parse_known_args()
    with tempfile.TemporaryDirectory(prefix="bench_data_") as tmp:  # corpus and run directories
        return measure(args, overrides, tmp)


def measure(args, overrides: list[str], tmp: str) -> int:
    import jax

    import maxtext_rocm as mr

    corpus = os.path.join(tmp, "corpus.jsonl")
    docs = write_corpus(corpus)
    total = 2 + args.rounds * args.steps
    trainers = {}
    for src in ("synthetic", "files"):
        cfg = mr.load_config(args.config, [f"--config.train.steps={total}", "--config.log.tensorboard=false",
                                           "--config.checkpoint.enabled=false", f"--config.data.source={src}",
                                           f"--config.data.paths={corpus}", f"--config.output_dir={tmp}/{src}",
                                           *overrides])
        trainer = mr.Trainer(cfg, log=lambda *_: None)
        for _ in range(2):  # compile, warm up
            jax.block_until_ready(trainer.step())
        trainers[src] = trainer
    times = {src: [] for src in trainers}
    for _ in range(args.rounds):
        for src, trainer in trainers.items():
            start = time.perf_counter()
            for _ in range(args.steps):
                metrics = trainer.step()
            jax.block_until_ready(metrics)
            times[src].append((time.perf_counter() - start) / args.steps)
    med = {src: statistics.median(t) for src, t in times.items()}
    ratio = med["files"] / med["synthetic"]
    print(f"{trainers['files'].data.describe()} ({docs} docs)")
    for src in times:
        print(f"{src:9s} step time: median {med[src] * 1e3:.1f} ms over {args.rounds} blocks of {args.steps} "
              f"({', '.join(f'{t * 1e3:.1f}' for t in times[src])})")
    print(f"files / synthetic step time: {ratio:.3f} ({'within' if ratio <= 1.05 else 'OVER'} the 5% limit)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
