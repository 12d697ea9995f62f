"""Orbax's failures as one sentence: the cause under its wrappers, and its own duplicate reports
(logged tracebacks, closed-event-loop callbacks) kept off stderr, since the Checkpointer raises
each failure itself as a CheckpointError that the command line prints in one line."""

from __future__ import annotations

import logging
import os
import re
import sys


def quiet_closed_loop_callbacks() -> None:
    """When one read of a restore fails, or one write of an async save (a full disk), orbax closes
    its event loop while tensorstore still has operations in flight; each of their callbacks then
    reports "Event loop is closed" through sys.unraisablehook, a traceback apiece (240 of them,
    728 lines, for one full disk). They say nothing the one-sentence error does not, so drop
    exactly those (installed once, by the Checkpointer's constructor and before restores)."""
    previous = sys.unraisablehook
    if getattr(previous, "_drops_closed_loop", False):
        return

    def hook(unraisable):
        value = unraisable.exc_value
        if not (isinstance(value, RuntimeError) and str(value) == "Event loop is closed"):
            previous(unraisable)
    hook._drops_closed_loop = True
    sys.unraisablehook = hook


def first_line(error: BaseException) -> str:
    return (str(error).strip().splitlines() or [type(error).__name__])[0][:300]


def cause(error: BaseException) -> str:
    """What went wrong underneath orbax's wrappers, in a few words: the strerror of the first
    OSError in the exception's chain (or in tensorstore's message), else its first line."""
    pending, seen = [error], set()
    while pending:
        current = pending.pop(0)
        if current is None or id(current) in seen:
            continue
        seen.add(id(current))
        if isinstance(current, OSError) and current.errno:
            return os.strerror(current.errno)
        pending += [*getattr(current, "exceptions", ()), current.__cause__, current.__context__]
    found = re.search(r"\[OS error(?: \d+)?: ([^\]]+)\]", str(error))
    return found.group(1) if found else f"{type(error).__name__}: {first_line(error)}"


class OrbaxErrorLogFilter(logging.Filter):
    """Orbax logs a failed background write with its traceback (hundreds of lines for one full
    disk) and then raises it to us; the Checkpointer reports it in one sentence instead."""

    def filter(self, record):
        if "orbax" not in record.pathname:
            return True
        # Reading a step's `state` item on its own (the params readers) has no step-level
        # metadata file beside it, and the local tier's saves have no primary host (each process
        # saves its own: checkpoint/local_tier.py); orbax warns about both although nothing is wrong.
        return record.levelno < logging.ERROR and not record.getMessage().startswith(
            ("Metadata file does not exist", "Global object size logging disabled"))


class UnreadReadFailureFilter(logging.Filter):
    """asyncio's report, at exit, of a task whose exception nobody read. Orbax wraps tensorstore's
    read futures in such tasks (`asyncio.ensure_future` of a non-coroutine awaitable, whose task
    runs `_wrap_awaitable`); when one read of a damaged checkpoint fails, the restore raises and
    the other reads' failures are reported this way, a traceback apiece, after the one-sentence
    error (seen once in CI, on Python 3.12). Only those tasks' reports are dropped: a failing
    coroutine of anyone's is still reported."""

    def filter(self, record):
        message = record.getMessage()
        return not (message.startswith(("Task exception was never retrieved", "Future exception was never retrieved"))
                    and "_wrap_awaitable" in message)


def quiet_orbax_error_logs() -> None:
    """Installs OrbaxErrorLogFilter on absl's logger (which orbax logs through), the filter of
    unread tensorstore read failures on asyncio's, and the closed-event-loop filter for saves as for
    restores, once (the Checkpointer's constructor)."""
    quiet_closed_loop_callbacks()
    for name, kind in (("absl", OrbaxErrorLogFilter), ("asyncio", UnreadReadFailureFilter)):
        logger = logging.getLogger(name)
        if not any(isinstance(f, kind) for f in logger.filters):
            logger.addFilter(kind())


def release_orbax_waiters() -> int:
    """After a failed save: ends orbax's background threads still waiting for a signal that the
    failed step will never send (the directory it could not create, say). They are not daemon
    threads, and they wait for orbax's coordination timeout, so the interpreter's exit would wait
    for them (a run that reported its failure and then hung). Each is cancelled and its awaited
    signal set, so it returns at once without running its work. Returns how many were released."""
    try:
        from orbax.checkpoint._src.futures import future
    except ImportError:  # another orbax layout: nothing known to release
        return 0
    import threading
    import warnings

    # Their coroutines, never started, would each be reported at exit ("never awaited"): expected here.
    warnings.filterwarnings("ignore", message="coroutine .* was never awaited", category=RuntimeWarning)
    released = 0
    for thread in threading.enumerate():
        if isinstance(thread, getattr(future, "_SignalingThread", ())) and thread.is_alive():
            try:
                thread.cancel()
                future.set_signals(thread._receive_signals, operation_id=thread._operation_id)
                released += 1
            except Exception:  # noqa: BLE001 - best effort: the failure is reported either way
                pass
    return released
