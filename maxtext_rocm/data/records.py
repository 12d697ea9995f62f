"""JSON Lines records for the formats beyond plain text (`data.format`): chats, prompt/completion
pairs and preference triples, each line checked before the run starts, so a bad record is one
sentence naming its file and line, not a failure at the step that reaches it.

    chat               {"messages": [{"role": "user", "content": "..."}, {"role": "assistant", ...}]}
    prompt_completion  {"prompt": "..." or messages, "completion": "..."}
    preference         {"prompt": "..." or messages, "chosen": "...", "rejected": "..."}
    prompt             {"prompt": "..." or messages, ...any fields a reward reads}  (GRPO)

(Documents in data/documents.py reads text; when it gives whole records, this can read through it.)
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from maxtext_rocm.data import filehash
from maxtext_rocm.data.chat_template import ROLES
from maxtext_rocm.data.checks import FORMAT_FIELDS, DataError, _version, format_hint, json_record
from maxtext_rocm.data.documents import JSONL, file_format

FORMATS = ("text", "chat", "prompt_completion", "preference", "prompt")
# File versions whose every line passed, per format -> whether some prompt is a list of messages.
_CHECKED: dict[tuple, bool] = {}


def check_messages(messages, where: str, field: str = "messages", need_assistant: bool = True) -> None:
    if not isinstance(messages, list) or not messages:
        raise DataError(f"{where}: {field!r} is not a non-empty list of {{\"role\", \"content\"}} messages")
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or "role" not in message or "content" not in message:
            raise DataError(f"{where}: {field}[{i}] is not a {{\"role\", \"content\"}} message")
        if message["role"] not in ROLES:
            raise DataError(f"{where}: {field}[{i}] has role {message['role']!r}; use one of {', '.join(ROLES)}")
        if not isinstance(message["content"], str):
            raise DataError(f"{where}: {field}[{i}] content is {type(message['content']).__name__}, not a string")
    if need_assistant and not any(m["role"] == "assistant" for m in messages):
        raise DataError(f"{where}: the conversation has no assistant turn, so nothing of it would be trained; "
                        "give each chat at least one assistant message")


def check_record(record, fmt: str, where: str) -> None:
    """One sentence naming `where` (file and line) for a record `fmt` cannot use."""
    if not isinstance(record, dict):
        raise DataError(f"{where} is not a JSON object; data.format={fmt!r} needs {{{', '.join(FORMAT_FIELDS[fmt])}}}")
    missing = [k for k in FORMAT_FIELDS[fmt] if k not in record]
    if missing:
        raise DataError(f"{where} has no {missing[0]!r}, which data.format={fmt!r} needs; its fields are: "
                        f"{', '.join(record) or 'none'}{format_hint(record, fmt)}")
    if fmt == "chat":
        return check_messages(record["messages"], where)
    prompt = record["prompt"]
    if isinstance(prompt, list):
        check_messages(prompt, where, "prompt", need_assistant=False)
    elif not isinstance(prompt, str):
        raise DataError(f"{where}: 'prompt' is {type(prompt).__name__}; give a string or a list of messages")
    for key in FORMAT_FIELDS[fmt][1:]:
        if not isinstance(record[key], str):
            raise DataError(f"{where}: {key!r} is {type(record[key]).__name__}, not a string")


class Records:
    """Random access to the checked records of JSON Lines files: `records[i]` -> (record, where)."""

    def __init__(self, files: list[Path], fmt: str):
        self.fmt, self.pretokenized, self.meta = fmt, False, {}
        self._lines, self._where = [], []
        self.has_messages = fmt == "chat"  # some record needs the chat template
        for path in files:
            if file_format(path) != JSONL:
                raise DataError(f"{path}: data.format={fmt!r} reads JSON Lines (.jsonl) records; convert it or "
                                "use data.format='text'")
            stat = path.stat()
            data = path.read_bytes()
            filehash.of_bytes(filehash.version(path, stat), data)  # the fingerprint's hash, from this one reading
            numbered = [(n, line) for n, line in enumerate(data.splitlines(), 1) if line.strip()]
            if not numbered:
                raise DataError(f"{path} is empty (no JSON lines); give it records")
            key = _version(path, fmt)
            if key not in _CHECKED:
                chats = False
                for number, line in numbered:
                    record = json_record(line, path, number)
                    check_record(record, fmt, f"{path} line {number}")
                    chats = chats or isinstance(record.get("prompt"), list)
                _CHECKED[key] = chats
            self.has_messages = self.has_messages or _CHECKED[key]
            self._lines += [line for _, line in numbered]
            self._where += [(path, number) for number, _ in numbered]
        self._lines = np.asarray(self._lines, dtype=object)

    def __len__(self) -> int:
        return len(self._lines)

    def where(self, index: int) -> str:
        path, number = self._where[index]
        return f"{path} line {number}"

    def __getitem__(self, index: int):
        return json.loads(self._lines[index]), self.where(index)
