"""Prompts for sampling (data.format="prompt", GRPO): JSON Lines records with a "prompt" (a string,
or a list of messages) and any other fields a reward reads ("answer", test cases, ...).

A list of messages is rendered with the run's chat template and its generation prompt. A string
is rendered the same way, as one user message, where the run has a template (data.chat_template,
or the tokenizer's own); with none (the byte tokenizer, a tokenizer file without one) it is plain
text after BOS. Completions stop at the template's end of turn (and EOS), else at EOS.

Every prompt is tokenized once per start-up and checked to fit the row before any device work:
one longer than train.seq_len less grpo.max_new_tokens is refused in one sentence naming it. Step
s takes prompts s*P .. s*P + P - 1 of an endless sequence of passes over the records, each pass
in its own order (a permutation seeded by data.seed and the pass), so a resumed run takes the
same prompts at each step as the uninterrupted one, with no data state to save.
"""
from __future__ import annotations

import functools
from typing import NamedTuple

import numpy as np

from maxtext_rocm.data.checks import DataError
from maxtext_rocm.data.documents import expand_paths
from maxtext_rocm.errors import ConfigError


class Prompt(NamedTuple):
    record: dict  # the whole JSON record: what a reward reads
    where: str  # its file and line, for the sentences that name it
    tokens: np.ndarray  # int32: the rendered prompt's token ids


class Prompts(NamedTuple):
    """The prompts of data.paths, tokenized, and the ids a completion stops at."""
    prompts: tuple[Prompt, ...]
    stop_ids: tuple[int, ...]
    seed: int

    def for_step(self, step: int, count: int) -> list[Prompt]:
        """The `count` prompts of step `step` (see the module's doc)."""
        n = len(self.prompts)
        first = step * count
        return [self.prompts[int(_order(self.seed, n, i // n)[i % n])] for i in range(first, first + count)]


@functools.lru_cache(maxsize=4)
def _order(seed: int, n: int, epoch: int) -> np.ndarray:
    return np.random.default_rng([seed, epoch]).permutation(n)


def _template_or_none(data_cfg, tokenizer, needed: bool):
    """The run's chat template, or None where it has none and no record needs one."""
    from maxtext_rocm.data.chat_template import load_chat_template

    try:
        return load_chat_template(data_cfg, tokenizer)
    except ConfigError:
        if needed or data_cfg.get("chat_template", ""):
            raise
        return None


def load_prompts(data_cfg, tokenizer, max_prompt_len: int) -> Prompts:
    """Every prompt of data.paths tokenized (memoised per start-up: the preflight check and the
    trainer share one reading); a DataError names the first that does not fit `max_prompt_len`."""
    from maxtext_rocm.data import filehash

    files = expand_paths(data_cfg.paths, "data.paths")
    versions = tuple(filehash.version(path, path.stat()) for path in files)
    settings = (data_cfg.get("chat_template", ""), bool(data_cfg.get("add_bos", True)), int(data_cfg.get("seed", 0)))
    return _load(tuple(files), versions, settings, tokenizer, max_prompt_len, data_cfg)


_LOADED: dict[tuple, Prompts] = {}


def _load(files, versions, settings, tokenizer, max_prompt_len, data_cfg) -> Prompts:
    from maxtext_rocm.data.chat_template import encode_rendered, end_of_turn
    from maxtext_rocm.data.records import Records

    key = (versions, settings, getattr(tokenizer, "path", "byte"), max_prompt_len)
    if key in _LOADED:
        return _LOADED[key]
    records = Records(list(files), "prompt")
    template = _template_or_none(data_cfg, tokenizer, records.has_messages)
    bos = settings[1] and tokenizer.bos_id is not None
    prompts = []
    for index in range(len(records)):
        record, where = records[index]
        prompt = record["prompt"]
        if template is None:
            tokens = tokenizer.encode(prompt, bos=bos)
        else:
            messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
            tokens = encode_rendered(tokenizer, template.render(messages, add_generation_prompt=True))
        if len(tokens) > max_prompt_len:
            raise DataError(f"{where}: the prompt is {len(tokens)} tokens, more than the {max_prompt_len} that "
                            "train.seq_len less grpo.max_new_tokens leaves for it; raise train.seq_len, lower "
                            "grpo.max_new_tokens, or shorten the prompt")
        if not len(tokens):
            raise DataError(f"{where}: the prompt renders to no token; give it some text")
        prompts.append(Prompt(record, where, np.asarray(tokens, np.int32)))
    if template is not None:
        stop = end_of_turn(template, tokenizer).stop_ids
    else:
        stop = () if tokenizer.eos_id is None else (int(tokenizer.eos_id),)
    loaded = _LOADED[key] = Prompts(tuple(prompts), tuple(stop), settings[2])
    return loaded
