"""One tokenized document as the packer receives it."""
from __future__ import annotations

from typing import NamedTuple

import numpy as np


class TokenizedExample(NamedTuple):
    """A document's token ids and which of them carry loss as targets.

    `trained[i]` says whether predicting token i (from tokens[:i]) is trained: False on a chat's
    prompt and user turns, True on what the model should learn to write. None trains every token.
    A plain int32 array is accepted wherever a TokenizedExample is, as one with trained=None.
    """

    tokens: np.ndarray  # int32 [n]
    trained: np.ndarray | None = None  # bool [n], or None: every token is a target


def as_example(item) -> TokenizedExample:
    if isinstance(item, tuple) and hasattr(item, "_fields"):  # a TokenizedExample, or a pair of them (preference)
        return item
    return TokenizedExample(np.asarray(item, np.int32))
