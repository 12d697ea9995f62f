#!/usr/bin/env python
"""Step time with data.source='files' against 'synthetic' on one preset, as a ratio from one process;
or the files pipeline alone: with --packing, tokens/s and padding of each packing mode; with
--loader, its tokens/s with data.workers and its peak RSS.

    python scripts/bench_data.py [configs/tiny_llama.py] [--steps 20] [--rounds 3] [--config.KEY=VALUE ...]
    python scripts/bench_data.py --packing all --corpus=/tmp/mixed.jsonl [--corpus-mb 40] [--batches 40]
    python scripts/bench_data.py --write-corpus CORPUS.jsonl --megabytes 200 [--write-bpe TOKENIZER.json]
    python scripts/bench_data.py --loader CORPUS.jsonl [--workers 2] [--tokenizer TOKENIZER.json]

--write-corpus writes documents of 100 to 20,000 characters cut from the Python standard
library's source (`.jsonl`, or `.parquet` in row groups of 2,000); --write-bpe trains a 32k BPE
(Hugging Face `tokenizers`) on the same text. --loader builds the files source as the trainer does
(8 x 8192 rows unless --rows/--seq-len say otherwise), reads --steps batches after the first and
prints tokens/s (every position of a batch, padding included, and the trained ones), the seconds
to open the corpus (the JSON Lines index pass on a first open), and the peak RSS of this process
and of its largest worker.

Without those flags: writes a JSON Lines corpus (Python stdlib source files, one document each) to a
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


def stdlib_text(max_bytes: int) -> str:
    root, parts, used = sysconfig.get_paths()["stdlib"], [], 0
    for dirpath, dirnames, filenames in sorted(os.walk(root)):
        dirnames[:] = sorted(d for d in dirnames if d not in ("site-packages", "__pycache__"))
        for name in sorted(f for f in filenames if f.endswith(".py")):
            try:
                parts.append(open(os.path.join(dirpath, name), encoding="utf-8").read())
            except (OSError, UnicodeDecodeError):
                continue
            used += len(parts[-1])
            if used >= max_bytes:
                return "\n".join(parts)
    return "\n".join(parts)


def write_big_corpus(path: str, megabytes: float, bpe: str | None) -> int:
    import numpy as np

    base = stdlib_text(16 << 20)
    rng = np.random.default_rng(0)
    written, count = 0, 0
    rows = []

    def documents():
        nonlocal written, count
        while written < megabytes * 1e6:
            n = int(rng.integers(100, 20_000))
            start = int(rng.integers(0, len(base) - n))
            count += 1
            yield base[start:start + n]

    if path.endswith(".parquet"):
        import pyarrow as pa
        import pyarrow.parquet as pq

        with pq.ParquetWriter(path, pa.schema([("text", pa.string())])) as writer:
            for doc in documents():
                rows.append(doc)
                written += len(doc.encode())
                if len(rows) == 2000:
                    writer.write_table(pa.table({"text": rows}), row_group_size=2000)
                    rows = []
            if rows:
                writer.write_table(pa.table({"text": rows}), row_group_size=2000)
    else:
        with open(path, "w") as out:
            for doc in documents():
                line = json.dumps({"text": doc}) + "\n"
                out.write(line)
                written += len(line)
    print(f"wrote {path}: {count:,} documents, {os.path.getsize(path) / 1e6:.0f} MB")
    if bpe:
        from tokenizers import Tokenizer, models, pre_tokenizers, trainers

        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        trainer = trainers.BpeTrainer(vocab_size=32_000, special_tokens=["<pad>", "<s>", "</s>"],
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
        tok.train_from_iterator([base[i:i + 4096] for i in range(0, len(base), 4096)], trainer)
        tok.save(bpe)
        print(f"wrote {bpe}: {tok.get_vocab_size():,} ids")
    return 0


def cpu_seconds(pid: int) -> float:
    """A worker's user + system CPU time so far (/proc/PID/stat fields 14 and 15)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def vm_hwm_mib(pid: int) -> float:
    """A worker's peak RSS since its exec (getrusage's children figure counts the forked parent's image)."""
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM")) / 1024


def time_loader(args) -> int:
    import resource

    from maxtext_rocm import config as config_lib
    from maxtext_rocm.data import build_source

    cfg = config_lib.defaults().data
    cfg.update(source="files", paths=args.loader, workers=args.workers, tokenizer=args.tokenizer)
    started = time.perf_counter()
    source = build_source(cfg, vocab_size=1 << 20, global_batch=args.rows, seq_len=args.seq_len)
    opened = time.perf_counter() - started
    source.batch(0)  # starts the thread (and the workers)
    workers = [p.pid for p in source._pool._procs] if source._pool else []
    cpu_before = time.process_time(), sum(cpu_seconds(pid) for pid in workers)
    started, trained = time.perf_counter(), 0.0
    for step in range(1, args.steps + 1):
        trained += float(source.batch(step)["weights"].sum())
    seconds = time.perf_counter() - started
    cpu = time.process_time() - cpu_before[0], sum(cpu_seconds(pid) for pid in workers) - cpu_before[1]
    workers_peak = max([vm_hwm_mib(pid) for pid in workers] or [0])
    source.close()
    positions = args.steps * args.rows * args.seq_len
    print(f"{source.describe()}; data.workers={args.workers}, {len(os.sched_getaffinity(0))} CPUs")
    print(f"opened in {opened:.1f} s; {args.steps} batches of {args.rows} x {args.seq_len} in {seconds:.2f} s: "
          f"{positions / seconds / 1e6:.3f}M tokens/s ({trained / seconds / 1e6:.3f}M trained)")
    # CPU seconds, not only wall time: on a shared machine (a share per session) the wall time of N
    # workers need not scale, but where the tokenizing CPU goes shows what N cores would give.
    print(f"CPU seconds per 1M positions: {cpu[0] / positions * 1e6:.2f} this process (thread and packer), "
          f"{cpu[1] / positions * 1e6:.2f} its workers")
    print(f"peak RSS: {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MiB this process, "
          f"{workers_peak:.0f} MiB its largest worker")
    return 0


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
    parser.add_argument("--batch", type=int, default=8, help="rows per batch (one process; --packing)")
    parser.add_argument("--seq-len", type=int, default=8192, help="row length (--packing, --loader)")
    parser.add_argument("--bpe-vocab", type=int, default=0,
                        help="tokenize with a byte-level BPE of this many ids trained on the corpus (0: bytes)")
    parser.add_argument("--write-corpus", help="write a corpus here (.jsonl or .parquet) and exit")
    parser.add_argument("--megabytes", type=float, default=200, help="its size (--write-corpus)")
    parser.add_argument("--write-bpe", help="also train a BPE tokenizer.json here (--write-corpus)")
    parser.add_argument("--loader", help="time the files source alone on this corpus")
    parser.add_argument("--workers", type=int, default=0, help="data.workers (--loader)")
    parser.add_argument("--tokenizer", default="byte", help="data.tokenizer (--loader)")
    parser.add_argument("--rows", type=int, default=8, help="global batch rows (--loader)")
    args, overrides = parser.parse_known_args()
    if args.write_corpus:
        return write_big_corpus(args.write_corpus, args.megabytes, args.write_bpe)
    if args.loader:
        return time_loader(args)
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
