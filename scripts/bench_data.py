#!/usr/bin/env python
"""Step time with data.source='files' against 'synthetic' on one preset, as a ratio from one process;
or, with --packing, the files pipeline alone: tokens/s and padding of each packing mode.

    python scripts/bench_data.py [configs/tiny_llama.py] [--steps 20] [--rounds 3] [--config.KEY=VALUE ...]
    python scripts/bench_data.py --packing all --corpus=/tmp/mixed.jsonl [--corpus-mb 40] [--batches 40]

Without --packing: writes a JSON Lines corpus (Python stdlib source files, one document each) to a
temporary directory, builds a Trainer on each source, and times blocks of `--steps` steps
alternately (synthetic, files, synthetic, files, ...) so that machine drift hits both alike. The
ratio is files / synthetic of the median block; 1.05 is the issue's limit.

With --packing (concat, best_fit, none or all): builds the source as the trainer does
(`data.build_source`, --batch x --seq-len rows) over --corpus, writing it first if it does not
exist (--corpus-mb of documents of 100-20,000 characters, log-uniform lengths, made-up words), and
reads --batches batches after the first: tokens/s (positions holding a token) and the padding
fraction (segment id 0), per mode. `--config.data.KEY=VALUE` overrides pass on (a tokenizer file,
data.packing_window).
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
    parser.add_argument("--packing", choices=["concat", "best_fit", "none", "all"],
                        help="time the files pipeline alone in this data.packing mode (all: each)")
    parser.add_argument("--corpus", default="/tmp/bench_data_mixed.jsonl", help="JSON Lines; written if missing")
    parser.add_argument("--corpus-mb", type=float, default=40, help="size of a written corpus")
    parser.add_argument("--batches", type=int, default=40, help="timed batches per mode")
    parser.add_argument("--batch", type=int, default=8, help="rows per batch (one process)")
    parser.add_argument("--seq-len", type=int, default=8192)
    parser.add_argument("--bpe-vocab", type=int, default=0,
                        help="tokenize with a byte-level BPE of this many ids trained on the corpus (0: bytes)")
    args, overrides = parser.parse_known_args()
    if args.packing:
        return measure_packing(args, overrides)
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


def write_mixed_corpus(path: str, megabytes: float, seed: int = 0) -> int:
    """Documents of 100-20,000 characters (log-uniform: many short, most characters in long ones)
    of made-up words, until `megabytes`; returns the document count."""
    import numpy as np

    rng = np.random.default_rng(seed)
    letters = np.array(list("abcdefghijklmnopqrstuvwxyz"))
    words = ["".join(rng.choice(letters, int(k))) for k in rng.integers(1, 11, 20_000)]
    budget, n = int(megabytes * 2**20), 0
    with open(path, "w") as out:
        while budget > 0:
            chars = int(np.exp(rng.uniform(np.log(100), np.log(20_000))))
            text = " ".join(words[i] for i in rng.integers(0, len(words), chars // 5 + 1))[:chars]
            line = json.dumps({"text": text}) + "\n"
            out.write(line)
            budget, n = budget - len(line), n + 1
    return n


def bpe_overrides(corpus: str, vocab: int) -> list[str]:
    """A byte-level BPE tokenizer.json of `vocab` ids trained on the corpus's first 16 MiB (kept
    beside the corpus for the next run), as config overrides."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    path = f"{corpus}.bpe{vocab}.json"
    if not os.path.exists(path):
        def texts(budget=16 << 20):
            with open(corpus) as f:
                for line in f:
                    budget -= len(line)
                    if budget < 0:
                        return
                    yield json.loads(line)["text"]

        tokenizer = Tokenizer(models.BPE())
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tokenizer.decoder = decoders.ByteLevel()
        tokenizer.train_from_iterator(texts(), trainers.BpeTrainer(
            vocab_size=vocab, special_tokens=["<pad>", "<s>", "</s>"],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
        tokenizer.save(path)
    return [f"--config.data.tokenizer={path}", f"--config.model.vocab_size={vocab}"]


def measure_packing(args, overrides: list[str]) -> int:
    import numpy as np

    import maxtext_rocm as mr
    from maxtext_rocm.data import build_source

    if not os.path.exists(args.corpus):
        docs = write_mixed_corpus(args.corpus, args.corpus_mb)
        print(f"wrote {args.corpus}: {docs:,} documents, {os.path.getsize(args.corpus) / 2**20:.1f} MiB")
    if args.bpe_vocab:
        overrides = [*bpe_overrides(args.corpus, args.bpe_vocab), *overrides]
    for mode in (["concat", "best_fit", "none"] if args.packing == "all" else [args.packing]):
        cfg = mr.load_config(args.config, ["--config.data.source=files", f"--config.data.paths={args.corpus}",
                                           f"--config.data.packing={mode}", f"--config.train.seq_len={args.seq_len}",
                                           *overrides])
        source = build_source(cfg.data, vocab_size=cfg.model.vocab_size, global_batch=args.batch,
                              seq_len=cfg.train.seq_len)
        source.batch(0)  # the thread's start and the first batch: not timed
        start, cpu, tokens, padding = time.perf_counter(), time.process_time(), 0, 0
        for step in range(1, args.batches + 1):
            empty = int(np.count_nonzero(source.batch(step)["segment_ids"] == 0))
            tokens, padding = tokens + args.batch * args.seq_len - empty, padding + empty
        seconds, cpu = time.perf_counter() - start, time.process_time() - cpu  # cpu: every thread's
        source.close()
        print(f"data.packing={mode:8s} {tokens / seconds / 1e6:6.3f}M tokens/s ({tokens / cpu / 1e6:.3f}M per CPU "
              f"second), padding {padding / (tokens + padding):6.2%} ({args.batches} batches of {args.batch} x "
              f"{args.seq_len} in {seconds:.1f} s; {source.describe()})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
