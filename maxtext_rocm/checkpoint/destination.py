"""Whether a new output folder can be made where the user asked for one, as a phrase naming the path
at fault: shared by the writers of exports (`checkpoint export`) and conversions (`convert`), which
each say it in their own sentence, before anything is read or written."""

from __future__ import annotations

import os
from pathlib import Path
from typing import NamedTuple


class Unwritable(NamedTuple):
    """The path at fault and what is wrong with it ("is a file, not a directory", ...)."""
    path: Path
    problem: str


def unwritable(out_dir: Path, make_parents: bool) -> Unwritable | None:
    """Why `out_dir` (which must not exist yet) cannot be created; None where it can. With
    `make_parents`, missing folders above it are made by the writer, so the nearest existing one
    is what must be a writable directory; without, its parent must already be one."""
    out_dir = Path(out_dir)
    nearest = out_dir.parent
    while not nearest.exists() and nearest != nearest.parent:
        nearest = nearest.parent
    if not nearest.is_dir():
        return Unwritable(nearest, "is a file, not a directory")
    if not make_parents and nearest != out_dir.parent:
        return Unwritable(out_dir.parent, "does not exist")
    if not os.access(nearest, os.W_OK | os.X_OK):
        return Unwritable(nearest, "is not writable")
    return None
