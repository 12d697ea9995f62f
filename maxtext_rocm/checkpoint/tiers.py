"""Which tier a resume reads: one decision that every process of the run takes together.

Every process reports the local steps it holds (local_tier.py); the candidates are the steps that
*every* process holds, at or after the newest persistent checkpoint (a local step older than it
would throw work away), newest first. For each candidate every process reads its own files, then
all verify the state together (its checksums are global sums), and all move on together unless
all succeeded: a process whose local tier is missing or damaged (a replaced node, a full
/dev/shm) makes every process fall back to an older common local step or to the persistent tier.
The decision is said in one line, by process 0.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import jax
import numpy as np

from maxtext_rocm.checkpoint.local_tier import LocalDamaged, LocalTier, verify_loaded

_MAX_STEPS = 64  # local steps each process reports; local_keep is far below it


@dataclasses.dataclass
class LocalRestore:
    """A resume from the local tier: the state, its data position and step, and the step's folder."""
    state: object
    data_state: dict
    step: int
    folder: Path


def _gather_rows(row: np.ndarray) -> np.ndarray:
    """Every process's `row` (one int64 row per process)."""
    if jax.process_count() == 1:
        return row[None]
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(row)).reshape(jax.process_count(), -1)


def common_steps(tier: LocalTier) -> tuple[list[int], list[int]]:
    """(the local steps every process holds, newest first; how many steps each process holds).
    A collective: every process calls it."""
    mine = tier.steps()[:_MAX_STEPS]
    row = np.full(_MAX_STEPS, -1, np.int64)
    row[:len(mine)] = mine
    rows = _gather_rows(row)
    held = [set(int(s) for s in r if s >= 0) for r in rows]
    return sorted(set.intersection(*held), reverse=True), [len(h) for h in held]


def _failed_processes(failure: bool) -> list[int]:
    """The processes whose `failure` is true (a collective: every process calls it)."""
    return [i for i, f in enumerate(_gather_rows(np.array([int(failure)], np.int64))[:, 0]) if f]


def restore_newest_common(tier: LocalTier, candidates: list[int], persistent_newest: int | None,
                          abstract_state) -> tuple[LocalRestore | None, str]:
    """(the restored local step, or None to read the persistent tier; the line that says why).
    Every process calls it with the same `candidates` and `persistent_newest`. A step is read in
    two rounds, each ending in one agreement: every process reads its own shards (a process that
    cannot would miss the collective that follows, so all first agree that all could), then all
    verify the state together against its checksums (global sums)."""
    usable = [s for s in candidates if persistent_newest is None or s >= persistent_newest]
    damaged_notes = []
    for step in usable:
        why = None
        try:
            state, data_state, meta = tier.load(step, abstract_state)
        except LocalDamaged as damage:
            why = str(damage)
        failed = _failed_processes(why is not None)
        if not failed:
            why = verify_loaded(state, data_state, meta)
            failed = _failed_processes(why is not None)
        if not failed:
            return LocalRestore(state, data_state, step, tier.directory / str(step)), (
                f"resuming from the local tier at step {step}: the newest step every process holds intact"
                + (f" (the newest persistent checkpoint is step {persistent_newest})"
                   if persistent_newest is not None else " (no persistent checkpoint yet)"))
        if why is not None:  # checksums are global: a damaged shard anywhere fails on every process
            moved = tier.set_aside(step)
            print(f"warning: process {jax.process_index()}: local checkpoint {tier.directory / str(step)} {why}; "
                  f"it was moved to {moved}", file=sys.stderr, flush=True)
        damaged_notes.append(f"local step {step} is damaged on process{'es' * (len(failed) > 1)} "
                             + ", ".join(map(str, failed)))
    return None, ("; ".join(damaged_notes) if damaged_notes else "")


def fallback_line(candidates: list[int], held: list[int], persistent_newest: int | None, notes: str) -> str:
    """Why the persistent tier (or a fresh start) was chosen, in one clause."""
    empty = [i for i, n in enumerate(held) if n == 0]
    if notes:
        why = notes
    elif empty and len(empty) < len(held):
        why = f"process{'es' * (len(empty) > 1)} {', '.join(map(str, empty))} hold{'s' * (len(empty) == 1)} no local checkpoint"
    elif empty:
        why = "no process holds a local checkpoint"
    elif not candidates:
        why = "no local step is held by every process"
    else:
        why = f"the newest local step every process holds ({candidates[0]}) is older than the persistent one"
    where = (f"from the persistent tier (newest: step {persistent_newest})" if persistent_newest is not None
             else "at step 0 (no persistent checkpoint)")
    return f"resuming {where}: {why}"
