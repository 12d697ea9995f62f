"""Global batches of one-example rows, each padded to a bucket's length (data/buckets.py), not to
train.seq_len: SFT records under data.packing='none' and DPO's preference pairs.

Every record's row length is known at start-up (the start-up check tokenized every record, and
data/kept.py hands the examples over), so an epoch's batches are planned before they are read,
as a pure function of (data.seed, epoch) and the lengths (`plan_epoch`):

1. each record goes to the shortest bucket that holds its row (a pair: its longer row);
2. the records of each bucket are shuffled by (seed, epoch);
3. each bucket, shortest first, is cut into global batches; what is left over (fewer than a
   batch) joins the next longer bucket's records, padded a little more, rather than becoming a
   short batch of its own; the few left over from the longest bucket make the epoch's one partial
   batch, completed with empty rows (segment 0, weight 0: the token mean of SFT and DPO's pair
   mean leave them out, finetune/dpo.py), so no record is dropped or repeated and no batch spans
   two epochs;
4. the batches' order is shuffled by (seed, epoch).

A batch's rows are as long as the bucket of its longest row. Every process plans the same epoch
from the same lengths, so all agree on every step's bucket without a word; each reads only its
own rows of a batch. The position is (epoch, batch index in the epoch): the same on every process,
saved in checkpoints and restored exactly (data/files.py).

An evaluation split is not shuffled and must read the same records whatever the buckets, so its
batches take the records in file order, each padded to the bucket of its longest row.
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np

from maxtext_rocm.data.buckets import bucket_of
from maxtext_rocm.data.checks import DataError
from maxtext_rocm.data.example import as_example
from maxtext_rocm.data.preference import truncate_pair

EMPTY = -1  # a record index that stands for an empty row (or pair) completing the last batch
_ORDER_STREAM = 0x62756B74  # folded into (seed, epoch): the bucketed order, apart from any other draw


class PlannedBatch(NamedTuple):
    """One global batch: its row length and its records (EMPTY for an empty row or pair)."""

    length: int
    records: np.ndarray  # int64 [examples per batch]


def row_lengths(dataset, seq_len: int, pairs: bool) -> np.ndarray:
    """Each record's row length: its positions (tokens - 1) up to seq_len; a preference pair's
    longer row after truncate_pair (both rows of a pair share one length)."""
    lengths = np.empty(len(dataset), np.int64)
    for index in range(len(dataset)):
        item = dataset[index]
        if pairs:
            lengths[index] = max(len(e.tokens) - 1 for e in truncate_pair(*item, seq_len))
        else:
            lengths[index] = min(len(as_example(item).tokens) - 1, seq_len)
    return np.maximum(lengths, 1)


def plan_epoch(lengths: np.ndarray, buckets: tuple[int, ...], per_batch: int, seed: int, epoch: int,
               shuffle: bool = True) -> list[PlannedBatch]:
    """The global batches of `epoch` (see the module's doc), `per_batch` records each."""
    lengths = np.asarray(lengths, np.int64)
    seq_len = buckets[-1]
    if not shuffle:
        return [_batch(lengths, np.arange(start, min(start + per_batch, len(lengths))), per_batch, buckets, seq_len)
                for start in range(0, len(lengths), per_batch)]
    rng = np.random.default_rng([seed, epoch, _ORDER_STREAM])
    bucket_index = np.searchsorted(np.asarray(buckets), lengths)  # the first bucket >= each length
    batches, carried = [], np.zeros(0, np.int64)
    for b in range(len(buckets)):
        members = np.concatenate([carried, rng.permutation(np.flatnonzero(bucket_index == b))])
        whole = len(members) // per_batch * per_batch
        batches += [_batch(lengths, members[i:i + per_batch], per_batch, buckets, seq_len)
                    for i in range(0, whole, per_batch)]
        carried = members[whole:]
    if len(carried):
        batches.append(_batch(lengths, carried, per_batch, buckets, seq_len))
    return [batches[i] for i in rng.permutation(len(batches))]


def _batch(lengths, records, per_batch: int, buckets, seq_len: int) -> PlannedBatch:
    records = np.concatenate([records, np.full(per_batch - len(records), EMPTY, np.int64)]).astype(np.int64)
    return PlannedBatch(bucket_of(int(lengths[records[records != EMPTY]].max()), seq_len, buckets), records)


def _row(example, length: int) -> dict[str, np.ndarray]:
    """One example in a row of `length` positions, then padding (as data/packing.py and
    data/preference.py lay out a row of seq_len: segment 1 on its tokens, weights on its trained
    targets); an example longer than the row is cut at its end."""
    n = min(len(example.tokens) - 1, length)
    row = {"inputs": np.zeros(length, np.int32), "targets": np.zeros(length, np.int32),
           "positions": np.zeros(length, np.int32), "segment_ids": np.zeros(length, np.int32),
           "weights": np.zeros(length, np.float32)}
    row["inputs"][:n] = example.tokens[:n]
    row["targets"][:n] = example.tokens[1:n + 1]
    row["positions"][:n] = np.arange(n)
    row["segment_ids"][:n] = 1
    row["weights"][:n] = 1.0 if example.trained is None else example.trained[1:n + 1]
    return row


def _empty(length: int) -> dict[str, np.ndarray]:
    return {k: np.zeros(length, np.float32 if k == "weights" else np.int32)
            for k in ("inputs", "targets", "positions", "segment_ids", "weights")}


class BucketedRows:
    """The RowPacker's interface (state, set_state, batch) over planned global batches: this
    process's rows of batch `cursor` of `epoch`, then the next. `rows`: this process's block of
    the global batch's rows; `pairs`: each record is a preference pair (two rows)."""

    def __init__(self, dataset, lengths: np.ndarray, buckets: tuple[int, ...], global_rows: int, rows: slice,
                 seed: int, shuffle: bool, epochs: int, pairs: bool):
        self.dataset, self.lengths, self.buckets = dataset, lengths, buckets
        self.per_row = 2 if pairs else 1
        self.per_batch, self.pairs = global_rows // self.per_row, pairs
        self.records = slice(rows.start // self.per_row, rows.stop // self.per_row)  # this process's records
        self.seed, self.shuffle, self.epochs = seed, shuffle, epochs
        self.epoch, self.cursor = 0, 0
        self._plans: dict[int, list[PlannedBatch]] = {}

    def plan(self, epoch: int) -> list[PlannedBatch]:
        if epoch not in self._plans:
            self._plans = {epoch: plan_epoch(self.lengths, self.buckets, self.per_batch, self.seed, epoch,
                                             self.shuffle)}
        return self._plans[epoch]

    def state(self) -> dict:
        return {"epoch": self.epoch, "cursor": self.cursor, "offset": 0}

    def set_state(self, state: dict) -> None:
        self.epoch, self.cursor = int(state["epoch"]), int(state["cursor"])

    def batch(self, rows: int) -> dict[str, np.ndarray]:
        """This process's `rows` rows of the next planned batch (which rows: fixed at construction)."""
        if self.epochs and self.epoch >= self.epochs:
            raise DataError(f"the data ran out after data.epochs={self.epochs} epochs; raise data.epochs "
                            "(0: no limit) or lower train.steps")
        planned = self.plan(self.epoch)[self.cursor]
        made = []
        for record in planned.records[self.records]:
            if record == EMPTY:
                made += [_empty(planned.length)] * self.per_row
            elif self.pairs:  # chosen, rejected: cut as rows of seq_len cut them, then laid out in the bucket
                made += [_row(e, planned.length) for e in truncate_pair(*self.dataset[int(record)], self.seq_len)]
            else:
                made.append(_row(as_example(self.dataset[int(record)]), planned.length))
        if len(made) != rows:
            raise ValueError(f"{len(made)} rows planned for this process, {rows} asked for")
        self.cursor += 1
        if self.cursor >= len(self.plan(self.epoch)):
            self.epoch, self.cursor = self.epoch + 1, 0
        return {k: np.stack([r[k] for r in made]) for k in made[0]}

    @property
    def seq_len(self) -> int:
        return self.buckets[-1]

    def batches_in(self, epoch: int) -> int:
        return len(self.plan(epoch))
