"""SIGTERM/SIGINT before the training loop: exit at once with one line, whatever the process is doing.

Before the first step there is nothing to save, so a signal should end the process promptly and
say so: Python's defaults do neither (SIGTERM kills silently with status 143; SIGINT raises
KeyboardInterrupt wherever the main thread is, a traceback from inside an import or a compile).
A Python signal handler alone is not enough either: it runs only when the main thread returns to
the interpreter, and during start-up the main thread spends seconds inside C++ (XLA compiling,
a checkpoint restore). So the handler does nothing itself; CPython's C-level handler writes the
signal number to a wakeup file descriptor (`signal.set_wakeup_fd`) and a thread blocked on that
descriptor prints the line and exits with 128 + the signal number, the shell's convention.

This module imports nothing heavy, so `maxtext_rocm/__init__.py` can arm it before jax loads
when the process is `python -m maxtext_rocm.train`. `preemption.PreemptionGuard` disarms it when
the training loop takes the signals over (stop after the current step, checkpoint, exit).
"""

from __future__ import annotations

import os
import signal
import sys
import threading

SIGNALS = (signal.SIGTERM, signal.SIGINT)

_lock = threading.Lock()
_armed: "_Guard | None" = None


class _Guard:
    def __init__(self):
        self.read_fd, self.write_fd = os.pipe()
        os.set_blocking(self.write_fd, False)
        self.previous_fd = signal.set_wakeup_fd(self.write_fd, warn_on_full_buffer=False)
        self.previous = {sig: signal.signal(sig, _ignore_in_python) for sig in SIGNALS}
        self.active = True
        self.thread = threading.Thread(target=self._watch, name="startup-signals", daemon=True)
        self.thread.start()

    def _watch(self) -> None:
        while True:
            try:
                data = os.read(self.read_fd, 1)
            except OSError:
                return
            if not data:  # the write end closed: disarmed
                return
            if self.active and data[0] in SIGNALS:
                name = signal.Signals(data[0]).name
                print(f"error: stopped by {name} during start-up, before the first training step; "
                      "nothing was saved and nothing in output_dir was changed", file=sys.stderr, flush=True)
                os._exit(128 + data[0])

    def close(self) -> None:
        self.active = False
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)
        signal.set_wakeup_fd(self.previous_fd)
        os.close(self.write_fd)  # the watcher reads EOF and returns
        self.thread.join(timeout=1.0)
        os.close(self.read_fd)


def _ignore_in_python(_signum, _frame) -> None:
    """Installed so that the C-level handler runs (and writes the wakeup byte); the exit is the
    watcher thread's, which does not wait for the main thread to come back from C++."""


def arm() -> bool:
    """Starts exiting on SIGTERM/SIGINT; True if this call armed it (False: already armed, or not
    the main thread, where signal handlers cannot be set)."""
    global _armed
    if threading.current_thread() is not threading.main_thread():
        return False
    with _lock:
        if _armed is not None:
            return False
        _armed = _Guard()
        return True


def disarm() -> None:
    """Gives SIGTERM/SIGINT back to the handlers that were there before `arm` (idempotent)."""
    global _armed
    if threading.current_thread() is not threading.main_thread():
        return
    with _lock:
        if _armed is not None:
            _armed.close()
            _armed = None


def is_armed() -> bool:
    return _armed is not None


def started_as_train_cli() -> bool:
    """True when this interpreter was started as `python -m maxtext_rocm.train` (read from
    sys.orig_argv, the only record of the module name while its parent package is imported)."""
    argv = getattr(sys, "orig_argv", [])
    return any(a == "-m" and b == "maxtext_rocm.train" for a, b in zip(argv, argv[1:]))
