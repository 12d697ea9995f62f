"""Preemption: a SIGTERM or SIGINT on any process stops every process at the same step, which they
checkpoint together before exiting, each with one line.

Schedulers do not signal every host at the same instant (SLURM, Kubernetes and cloud preemption
reach the hosts milliseconds to seconds apart, or reach one only). A process that stopped on its
own signal would leave its peers alone in a collective, so the stop is agreed:

- A thread receives the signals (CPython's C handler writes the signal number to a wakeup file
  descriptor, as in startup_signals.py), so a signal is acted on at once even while the main
  thread sits in C++ (a step dispatch, a device_get, a checkpoint commit).
- That thread writes a stop request into the coordination service's key-value store (the one
  `jax.distributed` already runs) and wakes every process's watcher thread.
- Each watcher, not its main thread (which may be blocked in a collective waiting for a peer),
  freezes its loop at the number of steps the loop has already been cleared to reach, publishes
  that number, reads every process's number, and takes the largest: the stop step. Every process
  reaches it (each has been cleared that far by some process, and the collectives of the steps
  below it need everyone), none passes it.
- The main loop asks `proceed(step)` before each step: a lock and two attribute reads
  (docs/figures.md#the-preemption-guard-per-step); no host sync and no remote call per step. It
  waits only when its own number has been published and the decision has not arrived yet
  (bounded by `timeout_s`).
- A process whose loop ended (train.steps reached) publishes its final number when its guard
  closes, so a late request is still answered.

With one process the agreement is local: the stop step is the step the loop was cleared to reach.
JAX's own preemption sync point (multihost_utils.reached_preemption_sync_point) is not used: it
knows SIGTERM only, through a C++ handler that any Python handler replaces, and a notice on one
host reaches the others only through that handler.

Every process ends with the same status (`exit_status`: 130 after SIGINT, 0 after SIGTERM), which
each learns when the stop is agreed and tells its peer watch (runtime/peers.py), so that a peer
that finishes first and says goodbye with that status is not taken for a failure.

The guard stays active through the final save: a further signal prints one line and the save goes
on; a SIGINT sent twice more after the stop began abandons the uncommitted checkpoint (exit 130,
with a line naming what is committed). Orbax writes into a temporary directory, so committed
checkpoints are never touched by an abandoned one.
"""

from __future__ import annotations

import itertools
import os
import signal
import sys
import threading
from typing import Callable

from maxtext_rocm.runtime import startup_signals
from maxtext_rocm.config import UserError

PREFIX = "maxtext_rocm/stop"
ABANDON_AFTER = 2  # SIGINTs after the stop began that abandon an uncommitted checkpoint
_generations = itertools.count()  # one agreement per guard; every process makes its guards in the same order


def exit_status(signum: int) -> int:
    """The exit status of a process stopped by `signum` once its checkpoint is committed: 130 (the
    shell's 128 + SIGINT) after SIGINT, 0 after SIGTERM (a scheduler's preemption is no failure)."""
    return 128 + signal.SIGINT if signum == signal.SIGINT else 0


class StopNotAgreed(UserError):
    """The processes did not agree on a stop step in time (a peer stopped answering)."""


class StopAgreement:
    """The decision to stop, shared by `num_processes` processes through `client` (JAX's
    coordination-service client, or any object with key_value_set(key, value, allow_overwrite) and
    blocking_key_value_get(key, timeout_ms)); `client=None` for one process. `on_decided(signum)`:
    called on the watcher thread once the stop is agreed, before the loop can see the stop step."""

    def __init__(self, start_step: int, process_id: int = 0, num_processes: int = 1, client=None,
                 timeout_s: float = 120.0, generation: int | None = None,
                 on_decided: Callable[[int], None] | None = None):
        self.process_id, self.num_processes, self.client = process_id, num_processes, client
        self.timeout_s, self.on_decided = timeout_s, on_decided
        self.prefix = f"{PREFIX}/{next(_generations) if generation is None else generation}"
        self._lock = threading.Lock()
        self._cleared = start_step  # the loop may dispatch steps until the step count reaches this
        self._published = None  # the number this process published (the loop is frozen there)
        self.stop_step = None  # the agreed step, once known
        self.signal = None  # the signal behind the stop (this process's, or the requester's)
        self.error = None  # why no decision came (StopNotAgreed), for the main thread
        self._decided = threading.Event()
        self._closed = False
        self._watcher = None
        if client is not None and num_processes > 1:
            self._watcher = threading.Thread(target=self._watch, name="stop-agreement", daemon=True)
            self._watcher.start()

    # -- the main loop's side ----------------------------------------------------------------

    def proceed(self, step: int) -> bool:
        """True if the loop, at step count `step`, may dispatch one more step; False at the stop step."""
        with self._lock:
            if self.stop_step is not None:
                return step < self.stop_step
            if self._published is None:
                self._cleared = max(self._cleared, step + 1)
                return True
            if step < self._published:
                return True
        if not self._decided.wait(self.timeout_s) or self.stop_step is None:
            raise self.error or StopNotAgreed(
                f"process {self.process_id} was asked to stop at step {self._published} or later, but the "
                f"{self.num_processes} processes did not agree on a step within {self.timeout_s:g} s; "
                "a peer stopped answering (its own log says why)")
        return step < self.stop_step

    def stopping_at(self, step: int) -> bool:
        """True once the stop step is agreed and the loop is at it (never blocks)."""
        return self.stop_step is not None and step >= self.stop_step

    # -- the signal's side -------------------------------------------------------------------

    def request(self, signum: int) -> None:
        """Asks every process to stop (called from the signal thread of the process that got it)."""
        if self._watcher is None:
            with self._lock:
                self.signal = self.signal or signum
                self._freeze()
                self.stop_step = self._published
            self._decided.set()
            return
        value = f"stop {self.process_id} {signum}"
        self.client.key_value_set(f"{self.prefix}/request", value, allow_overwrite=True)
        for p in range(self.num_processes):
            self.client.key_value_set(f"{self.prefix}/wake/{p}", value, allow_overwrite=True)

    def _freeze(self) -> int:
        if self._published is None:
            self._published = self._cleared
        return self._published

    def _watch(self) -> None:
        while True:
            try:
                words = self.client.blocking_key_value_get(f"{self.prefix}/wake/{self.process_id}",
                                                           3_600_000).split()
            except Exception:  # noqa: BLE001 - a timeout (loop) or the client shutting down (leave)
                if self._closed:
                    return
                continue
            if words[0] == "stop":
                self._decide(int(words[2]))
            return  # "close", or decided

    def _decide(self, signum: int) -> None:
        with self._lock:
            self.signal = self.signal or signum
            mine = self._freeze()
        try:
            self.client.key_value_set(f"{self.prefix}/count/{self.process_id}", str(mine), allow_overwrite=True)
            counts = [int(self.client.blocking_key_value_get(f"{self.prefix}/count/{p}", int(self.timeout_s * 1000)))
                      for p in range(self.num_processes)]
        except Exception as error:  # noqa: BLE001 - a timeout, or the service going away
            first = (str(error).strip().splitlines() or [type(error).__name__])[0][:200]
            self.error = StopNotAgreed(
                f"process {self.process_id} was asked to stop but did not hear every process's step within "
                f"{self.timeout_s:g} s ({first}); a peer stopped answering (its own log says why)")
        else:
            if self.on_decided is not None:  # before the loop may stop (and a peer may end) on it
                self.on_decided(self.signal)
            with self._lock:
                self.stop_step = max(counts)
        self._decided.set()

    def close(self) -> None:
        """The loop is over: publishes how far it went (a late request is answered) and stops watching."""
        if self._watcher is None:
            return
        with self._lock:
            self._closed = True
            final = self._published is None and not self._decided.is_set()
            mine = self._freeze()
        try:
            if final:
                self.client.key_value_set(f"{self.prefix}/count/{self.process_id}", str(mine), allow_overwrite=True)
            if self._watcher.is_alive():
                self.client.key_value_set(f"{self.prefix}/wake/{self.process_id}", "close", allow_overwrite=True)
        except Exception:  # noqa: BLE001 - the service is gone: nobody is left to answer
            pass


class PreemptionGuard:
    """Takes SIGTERM/SIGINT over for the training loop and the final save (see the module's doc).

    `describe_saved()` (optional) names the newest committed checkpoint for the line that an
    abandoned save prints."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self, start_step: int = 0, describe_saved: Callable[[], str] | None = None,
                 timeout_s: float = 120.0, stream=None, exit=os._exit):
        self.start_step, self.describe_saved, self.timeout_s = start_step, describe_saved, timeout_s
        self._stream, self._exit = stream, exit
        self.agreement = None
        self._previous, self._previous_fd, self._fds, self._thread = {}, None, None, None
        self._received, self._interrupts_after = 0, 0

    def __enter__(self):
        startup_signals.disarm()  # from here on a signal means: finish the step, checkpoint, stop
        self.agreement = StopAgreement(self.start_step, *_cluster(), timeout_s=self.timeout_s,
                                       on_decided=_expect_peers_to_end_like_this_process)
        if threading.current_thread() is threading.main_thread():  # signal handlers live there only
            read_fd, write_fd = self._fds = os.pipe()
            os.set_blocking(write_fd, False)
            self._previous_fd = signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
            self._previous = {sig: signal.signal(sig, _noop) for sig in self.SIGNALS}
            self._thread = threading.Thread(target=self._receive, args=(read_fd,), name="preemption-signals",
                                            daemon=True)
            self._thread.start()
        return self

    # The loop's questions (see StopAgreement).
    def proceed(self, step: int) -> bool:
        return self.agreement.proceed(step)

    def stopping_at(self, step: int) -> bool:
        return self.agreement.stopping_at(step)

    @property
    def signal(self) -> int | None:
        """The signal that stopped the run (None if none did)."""
        return self.agreement.signal if self.agreement is not None else None

    def _say(self, message: str) -> None:
        print(message, file=self._stream or sys.stderr, flush=True)

    def _receive(self, read_fd: int) -> None:
        while True:
            try:
                data = os.read(read_fd, 1)
            except OSError:
                return
            if not data:
                return
            if data[0] in self.SIGNALS:
                self.received(data[0])

    def received(self, signum: int) -> None:
        """One signal, on the signal thread: the first asks for the stop, later ones say so."""
        self._received += 1
        if self._received == 1:
            try:
                self.agreement.request(signum)
            except Exception as error:  # noqa: BLE001 - the coordination service is gone
                self._say(f"warning: process {self.agreement.process_id} could not ask its peers to stop "
                          f"({type(error).__name__}); it stops when they do")
            return
        name = signal.Signals(signum).name
        where = (f"at step {self.agreement.stop_step}; its checkpoint is being committed"
                 if self.agreement.stop_step is not None else "(the processes are agreeing on the step)")
        if signum == signal.SIGINT:
            self._interrupts_after += 1
            if self._interrupts_after >= ABANDON_AFTER:
                saved = self.describe_saved() if self.describe_saved else "unknown"
                self._say(f"error: abandoned by a repeated SIGINT before the checkpoint was committed; "
                          f"the newest committed checkpoint is {saved}")
                self._exit(128 + signal.SIGINT)
                return
        left = ABANDON_AFTER - self._interrupts_after
        self._say(f"{name} again: already stopping {where} (SIGINT {left} more time{'s' * (left > 1)} "
                  "abandons it)")

    def __exit__(self, *exc):
        if self.agreement is not None:
            self.agreement.close()
        for sig, handler in self._previous.items():
            signal.signal(sig, handler if handler is not None else signal.SIG_DFL)
        if self._fds is not None:
            signal.set_wakeup_fd(self._previous_fd)
            read_fd, write_fd = self._fds
            os.close(write_fd)  # the thread reads EOF and returns
            self._thread.join(timeout=1.0)
            os.close(read_fd)
            self._fds = None


def _expect_peers_to_end_like_this_process(signum: int) -> None:
    """Every process ends the agreed stop with exit_status(signum): a peer's goodbye with it is the
    end they agreed on, not a failure to stop for (runtime/peers.py)."""
    from maxtext_rocm.runtime import distributed

    distributed.expect_peer_exit(exit_status(signum))


def _noop(_signum, _frame) -> None:
    """Installed so that CPython's C handler runs and writes the wakeup byte; the thread acts."""


def _cluster() -> tuple[int, int, object]:
    """(process id, process count, coordination client or None)."""
    import jax

    if jax.process_count() == 1:
        return 0, 1, None
    from jax._src import distributed as jax_distributed

    return jax.process_index(), jax.process_count(), jax_distributed.global_state.client
