"""The checkpoint command line:

    python -m maxtext_rocm.checkpoint export RUN_DIR OUT_DIR [--step N]
    python -m maxtext_rocm.checkpoint verify DIR

`export` writes a params-only export (`OUT_DIR/params` + `checksums.json` + `config.json`) that
`checkpoint.load_params_from` (or a notebook) starts from; of a LoRA run, its merged model.
`verify` checks the parameters of a run's newest intact step, of one step or of an export against
their checksums; of a LoRA run, its adapters and its base (finetune/lora_base.py).
"""

from __future__ import annotations

import sys

from maxtext_rocm.checkpoint.params import export_params, verify_params
from maxtext_rocm.errors import UserError


def _step(text: str) -> int:
    if not text.isdigit():
        raise UserError(f"--step {text!r} is not a step number; give a saved step such as --step 100, or leave "
                        "--step out for the newest intact checkpoint")
    return int(text)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    usage = ("usage: python -m maxtext_rocm.checkpoint export RUN_DIR OUT_DIR [--step N]\n"
             "       python -m maxtext_rocm.checkpoint verify DIR   (a run, one of its checkpoints/<step>, an export)")
    export = len(argv) in (3, 5) and argv[0] == "export" and (len(argv) == 3 or argv[3] == "--step")
    if not (export or (len(argv) == 2 and argv[0] == "verify")):
        print(usage, file=sys.stderr)
        return 2
    try:
        if argv[0] == "verify":
            print(verify_params(argv[1]))
        else:
            step = _step(argv[4]) if len(argv) == 5 else None
            print(f"wrote {export_params(argv[1], argv[2], step)}")
    except (UserError, ValueError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    return 0
