"""A run's timeline, for goodput (maxtext_rocm/reporting/goodput.py): what each process of each
launch spent its wall time on, appended to `output_dir/goodput/process-<i>.jsonl` across restarts.

Each line is one span: {"launch", "event", "t0", "t1", ...} in seconds since the epoch. The spans
of a launch tile its time from the process's start to its last record:

- `startup`: the process's start to the Trainer's (interpreter, imports, config), less
  `distributed_init` (jax.distributed.initialize), recorded as its own span;
- `build`: the Trainer's start to the launch of its state (mesh, model, data);
- `launch`: the state made or restored (`restore_s` of it reading a checkpoint, `tier`) and the
  train step compiled or loaded from the compilation cache, which overlap;
- `first_step`: from the Trainer built to its first step finished (the step and its warm-up);
- `steps`: steps `first`+1..`last`, from one synchronisation of the host with the devices to the
  next (a logging step, a save, an evaluation): the loop never waits on the devices for this;
- `checkpoint` (`tier`: persistent or local, `step`), `eval`: stalls of the loop, from the devices
  done with the steps before to the loop going on.

A launch that fails before its state is made or restored writes nothing (its spans are held
until then): a refused start leaves the run directory as it was. A launch killed later is seen
up to its last record; the report counts the rest as `between_launches`. JSON Lines, no pickles;
one process writes one file.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import sys
import time
from pathlib import Path

import jax

_PROCESS_TIMED = False  # the first Trainer of a process counts from the process's start


def process_started() -> float | None:
    """The wall time this process started at (Linux: its start in clock ticks since boot, against
    the uptime now; /proc/stat's boot time is whole seconds), or None where it cannot be read."""
    try:
        ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
        uptime = float(Path("/proc/uptime").read_text().split()[0])
        return time.time() - (uptime - ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return None


class Timeline:
    """One process's spans of one launch; `goodput_so_far` for the logged rows."""

    def __init__(self, output_dir: str, trainer_started_wall: float, distributed_span: tuple | None = None):
        global _PROCESS_TIMED
        from maxtext_rocm.reporting import goodput

        self.path = goodput.timeline_path(output_dir, jax.process_index())
        earlier = goodput.read_spans(self.path)
        self.launch = 1 + max((s["launch"] for s in earlier), default=-1)
        # What earlier launches reached and trained: steps up to there are recomputed if done again.
        self.reached = max((s["last"] for s in earlier if s["event"] in ("steps", "first_step")), default=0)
        self.first_t0 = min((s["t0"] for s in earlier), default=None)
        self.earlier_productive = goodput.account(earlier).productive_s if earlier else 0.0
        self.productive = 0.0
        self._held: list[dict] | None = []  # until the state is made: a launch that fails writes nothing
        self._closed = False
        self._unwritable = False
        self._mark: tuple[float, int] | None = None
        began = process_started() if not _PROCESS_TIMED else None
        _PROCESS_TIMED = True
        began = trainer_started_wall if began is None or began > trainer_started_wall else began
        self.first_t0 = began if self.first_t0 is None else self.first_t0
        self.record("startup", began, trainer_started_wall)
        if distributed_span and distributed_span[0] >= began:
            self.record("distributed_init", *distributed_span)
        self._built_from = trainer_started_wall
        atexit.register(self.closed)  # the process's end is the launch's last record (train.py exits)

    # ------------------------------------------------------------------------------------------

    def record(self, event: str, t0: float, t1: float, **fields) -> None:
        span = {"launch": self.launch, "event": event, "t0": round(t0, 6), "t1": round(t1, 6), **fields}
        if self._held is not None:
            self._held.append(span)
            return
        self._append([span])

    def _append(self, spans: list[dict]) -> None:
        if self._unwritable:
            return
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with open(self.path, "a") as f:
                f.write("".join(json.dumps(s) + "\n" for s in spans))
        except OSError as error:  # a full disk stops the run at its next save, not here: goodput is a report
            self._unwritable = True
            print(f"warning: the goodput timeline {self.path} cannot be written ({error.strerror or error}); "
                  "this launch's goodput is not recorded", file=sys.stderr, flush=True)

    def launched(self, began: float, restore_s: float, resumed_step: int, tier: str, cache_loads: int) -> None:
        """The Trainer's build (its start to `began`) and the launch of its state (`began` to now)."""
        now = time.time()
        self.record("build", self._built_from, began)
        self.record("launch", began, now, restore_s=round(restore_s, 6), resumed_step=resumed_step, tier=tier,
                    cache_loads=cache_loads)
        self._built_from = now
        held, self._held = self._held, None
        self._append(held)

    def run_started(self, step_count: int) -> None:
        """A `Trainer.run` call begins; steps after the first call's first are timed from here."""
        if self._built_from is None:
            self._mark = (time.time(), step_count)

    def first_step(self, step_count: int) -> None:
        """The launch's first step has finished (the devices synchronised)."""
        now = time.time()
        if self._built_from is not None:  # the launch's first
            self.record("first_step", self._built_from, now, first=step_count - 1, last=step_count)
            self._built_from = None
        elif self._mark is not None:
            self.steps_until(step_count, now)
        self._mark = (now, step_count)

    def steps_until(self, step_count: int, now: float | None = None) -> None:
        """The devices have finished every step up to `step_count` (the caller synchronised)."""
        now = time.time() if now is None else now
        if self._mark is None:
            return
        t0, first = self._mark
        if step_count > first:
            self.record("steps", t0, now, first=first, last=step_count)
            new = step_count - max(first, self.reached)
            self.productive += (now - t0) * max(0, new) / (step_count - first)
        self._mark = (now, step_count)

    @contextlib.contextmanager
    def stall(self, event: str, step_count: int, ready=None, **fields):
        """A stall of the loop (a save, an evaluation): the steps before it are waited for first
        (`ready`, at a point that synchronises anyway), and are recorded up to there."""
        if ready is not None:
            jax.block_until_ready(ready)
        self.steps_until(step_count)
        began = time.time()
        try:
            yield
        finally:
            now = time.time()
            self.record(event, began, now, step=step_count, **fields)
            if self._mark is not None:
                self._mark = (now, self._mark[1])

    def closed(self) -> None:
        """The Trainer is closed: the launch's last record (its end, for goodput)."""
        if self._held is None and not self._closed and self.path.parent.is_dir():
            self._closed = True
            now = time.time()
            self.record("end", now, now)

    def goodput_so_far(self) -> float:
        """Productive step time over the wall time since the run's first launch began."""
        elapsed = time.time() - self.first_t0
        return (self.earlier_productive + self.productive) / elapsed if elapsed > 0 else 0.0
