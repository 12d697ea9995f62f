"""Preemption: SIGTERM/SIGINT become a request to stop after the current step, agreed across
processes, so the Trainer can checkpoint and exit cleanly."""

from __future__ import annotations

import os
import signal
import threading

import jax
from jax.experimental import multihost_utils

from maxtext_rocm import startup_signals


class PreemptionGuard:
    """Turns SIGTERM/SIGINT into a request to stop after the current step; a second signal exits
    at once. With several processes, JAX's preemption sync point makes them all stop at the same
    step (a process that stopped alone would leave the others hanging in a collective)."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self):
        self.signal, self._previous = None, {}

    def __enter__(self):
        startup_signals.disarm()  # from here on a signal means: finish the step, checkpoint, stop
        if threading.current_thread() is threading.main_thread():  # signal handlers live there only
            self._previous = {sig: signal.signal(sig, self._handle) for sig in self.SIGNALS}
        return self

    def _handle(self, signum, _frame):
        if self.signal is not None:
            os._exit(128 + signum)
        self.signal = signum

    def requested(self, step: int) -> bool:
        if jax.process_count() > 1 and multihost_utils.reached_preemption_sync_point(step):
            self.signal = self.signal or signal.SIGTERM
        return self.signal is not None

    def __exit__(self, *exc):
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
