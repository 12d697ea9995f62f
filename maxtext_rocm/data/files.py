"""Local files as training data: the source the trainer reads when data.source="files".

The pipeline, per process:

    documents (data/documents.py: grain.MapDataset over every file, tokenized lazily by .map)
      -> this process's documents in each epoch's order (data/packing.py: DocumentStream)
      -> rows of train.seq_len (RowPacker, data.packing): documents concatenated and cut at row
         ends ("concat"), whole documents best-fit into rows ("best_fit"), or one per row ("none");
         segment ids and per-document positions; padding has segment 0 and weight 0
      -> local batches, built ahead of the trainer by a background thread (FilesSource)

Rows of one example under data.buckets (data.packing="none" records, preference pairs) take
another path: the epoch's global batches are planned from every record's length, each padded to
a bucket (data/bucketed.py), and this process builds its rows of each.

The position in that stream is three integers per process (epoch, document cursor, token offset
in the current document), so `state()` is a small JSON dict that a checkpoint keeps and
`restore()` continues from exactly: a resumed run sees the batches it would have seen.
"""
from __future__ import annotations

import queue
import threading
from pathlib import Path

import numpy as np

from maxtext_rocm.data import resume
from maxtext_rocm.data.bucketed import BucketedRows, row_lengths
from maxtext_rocm.data.buckets import row_buckets
from maxtext_rocm.data.checks import DataError
from maxtext_rocm.data.documents import Documents, expand_paths, tokenized_dataset
from maxtext_rocm.data.packed_pairs import packs_pairs
from maxtext_rocm.data.packing import DocumentStream, RowPacker, packing_mode
from maxtext_rocm.data.synthetic import local_rows
from maxtext_rocm.data.tokenizer import check_vocab, load_tokenizer


DESCRIBE_PACKING = {"concat": "packed to the last token (concat)", "best_fit": "whole documents best-fit into rows",
                    "none": "one document per row"}


def check_inputs(data_cfg, model_vocab_size: int, seq_len: int | None = None) -> None:
    """The checks config validation runs before any device work: files exist, are not empty and
    read as their format says (every JSON line, every text byte), the text field is there, the
    tokenizer fits the model, and some document gives the model a token to predict."""
    spec = data_cfg.get("tokenizer", "byte")
    tokenizer = load_tokenizer(spec)
    check_vocab(tokenizer, model_vocab_size, spec or "byte")
    for key in ("paths", "eval_paths"):
        if data_cfg.get(key):
            files = expand_paths(data_cfg[key], f"data.{key}")
            if data_cfg.get("format", "text") != "text":  # chats, prompt/completion, preference: data/formats.py
                from maxtext_rocm.data.formats import check_format_inputs

                check_format_inputs(files, data_cfg, tokenizer, seq_len, f"data.{key}")
                continue
            docs = Documents(files, data_cfg.text_field)
            _check_yields_tokens(tokenized_dataset(docs, tokenizer, data_cfg.add_bos, data_cfg.add_eos),
                                 files, f"data.{key}")


def _check_yields_tokens(dataset, files: list[Path], key: str) -> None:
    """At least one document has two tokens (one input, one target). Usually the first does, so
    this costs one document's tokenization; a corpus of empty texts costs one pass, once."""
    for index in range(len(dataset)):
        if len(dataset[index]) >= 2:
            return
    names = ", ".join(str(f) for f in files[:3]) + (f" and {len(files) - 3} more" if len(files) > 3 else "")
    raise DataError(f"no document of {key} ({names}) yields the two tokens a training pair needs (empty or "
                    "one-token texts); give longer documents, or set data.add_bos=true / data.add_eos=true "
                    "with a tokenizer that has them")



class FilesSource:
    """batch(step) for step = 0, 1, 2, ... in order, prefetched by a background thread.

    Asking for another step than the next one replays from the start (or the restored state) up to
    it, so any call order is correct, and the usual one is cheap. `state()` describes the position
    after the last batch handed out; `restore(state)` continues from such a position.
    """

    def __init__(self, data_cfg, *, vocab_size: int, global_batch: int, seq_len: int,
                 process_index: int = 0, process_count: int = 1, split: str = "train"):
        if split not in ("train", "eval"):
            raise ValueError(f"split={split!r} is not one of 'train', 'eval'")
        key = "data.paths" if split == "train" else "data.eval_paths"
        spec = data_cfg.get("paths" if split == "train" else "eval_paths", "")
        if not spec:
            raise DataError(f"data.source='files' needs {key}: files or globs of .jsonl, .parquet, .txt "
                            "or .arrayrecord, comma-separated")
        self.split, self.files = split, expand_paths(spec, key)
        self.rows = local_rows(global_batch, process_index, process_count)
        self.local_batch = self.rows.stop - self.rows.start
        spec = data_cfg.get("tokenizer", "byte") or "byte"
        self.tokenizer = load_tokenizer(spec)
        check_vocab(self.tokenizer, vocab_size, spec)
        self.format = data_cfg.get("format", "text")
        if self.format == "text":
            docs = Documents(self.files, data_cfg.get("text_field", "text"))
            self.dataset = tokenized_dataset(docs, self.tokenizer, data_cfg.get("add_bos", True),
                                             data_cfg.get("add_eos", True))
            self._packer = RowPacker
        else:  # chats, prompt/completion, preference pairs
            from maxtext_rocm.data.formats import format_source

            docs, self.dataset, self._packer = format_source(self.files, data_cfg, self.tokenizer, self.local_batch)
        if docs.meta.get("vocab_size", 0) > vocab_size:
            raise DataError(f"{self.files[0]} was tokenized with {docs.meta['vocab_size']} ids but "
                            f"model.vocab_size={vocab_size}; use model.vocab_size >= {docs.meta['vocab_size']}")
        self.num_docs, self.pretokenized = len(docs), docs.pretokenized
        self.packing = packing_mode(data_cfg.get("packing", "concat"))
        self.packs_pairs = packs_pairs(data_cfg)  # preference pairs several to a row (data/packed_pairs.py)
        self.prefetch = max(1, int(data_cfg.get("prefetch", 4)))
        # data.workers >= 2: processes tokenize ahead of the packer (data/workers.py), started with the
        # first batch; pre-tokenized files have nothing to tokenize, and the eval split's few batches
        # (its thread stops after each evaluation) are not worth processes standing by.
        # The workers tokenize text documents only (the other data.formats' records: not yet).
        text = self.format == "text"
        self.workers = 0 if docs.pretokenized or split == "eval" or not text else int(data_cfg.get("workers", 0))
        self._pool, self._pool_args = None, dict(
            files=self.files, versions=docs.versions if text else None, text_field=data_cfg.get("text_field", "text"),
            tokenizer=spec, bos=data_cfg.get("add_bos", True), eos=data_cfg.get("add_eos", True), workers=self.workers)
        self._stream_args = dict(
            dataset=self.dataset, seed=data_cfg.seed, process_index=process_index, process_count=process_count,
            shuffle=split == "train", epochs=data_cfg.get("epochs", 0) if split == "train" else 0,
            blocks=docs.blocks() if text else None)
        self.packing_window = int(data_cfg.get("packing_window", 512))
        self._packer_args = dict(seq_len=seq_len, packing=self.packing, window=self.packing_window,
                                 name=f"{key} ({', '.join(map(str, self.files[:3]))}{' ...' * (len(self.files) > 3)})")
        self.shard, self.shards = process_index, process_count  # this process's group of rows, of how many
        # Rows of one example padded to buckets, not seq_len (data/bucketed.py): the plan's lengths
        # and the global batch it cuts, which a checkpoint's position depends on.
        self.buckets = row_buckets(data_cfg, seq_len)
        self.plan = {"buckets": list(self.buckets), "rows": global_batch} if self.buckets else None
        if self.buckets:
            self._lengths = row_lengths(self.dataset, seq_len, pairs=self.format == "preference")
        self.allow_changed = bool(data_cfg.get("allow_changed", False))
        # Taken as the files are opened (not at the first save): the version the offset index describes.
        self._fingerprint = resume.fingerprint(self.files) if split == "train" else None
        self._start = {"step": 0, "epoch": 0, "cursor": 0, "offset": 0}
        self._state = dict(self._start)
        self._thread = None
        DocumentStream(**self._stream_args)  # checks the document count now

    # -- the producer thread --------------------------------------------------------------------

    def _launch(self, start: dict) -> None:
        self._stop_thread()
        if self.workers > 1 and self._pool is None:
            from maxtext_rocm.data.workers import WorkerPool

            self._pool = WorkerPool(**self._pool_args)
        packer = self._make_packer()
        packer.set_state(start)
        self._queue, self._stop = queue.Queue(self.prefetch), threading.Event()
        self._next = int(start["step"])

        def produce(stop=self._stop, out=self._queue, step=int(start["step"])):
            while not stop.is_set():
                try:
                    item = (packer.batch(self.local_batch), {"step": step + 1, **packer.state()})
                except Exception as error:  # noqa: BLE001 - handed to the consumer, raised there
                    item = error
                while not stop.is_set():
                    try:
                        out.put(item, timeout=0.1)
                        break
                    except queue.Full:
                        continue
                if isinstance(item, Exception):
                    return
                step += 1

        self._thread = threading.Thread(target=produce, name=f"files-{self.split}", daemon=True)
        self._thread.start()

    def _make_packer(self):
        if self.buckets:
            args = self._stream_args
            return BucketedRows(self.dataset, self._lengths, self.buckets, self.plan["rows"], self.rows, args["seed"],
                                args["shuffle"], args["epochs"], self.format == "preference")
        return self._packer(DocumentStream(**self._stream_args, pool=self._pool), **self._packer_args)

    def _stop_thread(self) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._thread = None

    def close(self) -> None:
        self._stop_thread()
        if self._pool is not None:
            self._pool.close()
            self._pool = None

    # -- the interface the trainer uses ---------------------------------------------------------

    def batch(self, step: int) -> dict[str, np.ndarray]:
        if self._thread is None or step < self._next:
            self._launch(self._start if step >= self._start["step"] else
                         {"step": 0, "epoch": 0, "cursor": 0, "offset": 0})
        while True:
            item = self._queue.get()
            if isinstance(item, Exception):
                self._thread = None
                raise item
            batch, self._state = item
            self._next += 1
            if self._next > step:
                return batch

    def state(self) -> dict:
        """The position after the last batch handed out (JSON-able)."""
        return dict(self._state)

    def fingerprint(self) -> list[dict]:
        """The files' names, sizes and content hashes (data/resume.py), computed once."""
        if self._fingerprint is None:
            self._fingerprint = resume.fingerprint(self.files)
        return self._fingerprint

    def position_record(self, step: int) -> dict:
        """What this process adds to a checkpoint of `step` (data/resume.py gathers every process's):
        its group of rows and its position, None where the last batch handed out was not step's."""
        state = self.state()
        position = {k: int(state[k]) for k in resume.POSITION_KEYS} if state.get("step") == step else None
        return {"shard": self.shard, "shards": self.shards, "position": position}

    def restore(self, state: dict) -> None:
        """Continue after the position saved in a checkpoint's data item (resume.saved_state's, or
        an older checkpoint's flat `state()`); the data files must be the ones it was saved over
        (data.allow_changed lets a run go on over changed ones). A state without a usable position
        (another source's, an older multi-process checkpoint's) replays up to its step on the
        first batch."""
        self._stop_thread()
        step = int(state.get("step", 0))
        if "files" in state:
            resume.check_files(state["files"], self.fingerprint(), step, self.allow_changed)
        position = self._planned_position(state, step) if self.buckets else self._own_position(state, step)
        self._start = ({"step": step, **{k: int(position[k]) for k in resume.POSITION_KEYS}} if position is not None
                       else {"step": 0, "epoch": 0, "cursor": 0, "offset": 0})
        self._state = dict(self._start)

    def _own_position(self, state: dict, step: int) -> dict | None:
        """This process's own position in a checkpoint's data item, checked against this run, or None (replay)."""
        position = resume.own_position(state, self.shard, self.shards, self.allow_changed)
        if position is None:
            return None
        position = resume.check_packing(state, position, self.packing, step, self.allow_changed, self.packing_window)
        return resume.check_position(position, self.num_docs, self.shard, self.shards, step, self.allow_changed)

    def _planned_position(self, state: dict, step: int) -> dict | None:
        """Under buckets every process's position is the same (a batch of the epoch's plan), or None (replay)."""
        position = resume.planned_position(state, self.plan, step, self.allow_changed)
        if position is None:
            return None
        batches = self._make_packer().batches_in(position["epoch"])
        return resume.check_planned(position, batches, step, self.allow_changed)

    def describe(self) -> str:
        kind = "pre-tokenized ArrayRecord" if self.pretokenized else f"{type(self.tokenizer).__name__}"
        layout = DESCRIBE_PACKING[self.packing]
        if self.format != "text":
            kind += f", data.format={self.format!r}"
            if self.format == "preference":
                layout = "whole pairs best-fit into rows" if self.packs_pairs else "a pair per two rows"
        if self.buckets:
            layout += f", padded to buckets of {', '.join(map(str, self.buckets))} positions"
        return (f"files: {self.num_docs:,} documents in {len(self.files)} file(s) ({kind}), {layout}, "
                f"{self.split} split")
