"""Where a checkpoint came from: the Hugging Face model that an export, a run or a run's export
descends from, and the generation config `to-hf` writes for it.

`from-hf` records in its export's config.json the original's config.json (`hf_config`), its
generation_config.json where the folder had one (`generation_config`), and the folder itself
(`converted_from`). A run started from that export, full or LoRA, points at it through
`checkpoint.load_params_from`, as does a run started from that run's `checkpoint export`: the
pointers are followed to the record that holds the original, so every kind of run is exported
with the original's token ids, context length and generation config by one path.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from maxtext_rocm.convert.hf_config import ConvertError

MAX_HOPS = 32  # run -> export -> run -> ...: more than anyone chains, few enough to stop a cycle
TOKEN_KEYS = ("bos_token_id", "eos_token_id", "pad_token_id")


@dataclass(frozen=True)
class Origin:
    """The Hugging Face original of a checkpoint, as far as it is known (None where it is not)."""

    hf_config: dict[str, Any] | None = None  # its config.json
    generation_config: dict[str, Any] | None = None  # its generation_config.json, where it had one
    hf_dir: Path | None = None  # the folder it was converted from, where it still holds the model


def find_record(path: Path) -> tuple[dict, Path]:
    """The config.json record of an export, a run directory, its checkpoints/ or one checkpoint."""
    for folder in (path, path.parent, path.parent.parent):
        candidate = folder / "config.json"
        if candidate.is_file():
            try:
                record = json.loads(candidate.read_text())
            except ValueError:
                continue
            if isinstance(record, dict) and "config" in record:
                return record, candidate
    raise ConvertError(f"found no config.json of a run or export at or above {path}; give a directory written "
                       "by `from-hf`, `maxtext_rocm.checkpoint export` or a training run")


def parameters_from(record: dict) -> str:
    """The checkpoint.load_params_from of a record's config ('' where the run started from scratch)."""
    checkpoint = (record.get("config") or {}).get("checkpoint") or {}
    return str(checkpoint.get("load_params_from") or "")


def find_origin(record: dict) -> Origin:
    """The original of the checkpoint `record` describes: the record's own, or that of the export
    its parameters were loaded from, followed as far as it goes."""
    seen: set[Path] = set()
    for _ in range(MAX_HOPS):
        if record.get("hf_config") is not None:
            return _recorded_origin(record)
        pointer = parameters_from(record)
        if not pointer:
            return Origin()
        path = Path(pointer).absolute()
        if path in seen or not path.is_dir():
            return Origin()
        seen.add(path)
        try:
            record, _ = find_record(path)
        except ConvertError:
            return Origin()
    return Origin()


def _recorded_origin(record: dict) -> Origin:
    folder = Path(record["converted_from"]) if record.get("converted_from") else None
    hf_dir = folder if folder is not None and (folder / "config.json").is_file() else None
    generation = record.get("generation_config")
    if generation is None and hf_dir is not None:  # an export written before from-hf recorded it
        generation = read_generation_config(hf_dir)
    return Origin(record["hf_config"], generation, hf_dir)


def read_generation_config(hf_dir: Path) -> dict[str, Any] | None:
    """A Hugging Face folder's generation_config.json, or None where it has none (or an unreadable one,
    which transformers would not read either)."""
    path = Path(hf_dir) / "generation_config.json"
    try:
        generation = json.loads(path.read_text()) if path.is_file() else None
    except ValueError:
        return None
    return generation if isinstance(generation, dict) else None


def chat_stop_ids(cfg) -> tuple[int, ...]:
    """The token ids a reply of a run that trains chats ends with: its chat template's end-of-turn
    token (Llama 3: <|eot_id|>) and the tokenizer's EOS, found as `generate --chat` finds them; ()
    for a run on plain text. Preference data and GRPO's prompts are rendered with the template
    where there is one."""
    from maxtext_rocm.config import UserError
    from maxtext_rocm.data.chat_template import end_of_turn, load_chat_template
    from maxtext_rocm.data.tokenizer import load_tokenizer

    data = cfg.get("data")
    if data is None or data.get("format") not in ("chat", "preference", "prompt"):
        return ()
    try:
        tokenizer = load_tokenizer(data.tokenizer)
        template = load_chat_template(data, tokenizer)
    except UserError as error:
        # The weights export without it (the tokenizer is not needed for them): say what is missing.
        if data.format == "chat":
            print(f"warning: the run's chat template cannot be read now ({error}), so generation_config.json "
                  "lists no end-of-turn token among eos_token_id; add it there by hand", file=sys.stderr)
        return ()
    return end_of_turn(template, tokenizer).stop_ids


def generation_config(origin: Origin, cfg) -> dict[str, Any] | None:
    """generation_config.json for an export of `cfg`'s run: the original's where it had one, else
    its token ids; a run that trained chats stops at its end-of-turn token too (eos_token_id lists
    it, so transformers' generate ends a reply there). None where nothing is known."""
    out = dict(origin.generation_config or {})
    if not out:
        out = {key: origin.hf_config[key] for key in TOKEN_KEYS if (origin.hf_config or {}).get(key) is not None}
    stops = chat_stop_ids(cfg)
    if stops:
        eos = out.get("eos_token_id")
        eos = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
        eos += [i for i in stops if i not in eos]
        out["eos_token_id"] = eos[0] if len(eos) == 1 else eos
    return out or None
