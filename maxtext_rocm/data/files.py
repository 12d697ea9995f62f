"""Local files as training data: JSON Lines, Parquet, plain text and pre-tokenized ArrayRecord.

The pipeline, per process:

    documents (grain.MapDataset over every file, tokenized lazily by .map)
      -> this epoch's global order (a permutation drawn from (data.seed, epoch), the same on every process)
      -> this process's share (every process_count-th document, from process_index)
      -> rows of train.seq_len: packed (data.packing) with segment ids and per-document positions,
         or one document per row, truncated and padded; padding has weight 0
      -> local batches, built ahead of the trainer by a background thread

The position in that stream is three integers per process (epoch, document cursor, token offset
in the current document), so `state()` is a small JSON dict that a checkpoint keeps and
`restore()` continues from exactly: a resumed run sees the batches it would have seen.

Formats are told by the file name: `.jsonl`/`.json`/`.ndjson` (the `data.text_field` of each line),
`.parquet` (the `data.text_field` column), `.txt`/`.md`/`.text` (a whole file is one document),
`.arrayrecord`/`.array_record` (one record per document: little-endian int32 token ids, already
with BOS/EOS; written by scripts/pretokenize.py).
"""
from __future__ import annotations

import glob
import json
import queue
import threading
from pathlib import Path

import numpy as np

from maxtext_rocm.data import resume
from maxtext_rocm.data.checks import DataError, check_jsonl, check_text, json_text
from maxtext_rocm.data.synthetic import local_rows
from maxtext_rocm.data.tokenizer import check_vocab, load_tokenizer

JSONL, PARQUET, TEXT, ARRAYRECORD = "jsonl", "parquet", "text", "arrayrecord"
SUFFIXES = {".jsonl": JSONL, ".json": JSONL, ".ndjson": JSONL, ".parquet": PARQUET,
            ".txt": TEXT, ".text": TEXT, ".md": TEXT, ".arrayrecord": ARRAYRECORD, ".array_record": ARRAYRECORD}
META_SUFFIX = ".meta.json"  # beside an ArrayRecord file: the tokenizer it was written with


def file_format(path: Path) -> str:
    kind = SUFFIXES.get(path.suffix.lower())
    if kind is None:
        raise DataError(f"{path} has no known data format; name it .jsonl, .parquet, .txt or .arrayrecord")
    return kind


def expand_paths(spec, key: str = "data.paths") -> list[Path]:
    """The sorted files that comma-separated paths or globs name; a pattern matching nothing is an error."""
    patterns = [p.strip() for p in spec.split(",")] if isinstance(spec, str) else [str(p) for p in spec]
    patterns = [p for p in patterns if p]
    if not patterns:
        raise DataError(f"{key} is empty; give one or more files or globs, comma-separated")
    files = []
    for pattern in patterns:
        matched = sorted(glob.glob(str(Path(pattern).expanduser()), recursive=True))
        matched = [m for m in matched if Path(m).is_file() and not m.endswith(META_SUFFIX)]
        if not matched:
            raise DataError(f"{key}: {pattern!r} matches no file")
        files += [Path(m) for m in matched if Path(m) not in files]
    return files


class Documents:
    """Random access to every document of a list of files: text (str) or token ids (int32 array).

    JSON Lines and text are held as raw bytes and decoded on access; Parquet columns are read
    whole; ArrayRecord files are read lazily through grain's ArrayRecordDataSource.
    """

    def __init__(self, files: list[Path], text_field: str = "text"):
        self.text_field = text_field
        self._parts = []  # (kind, path, items): items a list, or a grain data source
        self.pretokenized = None
        self.meta = {}
        for path in files:
            kind = file_format(path)
            if path.stat().st_size == 0:
                raise DataError(f"{path} is empty; remove it from the data paths or give it documents")
            if (kind == ARRAYRECORD) != bool(self.pretokenized) and self.pretokenized is not None:
                raise DataError(f"{path}: pre-tokenized ArrayRecord files cannot be mixed with text files")
            self.pretokenized = kind == ARRAYRECORD
            self._parts.append((kind, path, self._read(kind, path)))
        self._ends = np.cumsum([len(items) for _, _, items in self._parts])
        if not files or self._ends[-1] == 0:
            raise DataError(f"{files[0] if files else 'data.paths'} holds no documents")

    def _read(self, kind: str, path: Path):
        if kind == JSONL:
            numbered = [(n, line) for n, line in enumerate(path.read_bytes().splitlines(), 1) if line.strip()]
            if not numbered:
                raise DataError(f"{path} is empty (no JSON lines); give it documents")
            check_jsonl(numbered, self.text_field, path)
            return [line for _, line in numbered]
        if kind == TEXT:
            check_text(path)
            return [path]
        if kind == PARQUET:
            import pyarrow as pa
            import pyarrow.parquet as pq

            try:
                schema = pq.read_schema(path)
                if self.text_field not in schema.names:
                    raise DataError(f"{path} has no column {self.text_field!r} (data.text_field); "
                                    f"its columns are: {', '.join(schema.names)}")
                column = pq.read_table(path, columns=[self.text_field]).column(0)
                if not (pa.types.is_string(column.type) or pa.types.is_large_string(column.type)
                        or pa.types.is_null(column.type)):
                    raise DataError(f"{path} column {self.text_field!r} (data.text_field) holds {column.type}, "
                                    "not strings")
                column = column.to_pylist()
            except (pa.ArrowException, OSError) as error:
                first = (str(error).strip().splitlines() or [type(error).__name__])[0][:200]
                raise DataError(f"{path} cannot be read as Parquet ({first}); it may be truncated or "
                                "corrupt: write it again or leave it out of the data paths") from None
            if not column:
                raise DataError(f"{path} has no rows; give it documents")
            return column
        import grain

        meta_path = Path(str(path) + META_SUFFIX)
        if meta_path.is_file():
            self.meta = json.loads(meta_path.read_text())
        try:
            source = grain.sources.ArrayRecordDataSource([str(path)])
        except (RuntimeError, OSError, ValueError) as error:  # array_record's reader: truncated or not one
            raise unreadable_arrayrecord(path, error) from None
        if len(source) == 0:
            raise DataError(f"{path} holds no records; give it documents")
        return source

    def __len__(self) -> int:
        return int(self._ends[-1])

    def __getitem__(self, index: int):
        part = int(np.searchsorted(self._ends, index, side="right"))
        kind, path, items = self._parts[part]
        local = index - (int(self._ends[part - 1]) if part else 0)
        try:
            item = items[local]
        except (RuntimeError, OSError, ValueError) as error:  # an ArrayRecord damaged after its footer was read
            if kind != ARRAYRECORD:
                raise
            raise unreadable_arrayrecord(path, error) from None
        if kind == JSONL:
            return json_text(item, self.text_field, path, local + 1)
        if kind == TEXT:
            return item.read_text(encoding="utf-8")  # checked to be UTF-8 when it was listed
        if kind == PARQUET:
            return item if isinstance(item, str) else ("" if item is None else str(item))
        return np.frombuffer(item, dtype="<i4").astype(np.int32)


def unreadable_arrayrecord(path: Path, error: BaseException) -> DataError:
    first = (str(error).strip().splitlines() or [type(error).__name__])[0][:200]
    return DataError(f"{path} cannot be read as ArrayRecord ({first}); it may be truncated or corrupt: write it "
                     "again with scripts/pretokenize.py or leave it out of the data paths")


def check_inputs(data_cfg, model_vocab_size: int) -> None:
    """The checks config validation runs before any device work: files exist, are not empty and
    read as their format says (every JSON line, every text byte), the text field is there, the
    tokenizer fits the model, and some document gives the model a token to predict."""
    spec = data_cfg.get("tokenizer", "byte")
    tokenizer = load_tokenizer(spec)
    check_vocab(tokenizer, model_vocab_size, spec or "byte")
    for key in ("paths", "eval_paths"):
        if data_cfg.get(key):
            files = expand_paths(data_cfg[key], f"data.{key}")
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


def tokenized_dataset(docs: Documents, tokenizer, bos: bool, eos: bool):
    """grain.MapDataset of int32 token arrays, one per document (tokenized when read)."""
    import grain

    dataset = grain.MapDataset.source(docs)
    if docs.pretokenized:
        return dataset
    bos = bos and tokenizer.bos_id is not None
    eos = eos and tokenizer.eos_id is not None
    return dataset.map(lambda text: np.asarray(tokenizer.encode(text, bos=bos, eos=eos), np.int32))


class RowPacker:
    """Turns this process's documents into rows of seq_len (input, target) pairs, resumably.

    Packing places whole documents one after another and starts a new row when the next one does
    not fit (the rest of the row is padding); a document longer than a row is cut into row-sized
    pieces, each its own segment. Without packing a row holds one document, truncated or padded.
    """

    def __init__(self, dataset, seq_len: int, seed: int, process_index: int, process_count: int,
                 packing: bool = True, shuffle: bool = True, epochs: int = 0, name: str = "the data"):
        self.dataset, self.seq_len, self.seed, self.packing = dataset, seq_len, seed, packing
        self.name = name  # the files, for errors
        self.process_index, self.process_count, self.shuffle, self.epochs = (
            process_index, process_count, shuffle, epochs)
        self.num_docs = len(dataset)
        if self.num_docs < process_count:
            raise DataError(f"the data has {self.num_docs} documents, fewer than the {process_count} "
                            "processes that share it; give more documents")
        self.epoch, self.cursor, self.offset = 0, 0, 0
        self._order_epoch, self._order, self._doc_key, self._doc = None, None, None, None

    def local_order(self, epoch: int) -> np.ndarray:
        """Global document indices this process reads in `epoch`, in order."""
        if self._order_epoch != epoch:
            order = (np.random.default_rng([self.seed, epoch]).permutation(self.num_docs) if self.shuffle
                     else np.arange(self.num_docs))
            self._order_epoch, self._order = epoch, order[self.process_index::self.process_count]
        return self._order

    def state(self) -> dict:
        return {"epoch": self.epoch, "cursor": self.cursor, "offset": self.offset}

    def set_state(self, state: dict) -> None:
        self.epoch, self.cursor, self.offset = int(state["epoch"]), int(state["cursor"]), int(state["offset"])

    def _current(self) -> np.ndarray:
        key = (self.epoch, self.cursor)
        if self._doc_key != key:
            if self.epochs and self.epoch >= self.epochs:
                raise DataError(f"the data ran out after data.epochs={self.epochs} epochs; raise data.epochs "
                                "(0: no limit) or lower train.steps")
            index = int(self.local_order(self.epoch)[self.cursor])
            self._doc_key, self._doc = key, self.dataset[index]
        return self._doc

    def _advance(self) -> None:
        self.cursor, self.offset = self.cursor + 1, 0
        if self.cursor >= len(self.local_order(self.epoch)):
            self.epoch, self.cursor = self.epoch + 1, 0

    def row(self) -> dict[str, np.ndarray]:
        L = self.seq_len
        out = {"inputs": np.zeros(L, np.int32), "targets": np.zeros(L, np.int32),
               "positions": np.zeros(L, np.int32), "segment_ids": np.zeros(L, np.int32)}
        fill, segment, skipped = 0, 0, 0
        while fill < L:
            doc = self._current()
            pairs = len(doc) - self.offset - 1
            if pairs < 1:  # a document of one token (or a spent one) predicts nothing
                skipped += 1
                if skipped > len(self.local_order(self.epoch)):  # a whole pass gave nothing: never will
                    raise DataError(f"none of the {len(self.local_order(self.epoch))} documents of "
                                    f"{self.name} that this process reads yields two tokens (empty or one-token "
                                    "texts); give longer documents or more of them")
                self._advance()
                continue
            skipped = 0
            if fill and pairs > L - fill and (pairs <= L or not self.packing):
                break  # it fits a fresh row whole (or is a new unpacked row): pad this one
            take = min(pairs, L - fill)
            piece = doc[self.offset:self.offset + take + 1]
            segment += 1
            out["inputs"][fill:fill + take] = piece[:-1]
            out["targets"][fill:fill + take] = piece[1:]
            out["positions"][fill:fill + take] = np.arange(take)
            out["segment_ids"][fill:fill + take] = segment
            fill += take
            if self.packing and take < pairs:
                self.offset += take  # the rest of a long document starts the next row
            else:
                self._advance()  # done with it (without packing, whatever did not fit is dropped)
            if not self.packing:
                break
        out["weights"] = (out["segment_ids"] > 0).astype(np.float32)
        return out

    def batch(self, rows: int) -> dict[str, np.ndarray]:
        made = [self.row() for _ in range(rows)]
        return {k: np.stack([r[k] for r in made]) for k in made[0]}


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
        docs = Documents(self.files, data_cfg.get("text_field", "text"))
        spec = data_cfg.get("tokenizer", "byte") or "byte"
        self.tokenizer = load_tokenizer(spec)
        check_vocab(self.tokenizer, vocab_size, spec)
        if docs.meta.get("vocab_size", 0) > vocab_size:
            raise DataError(f"{self.files[0]} was tokenized with {docs.meta['vocab_size']} ids but "
                            f"model.vocab_size={vocab_size}; use model.vocab_size >= {docs.meta['vocab_size']}")
        self.num_docs, self.pretokenized = len(docs), docs.pretokenized
        self.dataset = tokenized_dataset(docs, self.tokenizer, data_cfg.get("add_bos", True),
                                         data_cfg.get("add_eos", True))
        self.packing = data_cfg.get("packing", True)
        self.prefetch = max(1, int(data_cfg.get("prefetch", 4)))
        self._packer_args = dict(
            dataset=self.dataset, seq_len=seq_len, seed=data_cfg.seed, process_index=process_index,
            process_count=process_count, packing=self.packing, shuffle=split == "train",
            epochs=data_cfg.get("epochs", 0) if split == "train" else 0, name=f"{key} ({', '.join(map(str, self.files[:3]))}{' ...' * (len(self.files) > 3)})")
        self.shard, self.shards = process_index, process_count  # this process's group of rows, of how many
        self.allow_changed = bool(data_cfg.get("allow_changed", False))
        # Taken as the files are read (JSON Lines and Parquet are read whole here), not at the first save.
        self._fingerprint = resume.fingerprint(self.files) if split == "train" else None
        self._start = {"step": 0, "epoch": 0, "cursor": 0, "offset": 0}
        self._state = dict(self._start)
        self._thread = None
        RowPacker(**self._packer_args)  # checks the document count now

    # -- the producer thread --------------------------------------------------------------------

    def _launch(self, start: dict) -> None:
        self._stop_thread()
        packer = RowPacker(**self._packer_args)
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

    def _stop_thread(self) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._thread = None

    def close(self) -> None:
        self._stop_thread()

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
        position = resume.own_position(state, self.shard, self.shards, self.allow_changed)
        if position is not None:
            position = resume.check_position(position, self.num_docs, self.shard, self.shards, step,
                                             self.allow_changed)
            self._start = {"step": step, **{k: int(position[k]) for k in resume.POSITION_KEYS}}
        else:
            self._start = {"step": 0, "epoch": 0, "cursor": 0, "offset": 0}
        self._state = dict(self._start)

    def describe(self) -> str:
        kind = "pre-tokenized ArrayRecord" if self.pretokenized else f"{type(self.tokenizer).__name__}"
        return (f"files: {self.num_docs:,} documents in {len(self.files)} file(s) ({kind}), "
                f"{'packed' if self.packing else 'one document per row'}, {self.split} split")
