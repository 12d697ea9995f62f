#!/usr/bin/env python
"""Tokenizes a corpus once into an ArrayRecord file that data.source='files' reads without re-tokenizing.

    python scripts/pretokenize.py 'corpus/*.jsonl' --out data/train.arrayrecord [--tokenizer PATH]
        [--text-field text] [--no-bos] [--no-eos] [--workers N]

Inputs are what data.paths accepts (JSON Lines, Parquet, plain text; comma-separated or several
arguments, globs quoted). Each document becomes one record of little-endian int32 ids, BOS/EOS
included; `OUT.meta.json` beside it records the tokenizer and its vocabulary size, which training
checks against model.vocab_size. Then train with --config.data.paths=data/train.arrayrecord.

Tokenizing uses every core (--workers, default: the CPUs this process may run on): worker
processes (maxtext_rocm/data/workers.py) tokenize chunks of documents and hand them back in order,
so the output is byte for byte the one of --workers 1.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("paths", nargs="+", help="files or globs (as data.paths)")
    parser.add_argument("--out", required=True, help="the .arrayrecord file to write")
    parser.add_argument("--tokenizer", default="byte", help="as data.tokenizer (default: byte)")
    parser.add_argument("--text-field", default="text", help="as data.text_field (default: text)")
    parser.add_argument("--no-bos", action="store_true", help="do not start documents with BOS")
    parser.add_argument("--no-eos", action="store_true", help="do not end documents with EOS")
    parser.add_argument("--workers", type=int, default=len(os.sched_getaffinity(0)),
                        help="tokenizing processes (default: every CPU; 1: this process alone)")
    args = parser.parse_args()

    from maxtext_rocm.config import UserError
    from maxtext_rocm.data.documents import META_SUFFIX, Documents, expand_paths
    from maxtext_rocm.data.tokenizer import load_tokenizer

    if not args.out.endswith((".arrayrecord", ".array_record")):
        print(f"error: --out {args.out!r} must end in .arrayrecord", file=sys.stderr)
        return 2
    started = time.perf_counter()
    try:
        docs = Documents(expand_paths(",".join(args.paths), "paths"), args.text_field)
        if docs.pretokenized:
            raise UserError("the inputs are already pre-tokenized ArrayRecord files")
        tokenizer = load_tokenizer(args.tokenizer)
        from array_record.python.array_record_module import ArrayRecordWriter

        tmp = args.out + ".tmp"
        writer = ArrayRecordWriter(tmp, "group_size:1")
        tokens = 0
        for ids in tokenized(docs, tokenizer, args):
            writer.write(ids.astype("<i4").tobytes())
            tokens += len(ids)
        writer.close()
        os.replace(tmp, args.out)
    except (UserError, OSError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    meta = {"tokenizer": args.tokenizer, "vocab_size": int(tokenizer.vocab_size), "documents": len(docs),
            "tokens": tokens, "bos": not args.no_bos, "eos": not args.no_eos}
    with open(args.out + META_SUFFIX, "w") as f:
        json.dump(meta, f, indent=1)
    seconds, cpu = time.perf_counter() - started, os.times()
    print(f"wrote {args.out}: {len(docs):,} documents, {tokens:,} tokens in {seconds:.1f} s "
          f"({tokens / seconds / 1e6:.2f}M tokens/s; CPU seconds: {cpu.user + cpu.system:.1f} this process, "
          f"{cpu.children_user + cpu.children_system:.1f} {max(1, args.workers) * (args.workers > 1)} workers)")
    return 0


def tokenized(docs, tokenizer, args):
    """Every document's token ids, in file order: from worker processes, CHUNK documents at a time
    with DEPTH chunks per worker in flight, or from this process."""
    from maxtext_rocm.data.documents import encoder

    encode = encoder(tokenizer, bos=not args.no_bos, eos=not args.no_eos)
    if args.workers <= 1:
        for i in range(len(docs)):
            yield encode(docs[i])
        return
    from maxtext_rocm.data.workers import WorkerPool

    pool = WorkerPool(docs.files, docs.versions, text_field=docs.text_field, tokenizer=args.tokenizer,
                      bos=not args.no_bos, eos=not args.no_eos, workers=args.workers)
    try:
        handed = 0
        while handed < len(docs) or pool.in_flight:
            while handed < len(docs) and pool.in_flight < DEPTH * pool.size:
                pool.tokenize(np.arange(handed, min(handed + CHUNK, len(docs))))
                handed += CHUNK
            for example in pool.result():
                yield example.tokens
    finally:
        pool.close()


CHUNK, DEPTH = 64, 4  # documents per chunk, chunks in flight per worker


if __name__ == "__main__":
    sys.exit(main())
