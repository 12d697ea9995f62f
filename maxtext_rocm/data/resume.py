"""What a checkpoint keeps of the files source, and how a resumed run finds its place again.

A checkpoint's data item (checkpoint.py's DATA, written by process 0) holds every data-loading
process's position, gathered before the save, and a fingerprint of the data files:

    {"step": 12, "shards": 2, "positions": [{"epoch": 0, "cursor": 22, "offset": 14},
                                            {"epoch": 0, "cursor": 33, "offset": 54}],
     "files": [{"file": "corpus/a.jsonl", "size": 123456, "hash": "9f0c...", "sha256": "e3b0..."}, ...],
     "packing": "concat"}

A source whose batches are planned over buckets (data/bucketed.py) adds "plan": {"buckets": [...],
"rows": global batch}, and its positions are all the same: (epoch, batch index, 0).

`shards` counts the groups of processes that load distinct batch rows (sharding.batch_rows_of_process:
usually the process count; pipeline stages across hosts load the same rows); `positions[i]` is
group i's (epoch, document cursor, token offset; under data.packing="best_fit" the offset counts
rows of the window that starts at the cursor). On resume each process takes its own group's.

Older checkpoints hold one flat position ({"step", "epoch", "cursor", "offset"}), process 0's:
restored as it is in a one-process run; a run of several processes replays its stream up to the
step instead (exact for an unchanged layout, at the cost of reading those steps' data once).
"""
from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import numpy as np

from maxtext_rocm.data import filehash
from maxtext_rocm.data.checks import DataError

ENDS_BYTES = 64 * 1024  # "hash": of the size and this much from each end, as checkpoints before "sha256" kept
POSITION_KEYS = ("epoch", "cursor", "offset")
ALLOW = "set data.allow_changed=true"


def fingerprint(files: list[Path]) -> list[dict]:
    """Each file's name, size, the SHA-256 of its every byte ("sha256": an edit anywhere shows, a
    same-size one in the middle too) and, for checkpoints written before that, the older hash of
    its size and first and last 64 KiB ("hash"). Not the modification time, which a plain copy
    changes. The SHA-256 comes from the pass that indexed or read the file already, or from a
    sidecar of an earlier launch (data/filehash.py says where, and what it costs: 2.5-4 minutes of
    one core per 100 GB, once per version of a JSON Lines corpus)."""
    out = []
    for path in files:
        size = path.stat().st_size
        digest = hashlib.blake2b(str(size).encode(), digest_size=16)
        with open(path, "rb") as f:
            digest.update(f.read(ENDS_BYTES))
            if size > ENDS_BYTES:
                f.seek(max(ENDS_BYTES, size - ENDS_BYTES))
                digest.update(f.read())
        out.append({"file": str(path), "size": size, "hash": digest.hexdigest(), "sha256": filehash.file_sha256(path)})
    return out


def _same(then: dict, now: dict) -> bool:
    """Same content: by the SHA-256 where both fingerprints have one, else (a checkpoint from before
    it) by the size and ends hash."""
    kind = "sha256" if "sha256" in then and "sha256" in now else "hash"
    return (then["size"], then[kind]) == (now["size"], now[kind])


def first_difference(saved: list[dict], now: list[dict]) -> str | None:
    """How the data files differ from the ones a checkpoint was saved over (content, in order; a
    file that moved or was renamed with the same content is the same data), or None."""
    for then, current in zip(saved, now):
        if _same(then, current):
            continue
        if then["file"] != current["file"]:
            return f"the data files differ from {current['file']} on (the checkpoint's data had {then['file']} there)"
        if current["size"] > then["size"]:
            return f"{current['file']} grew from {then['size']:,} to {current['size']:,} bytes"
        if current["size"] < then["size"]:
            return f"{current['file']} shrank from {then['size']:,} to {current['size']:,} bytes"
        return f"{current['file']} was changed (same size, other content)"
    if len(now) > len(saved):
        return f"the data paths now also name {now[len(saved)]['file']} ({len(now)} files, the checkpoint's data had {len(saved)})"
    if len(now) < len(saved):
        return (f"{saved[len(now)]['file']} is no longer among the data paths ({len(now)} files, the checkpoint's "
                f"data had {len(saved)})")
    return None


def check_files(saved: list[dict] | None, now: list[dict], step: int, allow_changed: bool) -> None:
    """DataError if the data changed since checkpoint `step` (unless allowed: then a warning)."""
    difference = None if saved is None else first_difference(saved, now)
    if difference is None:
        return
    if allow_changed:
        warn(f"{difference} since checkpoint step {step} was saved; data.allow_changed=true: the run "
             "continues at the saved data position over the changed data")
        return
    raise DataError(f"{difference} since checkpoint step {step} was saved, so resuming at its data position "
                    f"would skip or repeat documents; restore the data as it was, or {ALLOW} to continue "
                    "at the saved position over the changed data")


def own_position(saved: dict, shard: int, shards: int, allow_changed: bool) -> dict | None:
    """This data-loading group's position in checkpoint data item `saved`, or None: replay the
    stream up to the saved step."""
    step = int(saved.get("step", 0))
    if "positions" in saved:
        positions = saved["positions"]
        if int(saved["shards"]) == shards:
            return dict(positions[shard])
        epochs = {int(p["epoch"]) for p in positions}
        if len(epochs) == 1 and all(int(p["cursor"]) == 0 and int(p["offset"]) == 0 for p in positions):
            return {"epoch": epochs.pop(), "cursor": 0, "offset": 0}  # an epoch boundary: any count starts it
        if allow_changed:
            warn(f"checkpoint step {step} was saved by {saved['shards']} data-loading processes mid-epoch and this "
                 f"run has {shards}; data.allow_changed=true: this layout's data is replayed up to step {step}")
            return None
        raise DataError(
            f"checkpoint step {step} holds the data positions of {saved['shards']} data-loading processes in the "
            f"middle of epoch {min(epochs)}, and this run loads data with {shards}: each process reads its "
            "own share of an epoch, so the position cannot move to another count before the epoch ends; resume "
            f"with {saved['shards']} data-loading processes (the checkpoint's mesh.dcn layout), or {ALLOW} to "
            f"replay this layout's data up to step {step} (documents of the epoch may then repeat or be skipped)")
    if all(k in saved for k in POSITION_KEYS) and shards == 1:
        return {k: int(saved[k]) for k in POSITION_KEYS}  # an older checkpoint of one process
    return None  # no position, or an older multi-process one (process 0's only): replay


def check_position(position: dict, documents: int, shard: int, shards: int, step: int,
                   allow_changed: bool) -> dict:
    """`position` if this process's share of `documents` still holds its document; else a DataError
    (the data shrank), or under data.allow_changed the start of the next epoch."""
    share = len(range(shard, documents, shards))
    if int(position["cursor"]) < share:
        return position
    if allow_changed:
        return {"epoch": int(position["epoch"]) + 1, "cursor": 0, "offset": 0}
    raise DataError(f"the data position of checkpoint step {step} (document {int(position['cursor']) + 1} of "
                    f"epoch {int(position['epoch'])} for this process) lies past the {share} documents this "
                    f"process reads now: the data files shrank since it was saved; restore them, or {ALLOW} "
                    "to go on from the next epoch")


def planned_position(saved: dict, plan: dict, step: int, allow_changed: bool) -> dict | None:
    """The position in checkpoint data item `saved` of a source whose batches are planned over
    buckets (data/bucketed.py: every process holds the same one, so any number of processes can
    continue it), or None: replay up to the saved step (an item without positions). Mid-epoch the
    saved plan (its buckets and global batch) must be this run's, or the batch index would point
    at other records: a DataError, or under data.allow_changed the start of the next epoch."""
    if "positions" not in saved:
        return None  # no position (or an older checkpoint's flat one, of no plan): replay
    position = {k: int(saved["positions"][0][k]) for k in POSITION_KEYS}
    was = saved.get("plan")
    if was == plan or position["cursor"] == 0 and position["offset"] == 0:
        return {**position, "offset": 0}
    if allow_changed:
        warn(f"checkpoint step {step} was saved with other batches ({_plan_words(was)}) than this run's "
             f"({_plan_words(plan)}); data.allow_changed=true: the data continues from the next epoch")
        return {"epoch": position["epoch"] + 1, "cursor": 0, "offset": 0}
    raise DataError(f"checkpoint step {step} was saved in the middle of epoch {position['epoch']} with "
                    f"{_plan_words(was)}, and this run has {_plan_words(plan)}, which cut the epoch into other "
                    f"batches; resume with the checkpoint's data.buckets and global batch, or {ALLOW} to go on "
                    "from the next epoch")


def _plan_words(plan: dict | None) -> str:
    if not plan:
        return "rows of train.seq_len (no data.buckets)"
    return f"data.buckets={','.join(map(str, plan['buckets']))} and a global batch of {plan['rows']} rows"


def check_planned(position: dict, batches: int, step: int, allow_changed: bool) -> dict:
    """`position` if its epoch still has its batch; else the data shrank: a DataError, or under
    data.allow_changed the start of the next epoch."""
    if position["cursor"] < batches:
        return position
    if allow_changed:
        return {"epoch": position["epoch"] + 1, "cursor": 0, "offset": 0}
    raise DataError(f"the data position of checkpoint step {step} (batch {position['cursor'] + 1} of epoch "
                    f"{position['epoch']}) lies past the {batches} batches an epoch has now: the data files shrank "
                    f"since it was saved; restore them, or {ALLOW} to go on from the next epoch")


def packing_label(packing: str, window: int | None) -> str:
    """data.packing as a position depends on it: best_fit's rows of a window change with its size."""
    return f"{packing!r} (data.packing_window={window})" if packing == "best_fit" and window else repr(packing)


def check_packing(saved: dict, position: dict, packing: str, step: int, allow_changed: bool,
                  window: int | None = None) -> dict:
    """`position` if it means the same under this run's data.packing (and best_fit's window) as under
    the checkpoint's; else a DataError, or under data.allow_changed the start of its document (or
    window). A position at a document's start means the same in every mode; mid-document, concat
    (and the whole-document packer of checkpoints without a "packing" key) count tokens, best_fit
    counts rows of a window, which another window size plans differently."""
    was = packing_label(saved.get("packing", "concat"), saved.get("packing_window", window))
    packing = packing_label(packing, window)
    if was == packing or int(position["offset"]) == 0:
        return position
    if allow_changed:
        warn(f"checkpoint step {step} was saved with data.packing={was} and this run has {packing}; "
             "data.allow_changed=true: the data continues from the start of the saved document (or window)")
        return {**position, "offset": 0}
    raise DataError(f"checkpoint step {step} was saved with data.packing={was} in the middle of a document "
                    f"(or window), and this run has data.packing={packing}, which cannot continue from there; "
                    f"resume with data.packing={was}, or {ALLOW} to go on from the start of that document "
                    "(its start repeats)")


def gather(local: dict, size: int = 2048) -> list[dict]:
    """Every process's JSON-able `local`, in process order: a collective, which every process calls
    at the same point (the Trainer's save)."""
    import jax

    if jax.process_count() == 1:
        return [local]
    from jax.experimental import multihost_utils

    encoded = json.dumps(local, sort_keys=True).encode()
    if len(encoded) > size:
        raise ValueError(f"a data position of {len(encoded)} bytes does not fit {size}")
    codes = np.zeros(size, np.int32)  # int32: any platform's collectives carry it
    codes[:len(encoded)] = np.frombuffer(encoded, np.uint8)
    everyone = np.asarray(multihost_utils.process_allgather(codes)).reshape(-1, size)
    return [json.loads(bytes(row[row > 0].astype(np.uint8))) for row in everyone]


def saved_state(source, step: int) -> dict:
    """The checkpoint's data item at `step`: every data-loading process's position and the files'
    fingerprint; {"step": step} alone (replayed on resume) for a source without a position, or
    where a process's position is not at `step`. All processes call it together."""
    if not hasattr(source, "position_record"):
        return {"step": step}
    everyone = gather(source.position_record(step))
    if any(e["position"] is None for e in everyone):
        return {"step": step}
    shards = int(everyone[0]["shards"])
    positions = {}
    for e in everyone:  # processes that load the same rows (pipeline stages) hold the same position
        positions.setdefault(int(e["shard"]), e["position"])
    if sorted(positions) != list(range(shards)):
        raise ValueError(f"data positions of shards {sorted(positions)} were gathered, not of all {shards}")
    return {"step": step, "shards": shards, "positions": [positions[i] for i in range(shards)],
            "files": source.fingerprint(), "packing": getattr(source, "packing", "concat"),
            **({"plan": source.plan} if getattr(source, "plan", None) else {}),
            **({"packing_window": source.packing_window} if getattr(source, "packing", "") == "best_fit" else {})}


def warn(message: str) -> None:
    import jax

    if jax.process_index() == 0:  # process 0 speaks for every process
        print(f"warning: {message}", file=sys.stderr, flush=True)
