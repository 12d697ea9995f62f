"""What `convert from-hf` sets beyond the model: the keys that make its preset a fine-tuning one,
and the preset file itself.

A fine-tuning preset trains on the user's files (`data.source="files"`; `data.paths` is asked for
with one sentence when the training command does not give it, instead of falling back to random
tokens), tokenized by the Hugging Face folder's own tokenizer (absolute path, so the preset works
from any directory), rendered as chats where that tokenizer has a chat template, at the published
context length (`max_position_embeddings`).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Mapping

import ml_collections

from maxtext_rocm import config as config_lib

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model")
# What transformers' AutoTokenizer reads from a folder, copied by `to-hf` beside the weights.
TOKENIZER_FOLDER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "special_tokens_map.json",
                          "chat_template.jinja")


def tokenizer_files(spec: str) -> list[Path]:
    """The tokenizer files of the folder `data.tokenizer` names a file of (none for "byte")."""
    path = Path(str(spec).partition(":")[2] if str(spec).partition(":")[0] in ("hf", "sentencepiece", "tiktoken")
                else str(spec)).expanduser()
    if spec in ("", "byte") or not path.exists():
        return []
    folder = path if path.is_dir() else path.parent
    return [folder / name for name in TOKENIZER_FOLDER_FILES if (folder / name).is_file()]


def has_chat_template(folder: Path) -> bool:
    if (folder / "chat_template.jinja").is_file():
        return True
    config = folder / "tokenizer_config.json"
    try:
        return bool(config.is_file() and json.loads(config.read_text()).get("chat_template"))
    except ValueError:
        return False


def finetune_keys(hf_dir: Path, hf: Mapping[str, Any]) -> dict[str, Any]:
    """The run keys (dotted) for fine-tuning the model of `hf_dir` on one's own data."""
    keys: dict[str, Any] = {"data.source": "files"}
    tokenizer = next((hf_dir / n for n in TOKENIZER_FILES if (hf_dir / n).is_file()), None)
    if tokenizer is not None and not _fits(tokenizer, hf.get("vocab_size")):
        tokenizer = None  # the conversion goes on; data.tokenizer stays to be given (the run checks it)
    if tokenizer is not None:
        keys["data.tokenizer"] = str(tokenizer.resolve())
        if has_chat_template(hf_dir):
            keys["data.format"] = "chat"
    if isinstance(hf.get("max_position_embeddings"), int) and hf["max_position_embeddings"] > 0:
        keys["train.seq_len"] = hf["max_position_embeddings"]
    return keys


def _fits(path: Path, vocab_size) -> bool:
    """The tokenizer reads and has no id beyond the model's embedding."""
    from maxtext_rocm.config import UserError
    from maxtext_rocm.data.tokenizer import load_tokenizer

    try:
        return isinstance(vocab_size, int) and load_tokenizer(str(path)).vocab_size <= vocab_size
    except UserError:
        return False


def validate_without_data(cfg) -> None:
    """The run's validation, with `data.paths` left for the training command to give."""
    check = cfg
    if cfg.data.source == "files" and not cfg.data.paths:
        check = ml_collections.ConfigDict(cfg.to_dict())
        check.data.update(source="synthetic", format="text")
    config_lib.validate(check)


def preset_source(cfg, hf_dir: Path) -> str:
    """A preset file that rebuilds `cfg` from the defaults and starts from the export beside it."""
    base, ours = config_lib.defaults().to_dict(), cfg.to_dict()
    lines = [f'"""{cfg.model.family.capitalize()} converted from the Hugging Face folder {hf_dir}.',
             "",
             "Written by `python -m maxtext_rocm.convert from-hf`; the parameters are the export in this",
             "folder, which checkpoint.load_params_from points at. Fine-tuning: give your files with",
             '--config.data.paths=... (docs/finetuning.md)."""',
             "",
             "from pathlib import Path",
             "",
             "from maxtext_rocm.config import apply_variant, defaults",
             "",
             "",
             'def get_config(variant: str = ""):',
             "    cfg = defaults()",
             f"    cfg.name = {cfg.name!r}"]
    for group, values in ours.items():
        if not isinstance(values, dict) or group == "checkpoint":
            continue
        changed = {k: v for k, v in values.items() if base[group].get(k) != v}
        if changed:
            body = ", ".join(f"{k}={v!r}" for k, v in changed.items())
            lines.append(f"    cfg.{group}.update({body})")
    lines += ["    cfg.checkpoint.load_params_from = str(Path(__file__).resolve().parent)",
              "    return apply_variant(cfg, variant)", ""]
    return "\n".join(lines)
