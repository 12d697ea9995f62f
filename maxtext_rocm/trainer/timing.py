"""The Trainer's clocks: how long a launch took to its first finished step (said once), and the
step time of the logged rows (measured between marks, evaluations left out) with the padding and
the row length of the steps it timed (for the rows' tokens per second)."""

from __future__ import annotations

import contextlib
import time

from maxtext_rocm.trainer import compilation


class StartupClock:
    """From the Trainer's start to its first finished step, said once per Trainer, naming whether
    the step was compiled or loaded from the persistent compilation cache."""

    def __init__(self, started: float, cache_dir: str | None):
        self.started: float | None = started
        self.cache_dir = cache_dir
        self._cache_hits_before = compilation.cache_hits()

    def first_step_done(self, log) -> None:
        if self.started is None:
            return
        loaded = compilation.cache_hits() - self._cache_hits_before
        how = (f"{loaded} compiled program{'s' * (loaded > 1)} loaded from {self.cache_dir}"
               if loaded else "includes compilation")
        log(f"first step done {time.perf_counter() - self.started:.1f}s after the trainer started ({how})")
        self.started = None


class StepClock:
    """One `Trainer.run` call's step timing: a mark (time, step count) that the next logged row's
    step time is measured from, set at the end of the call's first step (the Trainer's first
    includes compilation) and again at each logged row; `logged_at`: the step of the last row.
    `paddings`: the padding fraction of each step taken since the mark, as the device scalars the
    steps returned, fetched with the row's other metrics (no host sync of their own)."""

    def __init__(self):
        self.mark: tuple[float, int] | None = None
        self.logged_at: int | None = None
        self.paddings: list = []
        self.row_lengths: list[int] = []

    @property
    def started(self) -> bool:
        return self.mark is not None

    def start(self, step_count: int) -> None:
        self.mark = (time.perf_counter(), step_count)
        self.paddings, self.row_lengths = [], []

    def timed(self, step_metrics: dict) -> None:
        """A step taken after the mark: its padding counts in the next row's real tokens, its row
        length (train.seq_len, or a bucket's) in the positions it computed."""
        self.paddings.append(step_metrics["padding"])
        self.row_lengths.append(step_metrics["row_length"])

    def step_time(self, step_count: int) -> float | None:
        """Seconds per step since the mark (None when no step was taken since)."""
        timed_steps = step_count - self.mark[1]
        return (time.perf_counter() - self.mark[0]) / timed_steps if timed_steps else None

    def logged(self, step_count: int) -> None:
        self.start(step_count)
        self.logged_at = step_count

    @contextlib.contextmanager
    def left_out(self):
        """Time spent inside (an evaluation) stays out of the step time."""
        began = time.perf_counter()
        yield
        self.mark = (self.mark[0] + time.perf_counter() - began, self.mark[1])
