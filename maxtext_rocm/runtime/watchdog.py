"""The hang watchdog (`train.hang_timeout_s`): a run that stops making progress ends, loudly.

A collective whose peer is stuck, a filesystem that stopped answering, a loader that waits for
ever: the process is alive and silent, and a scheduler cannot tell it from a slow step. With
`train.hang_timeout_s` > 0 the command line starts this watchdog; when no training step has
finished for that long it writes every thread's Python stack (`faulthandler`) to stderr and to
`output_dir/hang-p<process>-<time>.txt` and exits with status 4 (HANG_EXIT_STATUS), so the
scheduler restarts the run from its last checkpoint.

When a step "finished" is told without a host sync: the trainer hands over each step's metrics
(device arrays) as it dispatches the step, and this thread polls `jax.Array.is_ready()` on the
oldest one still pending, once a second or so. The training loop never waits for it, and a step
counts as finished when the device has finished it, not when the host dispatched it (dispatch
runs ahead of the device by up to `log.every` steps, so timing dispatches would both miss a hung
device and call a slow logging step a hang).

Before the first step of a launch finishes, the limit is `train.startup_timeout_s` (0: ten times
`train.hang_timeout_s`): that span holds the restore and the compilation of the step, which take
far longer than a step. After the last step (`train.steps`) finishes the watchdog stands down: what
is left is the final checkpoint's write, bounded by the checkpoint layer. Pauses between steps
(an evaluation, the blocking part of a save) count against the limit, so it must exceed them.
"""

from __future__ import annotations

import collections
import datetime
import faulthandler
import os
import sys
import threading
import time
from pathlib import Path
from typing import Callable

HANG_EXIT_STATUS = 4
STARTUP_FACTOR = 10  # startup_timeout_s=0: this many times hang_timeout_s


class HangWatchdog:
    """Watches steps finish; `dispatched(step, metrics)` is the trainer's only call, per step."""

    def __init__(self, hang_timeout_s: float, startup_timeout_s: float, output_dir: str, last_step: int,
                 process_index: int = 0, exit: Callable[[int], None] = os._exit,
                 stream=None, clock: Callable[[], float] = time.monotonic, poll_s: float | None = None):
        self.hang_timeout_s = float(hang_timeout_s)
        self.startup_timeout_s = float(startup_timeout_s) or STARTUP_FACTOR * self.hang_timeout_s
        self.output_dir, self.last_step, self.process_index = output_dir, last_step, process_index
        self._exit, self._stream, self._clock = exit, stream, clock
        self._poll_s = poll_s if poll_s is not None else min(1.0, self.hang_timeout_s / 10)
        self._pending = collections.deque()  # (step number after it, one of its metrics arrays)
        self._since = clock()  # the last progress: the start, or the last step that finished
        self.finished_step = None  # the last step that finished (None: none yet in this launch)
        self._stop = threading.Event()
        self._thread = None

    # -- the trainer's side ---------------------------------------------------------------------

    def dispatched(self, step: int, metrics) -> None:
        """Step `step` (the count after it) was dispatched with these metrics: no sync, one append."""
        leaf = next(iter(metrics.values())) if isinstance(metrics, dict) else metrics
        self._pending.append((step, leaf))

    def start(self) -> "HangWatchdog":
        self._since = self._clock()
        self._thread = threading.Thread(target=self._watch, name="hang-watchdog", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()

    # -- the watching thread --------------------------------------------------------------------

    def limit(self) -> float:
        return self.startup_timeout_s if self.finished_step is None else self.hang_timeout_s

    def check(self) -> bool:
        """One look: records finished steps; fires when the limit has passed. False: stand down."""
        while self._pending and self._pending[0][1].is_ready():
            self.finished_step = self._pending.popleft()[0]
            self._since = self._clock()
        if self.finished_step is not None and self.finished_step >= self.last_step:
            return False  # the run's steps are done; the final save is the checkpoint layer's
        silent = self._clock() - self._since
        if silent > self.limit():
            self._fire(silent)
            return False
        return True

    def _watch(self) -> None:
        while not self._stop.wait(self._poll_s):
            if not self.check():
                return

    def _fire(self, silent: float) -> None:
        stream = self._stream or sys.stderr
        when = datetime.datetime.now().strftime("%Y%m%dT%H%M%S")
        path = Path(self.output_dir) / f"hang-p{self.process_index}-{when}.txt"
        which = "train.startup_timeout_s" if self.finished_step is None else "train.hang_timeout_s"
        since = (f"since step {self.finished_step} finished" if self.finished_step is not None
                 else "since start-up began (restore and compilation included)")
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            with open(path, "w") as f:
                f.write(f"no training step finished for {silent:.0f} s {since}; the Python stack of every "
                        "thread of this process follows\n")
                faulthandler.dump_traceback(f, all_threads=True)
            saved = f"; every thread's stack is below and in {path}"
        except OSError as error:
            saved = f"; every thread's stack is below (could not write {path}: {error.strerror})"
        print(f"error: no training step finished for {silent:.0f} s {since} (limit {self.limit():.0f} s, "
              f"{which}){saved}; exiting with status {HANG_EXIT_STATUS} so the scheduler can restart the run "
              "from its last checkpoint", file=stream, flush=True)
        try:
            faulthandler.dump_traceback(stream, all_threads=True)
        except (ValueError, OSError, AttributeError):  # a stream without a file descriptor
            pass
        stream.flush()
        self._exit(HANG_EXIT_STATUS)
