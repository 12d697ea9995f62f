"""What the stop agreement costs the training loop per step (maxtext_rocm/runtime/preemption.py).

The loop calls `proceed(step)` before each step. Measured here: that call with one process (no
watcher) and with a watcher thread blocked on the key-value store (an in-process stand-in for the coordination service; the real one is a gRPC long
poll that sleeps in C++ until a request comes, so it takes no CPU between requests either).

    python scripts/bench_preemption.py [N]
"""

import argparse
import signal
import sys
import time
from pathlib import Path

from maxtext_rocm.runtime.preemption import StopAgreement

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from helpers import KeyValueStore  # noqa: E402 - the in-process stand-in the agreement's tests use


def per_step_us(agreement, n: int) -> float:
    started = time.perf_counter()
    for step in range(n):
        agreement.proceed(step)
    return (time.perf_counter() - started) / n * 1e6


def main(n: int = 1_000_000) -> None:
    alone = StopAgreement(0)
    print(f"one process:             {per_step_us(alone, n):.2f} us/step")
    watched = StopAgreement(0, 0, 2, KeyValueStore(), generation=0)
    print(f"two processes (watcher): {per_step_us(watched, n):.2f} us/step")
    watched.close()
    stopped = StopAgreement(0)
    stopped.proceed(0)
    stopped.request(signal.SIGTERM)
    started = time.perf_counter()
    for _ in range(n):
        stopped.proceed(0)
    print(f"after the decision:      {(time.perf_counter() - started) / n * 1e6:.2f} us/call")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("n", nargs="?", type=int, default=1_000_000, help="calls timed per case")
    main(parser.parse_args().n)
