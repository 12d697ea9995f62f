"""Examples the start-up check tokenized, kept for the source that trains on them, so that each
record of data.format chat / prompt_completion / preference is tokenized once per start-up.

The check (data/formats.py check_format_inputs, run by the trainer's preflight before anything is
written) tokenizes every record under data.packing='none', to refuse one whose trained tokens all
lie past the row's end, and otherwise the first record of each sequence of roles. The train or eval
source built a few seconds later (data/files.py FilesSource) takes those examples instead of
tokenizing the same records again: under 'none' it then reads every example from memory and
tokenizes nothing, in every epoch. A full set is kept as three flat arrays (ids, trained flags,
offsets: about 5 bytes a token), so holding it costs about what the JSON text of the records does.

What was kept is found by the files' versions (path, size, modification time), the tokenizer and
chat template objects (data/tokenizer.py and chat_template.py cache them per file version) and the
settings that change an example; the source that finds it takes it (the cache lets it go).
"""
from __future__ import annotations

from collections import OrderedDict

import numpy as np

from maxtext_rocm.data.checks import _version
from maxtext_rocm.data.example import TokenizedExample

# At most a train and an eval split of two configs wait to be taken (a check run without a source).
_MAX_WAITING = 4
_WAITING: OrderedDict[tuple, "KeptExamples"] = OrderedDict()


class KeptExamples:
    """Tokenized examples by record index: those the check tokenized, compacted once all are there."""

    def __init__(self, count: int, owners: tuple = ()):
        self.count, self.owners = count, owners  # owners: see leave_for_source
        self._items: dict[int, object] = {}
        self._flat: _FlatExamples | None = None

    def keep(self, index: int, item) -> None:
        self._items[index] = item

    def seal(self) -> None:
        """Compacts a full set of TokenizedExamples (preference pairs stay as they are)."""
        items = self._items
        if len(items) == self.count and all(type(x) is TokenizedExample for x in items.values()):
            self._flat, self._items = _FlatExamples([items[i] for i in range(self.count)]), {}

    def get(self, index: int):
        """The kept example of record `index`, or None where the check did not tokenize it."""
        return self._flat[index] if self._flat is not None else self._items.get(index)


class _FlatExamples:
    """Many TokenizedExamples as one array of ids, one of trained flags (none where every token
    trains) and their offsets; an example read back is a view into them."""

    def __init__(self, examples: list[TokenizedExample]):
        lengths = [len(e.tokens) for e in examples]
        self.offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
        self.tokens = np.concatenate([e.tokens for e in examples]).astype(np.int32)
        masked = [e.trained is not None for e in examples]
        self.has_mask = np.asarray(masked, bool)
        self.trained = (np.concatenate([e.trained if e.trained is not None else np.ones(len(e.tokens), bool)
                                        for e in examples]) if any(masked) else None)

    def __getitem__(self, index: int) -> TokenizedExample:
        start, stop = self.offsets[index], self.offsets[index + 1]
        trained = self.trained[start:stop] if self.has_mask[index] else None
        return TokenizedExample(self.tokens[start:stop], trained)


def kept_key(files, tokenize) -> tuple:
    """What identifies a set of examples: the files' versions, the tokenizer and template objects
    (each cached per file version) and the settings of data/formats.py's Tokenize."""
    return (tuple(_version(path) for path in files), tokenize.fmt, id(tokenize.tokenizer), id(tokenize.template),
            tokenize.train_on_prompt, tokenize.bos, tokenize.eos)


def leave_for_source(key: tuple, kept: KeptExamples) -> None:
    """Keeps `kept` (sealed) until the source of `key` takes it; its owners (the tokenizer and
    template) are held with it, so the ids in `key` stay theirs while it waits."""
    kept.seal()
    _WAITING[key] = kept
    _WAITING.move_to_end(key)
    while len(_WAITING) > _MAX_WAITING:
        _WAITING.popitem(last=False)


def take_kept(key: tuple) -> KeptExamples | None:
    """The set the check kept for `key`, removed from the cache (the source now holds it), or None."""
    return _WAITING.pop(key, None)


class TokenizedRecords:
    """records[i] tokenized: the check's kept example where there is one, else tokenized now."""

    def __init__(self, records, tokenize, kept: KeptExamples | None = None):
        self.records, self.tokenize, self.kept = records, tokenize, kept

    def __len__(self) -> int:
        return len(self.records)

    def __getitem__(self, index: int):
        item = self.kept.get(index) if self.kept is not None else None
        return item if item is not None else self.tokenize(self.records[index])
