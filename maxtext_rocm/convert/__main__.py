"""python -m maxtext_rocm.convert {from-hf,to-hf} SRC OUT_DIR [options]; see maxtext_rocm/convert/__init__.py."""

from __future__ import annotations

import sys
from pathlib import Path

USAGE = """usage:
  python -m maxtext_rocm.convert from-hf HF_DIR OUT_DIR [--config.GROUP.KEY=VALUE ...]
  python -m maxtext_rocm.convert to-hf CHECKPOINT_DIR OUT_DIR [--dtype float32|bfloat16|float16] [--max-shard-size 5GB]
                                   [--adapter]  (a LoRA run: its PEFT adapter, not the merged model)"""


def _options(args: list[str], names: tuple[str, ...]) -> dict[str, str]:
    from maxtext_rocm.convert import ConvertError

    options, i = {}, 0
    while i < len(args):
        key, has_value, value = args[i].partition("=")
        if key not in names:
            raise ConvertError(f"unknown option {args[i]!r}; to-hf takes {', '.join(names)}")
        if not has_value:
            if i + 1 >= len(args):
                raise ConvertError(f"option {key} needs a value")
            i, value = i + 1, args[i + 1]
        options[key.lstrip("-").replace("-", "_")] = value
        i += 1
    return options


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) < 3 or argv[0] not in ("from-hf", "to-hf"):
        print(USAGE, file=sys.stderr)
        return 2
    from maxtext_rocm.config import UserError
    from maxtext_rocm.convert import checkpoint_to_hf, export_note, hf_to_export, import_note

    command, source, out, rest = argv[0], argv[1], argv[2], argv[3:]
    try:
        if command == "from-hf":
            written = Path(hf_to_export(source, out, overrides=rest))
            note = import_note(source)
            if note:
                print(note)
            print(f"wrote {written} (fine-tune from it: python -m maxtext_rocm.train {written / 'preset.py'} "
                  "--config.data.paths=YOUR_DATA.jsonl; docs/finetuning.md)")
        else:
            adapter = "--adapter" in rest  # a flag: the LoRA run's PEFT adapter instead of the merged model
            options = _options([a for a in rest if a != "--adapter"], ("--dtype", "--max-shard-size", "--adapter"))
            written = checkpoint_to_hf(source, out, adapter=adapter, **options)
            note = export_note(source, options.get("dtype"))
            if note:
                print(note)
            print(f"wrote {written}")
    except UserError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
