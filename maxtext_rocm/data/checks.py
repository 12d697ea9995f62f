"""What every input file is checked for before a run starts, so that a bad line or byte stops the
run with one sentence at launch, not at the step that reaches it (data/files.py reads the files).

Each check runs once per file version in a process: config validation, the train source and a
restart in the same process share it.
"""
from __future__ import annotations

import json
from pathlib import Path

from maxtext_rocm.errors import UserError


class DataError(UserError):
    """An input file that cannot be used: missing, empty, of an unknown kind, or without the text field."""


def json_record(line: bytes, path, number: int):
    """Line `number` of JSON Lines file `path`, parsed (a DataError naming both if it is not UTF-8 JSON)."""
    try:
        return json.loads(line)
    except UnicodeDecodeError as error:
        raise DataError(f"{path} line {number} is not UTF-8 text (byte {error.start} of the line); "
                        "JSON Lines files must be UTF-8") from None
    except ValueError:
        raise DataError(f"{path} line {number} is not valid JSON") from None


# The fields each data.format other than text reads from a JSON line (data/records.py), most
# specific first: a line's fields name the format it was written for.
FORMAT_FIELDS = {"preference": ("prompt", "chosen", "rejected"), "prompt_completion": ("prompt", "completion"),
                 "chat": ("messages",), "prompt": ("prompt",)}


def format_hint(record, given: str, text_field: str = "text") -> str:
    """', which are those of data.format=X: set that' where `record`'s fields fit another format
    than the `given` one (a preference file under data.format='chat'), else ''."""
    if not isinstance(record, dict):
        return ""
    fits = next((fmt for fmt, fields in FORMAT_FIELDS.items() if all(f in record for f in fields)), None)
    if fits is None and isinstance(record.get(text_field), str):
        fits = "text"
    if fits is None or fits == given:
        return ""
    extra = {"preference": " with train.objective='dpo'",
             "text": f" (data.text_field={text_field!r})" if text_field != "text" else ""}.get(fits, "")
    return f", which are those of data.format={fits!r}: set that{extra} if the file is meant so"


def json_text(line: bytes, field: str, path, number: int) -> str:
    record = json_record(line, path, number)
    if not isinstance(record, dict) or field not in record:
        raise DataError(f"{path} line {number} has no field {field!r} (data.text_field); "
                        f"its fields are: {', '.join(record) if isinstance(record, dict) else 'none'}"
                        f"{format_hint(record, 'text', field)}")
    text = record[field]
    if not isinstance(text, str):
        raise DataError(f"{path} line {number}: field {field!r} (data.text_field) is not a string")
    return text


# Text files whose every byte was checked in this process, by version: config validation, the train
# source and a restart within one process check a file once. (JSON Lines lines are checked as their
# offset index is built, data/lineindex.py, which keeps the result beside the file.)
_CHECKED: set[tuple] = set()


def _version(path: Path, *extra) -> tuple:
    stat = path.stat()
    return (str(path.resolve()), stat.st_size, stat.st_mtime_ns, *extra)


def check_text(path: Path) -> None:
    """A text document is UTF-8 and not binary: a NUL byte or an invalid sequence would otherwise be
    trained on as replacement characters."""
    key = _version(path)
    if key in _CHECKED:
        return
    from maxtext_rocm.data import filehash

    stat = path.stat()
    data = path.read_bytes()
    filehash.of_bytes(filehash.version(path, stat), data)  # the fingerprint's hash, from this one reading
    nul = data.find(b"\0")
    if nul >= 0:
        raise DataError(f"{path} holds a NUL byte at offset {nul}, so it is binary, not text; "
                        "give .txt/.md files of UTF-8 text")
    try:
        data.decode("utf-8")
    except UnicodeDecodeError as error:
        raise DataError(f"{path} is not UTF-8 text (invalid byte at offset {error.start}); "
                        "convert it to UTF-8 or leave it out of the data paths") from None
    _CHECKED.add(key)
