"""The output folder of a conversion: checked before anything is read, written whole or not at all.

Everything goes into a temporary folder beside OUT_DIR (same filesystem, so the final rename is
atomic) which becomes OUT_DIR at the end; a failure removes it, so nothing is left behind. A folder
that cannot be written (its parent missing, a file, or not writable) is one sentence naming it.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from pathlib import Path
from typing import Iterator

from maxtext_rocm.checkpoint.destination import unwritable
from maxtext_rocm.convert.hf_config import ConvertError


def check_output_dir(out_dir: Path) -> None:
    """Refuses an OUT_DIR that exists or cannot be created, naming the path at fault."""
    out_dir = Path(out_dir)
    if out_dir.exists():
        raise ConvertError(f"{out_dir} already exists; choose a new directory for the output")
    fault = unwritable(out_dir, make_parents=False)
    if fault is not None:
        there, fix = ((" there", "choose another output directory") if fault.problem != "does not exist" else
                      ("", "create it or choose another output directory"))
        raise ConvertError(f"{fault.path} {fault.problem}, so {out_dir} cannot be created{there}; {fix}")


@contextlib.contextmanager
def written_atomically(out_dir: Path) -> Iterator[Path]:
    """Yields a fresh temporary folder to write into, which becomes `out_dir` when the block ends
    without an error; on an error it is removed, and an OSError becomes one sentence."""
    out_dir = Path(out_dir)
    check_output_dir(out_dir)
    tmp = out_dir.parent / f".{out_dir.name}.tmp-{os.getpid()}"
    try:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        yield tmp
        tmp.rename(out_dir)
    except OSError as error:
        shutil.rmtree(tmp, ignore_errors=True)
        reason = error.strerror or str(error)
        raise ConvertError(f"could not write {out_dir}: {reason}"
                           f"{f' ({error.filename})' if error.filename and str(error.filename) != str(out_dir) else ''}"
                           "; choose a writable output directory with room for the model") from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
