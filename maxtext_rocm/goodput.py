"""The goodput command line:

    python -m maxtext_rocm.goodput RUN_DIR [--json]

prints the goodput of a run (productive step time over its wall time, across every restart) and a
table of the rest by cause, for the whole run and each launch (maxtext_rocm/reporting/goodput.py);
`--json` prints `goodput` (a fraction), `wall_s`, `productive_s`, `badput` (cause -> seconds),
`restarts`, and each launch's figures.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

USAGE = "usage: python -m maxtext_rocm.goodput RUN_DIR [--json]"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    as_json = "--json" in argv
    rest = [a for a in argv if a != "--json"]
    if len(rest) != 1 or rest[0].startswith("-"):
        print(USAGE, file=sys.stderr)
        return 2
    from maxtext_rocm.reporting.goodput import account_run, format_account

    run_dir = Path(rest[0])
    if not run_dir.is_dir():
        print(f"error: {run_dir} is not a directory; give a run's output_dir", file=sys.stderr)
        return 2
    acct = account_run(run_dir)
    if acct is None:
        print(f"error: {run_dir} holds no timeline (goodput/process-*.jsonl); give the output_dir of a run "
              "that trained at least one step", file=sys.stderr)
        return 2
    print(json.dumps(acct.to_json(), indent=1) if as_json else format_account(run_dir, acct))
    return 0


if __name__ == "__main__":
    sys.exit(main())
