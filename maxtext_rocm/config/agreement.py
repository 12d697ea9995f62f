"""Every process of a run trains the same config: compared at start, the first difference named.

Processes started with different configs (a stale override on one node, another preset on
another) would otherwise compile different programs and meet in mismatched collectives, seen as a
hang or as "process 1 went silent". So, once jax.distributed has started and before anything is
compiled, each process publishes a digest of its resolved config in the coordination service's
key-value store (process 0 also its full JSON) and reads every other's. All processes read the
same digests, so all come to the same verdict: where one differs from process 0's, that process
publishes its JSON too, and every process names the first key that differs, with both values, in
the same sentence, and exits 2 (together: none is left waiting in a collective or reported as
silent by the peer watch).
"""

from __future__ import annotations

import hashlib
import json

from maxtext_rocm.errors import UserError

PREFIX = "maxtext_rocm/config"
# Keys that differ between the processes of one run by design: each process's place in it.
PER_PROCESS_KEYS = ("distributed.process_id", "distributed.coordinator", "distributed.num_processes")


def comparable(cfg) -> dict:
    """The resolved config as nested dicts, without PER_PROCESS_KEYS."""
    tree = json.loads(json.dumps(cfg.to_dict(), default=repr))
    for key in PER_PROCESS_KEYS:
        group, name = key.split(".")
        tree.get(group, {}).pop(name, None)
    return tree


def _digest(tree: dict) -> str:
    return hashlib.sha256(json.dumps(tree, sort_keys=True).encode()).hexdigest()


def _leaves(tree, prefix=""):
    for key, value in tree.items():
        if isinstance(value, dict) and value:
            yield from _leaves(value, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}", value


def first_difference(mine: dict, theirs: dict) -> tuple[str, str, str] | None:
    """(dotted key, its value in `mine`, in `theirs`) for the first key (in `mine`'s order, then
    `theirs`') whose values differ; values as the command line would write them."""
    a, b = dict(_leaves(mine)), dict(_leaves(theirs))
    missing = "(no such key)"
    for key in [*a, *(k for k in b if k not in a)]:
        if a.get(key, missing) != b.get(key, missing):
            show = lambda d: repr(d[key]) if key in d else missing  # noqa: E731
            return key, show(a), show(b)
    return None


def check(cfg, client, process_id: int, num_processes: int, timeout_s: float, on_disagreement=None) -> None:
    """Raises UserError on every process if any process's resolved config differs from process 0's.

    `client`: jax's coordination-service client (key_value_set, blocking_key_value_get,
    wait_at_barrier). `on_disagreement` runs before the processes meet to stop together (the
    trainer passes the peer watch's end_together, so no process reports another as lost).
    """
    tree = comparable(cfg)
    digest = _digest(tree)
    timeout_ms = int(timeout_s * 1000)
    client.key_value_set(f"{PREFIX}/digest/{process_id}", digest)
    if process_id == 0:
        client.key_value_set(f"{PREFIX}/json/0", json.dumps(tree))
    digests = [client.blocking_key_value_get(f"{PREFIX}/digest/{i}", timeout_ms) for i in range(num_processes)]
    differing = [i for i, d in enumerate(digests) if d != digests[0]]
    if not differing:
        return
    first = differing[0]
    if process_id == first:
        client.key_value_set(f"{PREFIX}/json/{first}", json.dumps(tree))
    reference = json.loads(client.blocking_key_value_get(f"{PREFIX}/json/0", timeout_ms))
    other = json.loads(client.blocking_key_value_get(f"{PREFIX}/json/{first}", timeout_ms))
    found = first_difference(other, reference)
    key, there, on_0 = found if found else ("(none found)", "?", "?")
    more = f" (and {len(differing) - 1} more process{'es' * (len(differing) > 2)})" if len(differing) > 1 else ""
    if on_disagreement is not None:
        on_disagreement()
    try:  # every process has decided (and stopped its peer watch) before any of them ends
        client.wait_at_barrier(f"{PREFIX}/disagreement", timeout_ms)
    except Exception:  # noqa: BLE001 - a process gone meanwhile: stop anyway, with the same sentence
        pass
    raise UserError(f"process {first}{more} was started with a different config than process 0: {key}={there} "
                    f"there, {key}={on_0} on process 0; start every process with the same config file and "
                    "overrides")
