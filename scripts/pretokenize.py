#!/usr/bin/env python
"""Tokenizes a corpus once into an ArrayRecord file that data.source='files' reads without re-tokenizing.

    python scripts/pretokenize.py 'corpus/*.jsonl' --out data/train.arrayrecord [--tokenizer PATH]
        [--text-field text] [--no-bos] [--no-eos]

Inputs are what data.paths accepts (JSON Lines, Parquet, plain text; comma-separated or several
arguments, globs quoted). Each document becomes one record of little-endian int32 ids, BOS/EOS
included; `OUT.meta.json` beside it records the tokenizer and its vocabulary size, which training
checks against model.vocab_size. Then train with --config.data.paths=data/train.arrayrecord.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("paths", nargs="+", help="files or globs (as data.paths)")
    parser.add_argument("--out", required=True, help="the .arrayrecord file to write")
    parser.add_argument("--tokenizer", default="byte", help="as data.tokenizer (default: byte)")
    parser.add_argument("--text-field", default="text", help="as data.text_field (default: text)")
    parser.add_argument("--no-bos", action="store_true", help="do not start documents with BOS")
    parser.add_argument("--no-eos", action="store_true", help="do not end documents with EOS")
    args = parser.parse_args()

    from maxtext_rocm.config import UserError
    from maxtext_rocm.data.documents import META_SUFFIX, Documents, expand_paths, tokenized_dataset
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
        dataset = tokenized_dataset(docs, tokenizer, bos=not args.no_bos, eos=not args.no_eos)
        from array_record.python.array_record_module import ArrayRecordWriter

        tmp = args.out + ".tmp"
        writer = ArrayRecordWriter(tmp, "group_size:1")
        tokens = 0
        for i in range(len(dataset)):
            ids = dataset[i]
            writer.write(ids.astype("<i4").tobytes())
            tokens += len(ids)
        writer.close()
        os.replace(tmp, args.out)
    except (UserError, OSError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    meta = {"tokenizer": args.tokenizer, "vocab_size": int(tokenizer.vocab_size), "documents": len(dataset),
            "tokens": tokens, "bos": not args.no_bos, "eos": not args.no_eos}
    with open(args.out + META_SUFFIX, "w") as f:
        json.dump(meta, f, indent=1)
    print(f"wrote {args.out}: {len(dataset):,} documents, {tokens:,} tokens in "
          f"{time.perf_counter() - started:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
