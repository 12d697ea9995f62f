"""Records of `data.format` chat / prompt_completion / preference -> token ids with a trained mask.

A chat is rendered whole with its template (data/chat_template.py) and tokenized whole, as
transformers' `apply_chat_template(..., tokenize=True)` does. Which characters an assistant wrote
is what the template's `{% generation %}` blocks hold, where it has them (as transformers'
`return_assistant_tokens_mask` reads them; Qwen3's published template is read through its marked
copy, data/builtin_templates.py); otherwise it is found by rendering prefixes: the conversation up to an assistant turn with the generation
prompt (`<|start_header_id|>assistant<|end_header_id|>\\n\\n`) ends where its reply starts, and the
conversation through that turn ends where it stops (after the end-of-turn token, trailing
whitespace excluded). Both must be prefixes of the whole rendering, which holds for templates
that render each turn independently of the later ones. Character spans become token spans by
tokenizing the text before each boundary: where those ids are a prefix of the whole text's ids,
the boundary falls between tokens; otherwise the token that straddles it counts as inside the span,
as transformers' `return_assistant_tokens_mask` counts every token that overlaps a span.
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np

from maxtext_rocm.data.chat_template import ChatTemplate, TemplateError, encode_rendered
from maxtext_rocm.data.checks import DataError
from maxtext_rocm.data.example import TokenizedExample


class PreferencePair(NamedTuple):
    """One preference record: prompt + chosen and prompt + rejected, each trained on its response only."""

    chosen: TokenizedExample
    rejected: TokenizedExample


def assistant_spans(template: ChatTemplate, messages: list[dict], text: str, marked: list, only_last: bool,
                    where: str):
    """Character spans [start, end) of `text` (the whole rendering) that the assistant turns wrote:
    the template's `{% generation %}` blocks (`marked`, as render_marked found them) where it has
    them, else found by rendering prefixes."""
    if marked:  # transformers' return_assistant_tokens_mask reads these same blocks
        return marked[-1:] if only_last else marked
    spans = []
    turns = [k for k, m in enumerate(messages) if m["role"] == "assistant"]
    for k in turns[-1:] if only_last else turns:
        before = template.render(messages[:k], add_generation_prompt=True)
        through = template.render(messages[:k + 1])
        if not (text.startswith(before) and text.startswith(through) and len(before) <= len(through)):
            if k == 0:  # e.g. Llama 3's template writes BOS with the first message, not before none
                raise TemplateError(f"{where}: the conversation starts with an assistant turn, which the chat "
                                    f"template ({template.where}) renders differently alone; start it with a system "
                                    "or user message, or set data.train_on_prompt=true")
            raise TemplateError(f"{where}: the chat template ({template.where}) renders an earlier part of this "
                                "conversation differently once later turns follow, so the assistant's words cannot "
                                "be located; mark them with {% generation %} in a copy of the template given as "
                                "data.chat_template (the built-in 'qwen3' is Qwen3's so marked), or set "
                                "data.train_on_prompt=true")
        spans.append((len(before), max(len(before), len(through.rstrip()))))
    return spans


def _token_boundary(tokenizer, text: str, ids: list[int], char: int, end: bool) -> int:
    """The token index where character `char` of `text` falls (see the module's doc)."""
    if char >= len(text):
        return len(ids)
    prefix = encode_rendered(tokenizer, text[:char])
    same = next((i for i, (a, b) in enumerate(zip(prefix, ids)) if a != b), min(len(prefix), len(ids)))
    if same == len(prefix):
        return same
    return same + 1 if end else same  # ids[same] straddles the boundary: it overlaps the span


def chat_example(template: ChatTemplate, tokenizer, messages: list[dict], train_on_prompt: bool = False,
                 only_last: bool = False, where: str = "a conversation") -> TokenizedExample:
    """Token ids of the rendered conversation; `trained` on every assistant turn's tokens (only
    the last with `only_last`), or on every token with `train_on_prompt`."""
    text, marked = template.render_marked(messages)
    ids = encode_rendered(tokenizer, text)
    if train_on_prompt:
        return TokenizedExample(np.asarray(ids, np.int32), None)
    trained = np.zeros(len(ids), bool)
    for start, stop in assistant_spans(template, messages, text, marked, only_last, where):
        first = _token_boundary(tokenizer, text, ids, start, end=False)
        trained[first:_token_boundary(tokenizer, text, ids, stop, end=True)] = True
    return TokenizedExample(np.asarray(ids, np.int32), trained)


def _plain(tokenizer, prompt: str, response: str, bos: bool, eos: bool, train_on_prompt: bool) -> TokenizedExample:
    """A plain-text prompt and response: [BOS] prompt response [EOS], trained on response + EOS."""
    head = tokenizer.encode(prompt, bos=bos and tokenizer.bos_id is not None)
    tail = tokenizer.encode(response, eos=eos and tokenizer.eos_id is not None)
    trained = np.concatenate([np.full(len(head), train_on_prompt), np.ones(len(tail), bool)])
    return TokenizedExample(np.concatenate([head, tail]).astype(np.int32), None if train_on_prompt else trained)


class Tokenize:
    """record -> TokenizedExample (chat, prompt_completion) or PreferencePair (preference)."""

    def __init__(self, fmt: str, tokenizer, template: ChatTemplate | None, train_on_prompt: bool = False,
                 bos: bool = True, eos: bool = True):
        self.fmt, self.tokenizer, self.template = fmt, tokenizer, template
        self.train_on_prompt, self.bos, self.eos = train_on_prompt, bos, eos

    def _response(self, prompt, response: str, where: str, train_on_prompt: bool) -> TokenizedExample:
        if isinstance(prompt, str):
            return _plain(self.tokenizer, prompt, response, self.bos, self.eos, train_on_prompt)
        messages = prompt + [{"role": "assistant", "content": response}]
        return chat_example(self.template, self.tokenizer, messages, train_on_prompt, only_last=True, where=where)

    def __call__(self, item):
        record, where = item
        try:
            if self.fmt == "chat":
                return chat_example(self.template, self.tokenizer, record["messages"], self.train_on_prompt,
                                    where=where)
            if self.fmt == "prompt_completion":
                return self._response(record["prompt"], record["completion"], where, self.train_on_prompt)
            return PreferencePair(self._response(record["prompt"], record["chosen"], where, False),
                                  self._response(record["prompt"], record["rejected"], where, False))
        except TemplateError as error:
            message = str(error)
            raise DataError(message if message.startswith(where) else f"{where}: {message}") from None


def check_trained_within(example: TokenizedExample, seq_len: int, where: str) -> None:
    """Without packing a row holds the first seq_len + 1 tokens: refuse an example whose every
    trained token lies past them (it would train nothing and cost a row)."""
    trained = example.trained
    if trained is None or len(example.tokens) <= seq_len + 1 or trained[1:seq_len + 1].any():
        return
    raise DataError(f"{where} has {len(example.tokens)} tokens, more than train.seq_len={seq_len} holds, and all "
                    f"{int(trained.sum())} of its trained (assistant) tokens lie past them and would be cut; raise "
                    "train.seq_len, shorten it, or set data.packing='concat' (or 'best_fit': both cut, never truncate)")


class FormatDataset(NamedTuple):
    """The records of data.format chat / prompt_completion / preference and what tokenizes them."""

    records: object  # data/records.py's Records
    tokenize: Tokenize
    key: tuple  # data/kept.py's kept_key: finds what the start-up check kept


def format_dataset(files, data_cfg, tokenizer) -> FormatDataset:
    from maxtext_rocm.data.chat_template import load_chat_template
    from maxtext_rocm.data.kept import kept_key
    from maxtext_rocm.data.records import Records

    fmt = data_cfg.get("format", "text")
    records = Records(files, fmt)
    template = load_chat_template(data_cfg, tokenizer) if records.has_messages else None
    tokenize = Tokenize(fmt, tokenizer, template, bool(data_cfg.get("train_on_prompt", False)),
                        data_cfg.get("add_bos", True), data_cfg.get("add_eos", True))
    return FormatDataset(records, tokenize, kept_key(files, tokenize))


def role_pattern(record: dict) -> tuple:
    """The sequence of roles a record renders (a plain-text prompt: none)."""
    messages = record.get("messages", record.get("prompt"))
    return tuple(m["role"] for m in messages) if isinstance(messages, list) else ()


class FormatSource(NamedTuple):
    """What FilesSource reads for a data.format other than text."""

    records: object  # data/records.py's Records: len(), where(i)
    dataset: object  # grain.MapDataset of TokenizedExample or PreferencePair
    packer: type  # RowPacker, or PairPacker / PackedPairs for preference


def format_source(files, data_cfg, tokenizer, local_rows: int) -> FormatSource:
    """The records, their examples (those the start-up check tokenized, taken from it: data/kept.py)
    and the packer of their rows."""
    import grain

    from maxtext_rocm.data.kept import TokenizedRecords, take_kept
    from maxtext_rocm.data.packing import RowPacker
    from maxtext_rocm.data.preference import PairPacker

    records, tokenize, key = format_dataset(files, data_cfg, tokenizer)
    dataset = grain.MapDataset.source(TokenizedRecords(records, tokenize, take_kept(key)))
    if data_cfg.get("format") != "preference":
        return FormatSource(records, dataset, RowPacker)
    if local_rows % 2:
        raise DataError(f"data.format='preference' puts each pair in two rows, but this process has {local_rows} "
                        "rows of the global batch; make train.per_device_batch_size x local devices even")
    from maxtext_rocm.data.packed_pairs import PackedPairs, packs_pairs

    if packs_pairs(data_cfg):
        return FormatSource(records, dataset, PackedPairs)
    return FormatSource(records, dataset, PairPacker)


def trains_a_token(example: TokenizedExample) -> bool:
    """Whether a row of `example` carries loss somewhere: a target (every token but the first) that
    is trained (data/packing.py weighs token i + 1 by trained[i + 1])."""
    return len(example.tokens) >= 2 and (example.trained is None or bool(example.trained[1:].any()))


def usable_pair(pair: PreferencePair, seq_len: int | None) -> bool:
    """Whether a preference pair moves DPO at all: its two rows, as truncated into seq_len, differ
    (identical rows have identical log-probabilities: the loss stays at ln 2, the gradient at 0)."""
    from maxtext_rocm.data.preference import truncate_pair

    chosen, rejected = truncate_pair(*pair, seq_len) if seq_len else pair
    if not (trains_a_token(chosen) or trains_a_token(rejected)):
        return False
    return not (np.array_equal(chosen.tokens, rejected.tokens) and np.array_equal(chosen.trained, rejected.trained))


def check_pair_fits(pair: PreferencePair, seq_len: int, where: str) -> None:
    """A packed pair's two sequences fit one row together (a pair is never cut across rows)."""
    from maxtext_rocm.data.packed_pairs import pair_positions

    positions = pair_positions(pair, seq_len)
    if positions > seq_len:
        raise DataError(f"{where}: this preference pair's chosen and rejected sequences take {positions} positions "
                        f"together, more than a packed row of train.seq_len={seq_len}; raise train.seq_len to "
                        f"{positions} or more, or set data.packing='none' (one sequence per row)")


def _names(files) -> str:
    return ", ".join(str(f) for f in files[:3]) + (f" and {len(files) - 3} more" if len(files) > 3 else "")


def check_format_inputs(files, data_cfg, tokenizer, seq_len: int | None, key: str = "data.paths") -> None:
    """Before any device work: every record's shape (Records); the chat template writes the
    assistant's words (chat_template.reply_problem); the template renders and masks the first
    record of each sequence of roles (a template refuses a role or an order of turns, e.g. "roles
    must alternate", by the roles, so one of each is rendered, not every record); without packing
    (chat, prompt_completion) no example loses every trained token to the row's end, which
    tokenizes every record once (so do preference pairs padded to data.buckets, whose batches are
    planned from every length); and the data trains something: some record leaves a trained token
    (preference: some pair whose rows differ). Usually the first record does, so that costs
    nothing more; data that trains nothing costs one pass over it, once, to be refused. What it
    tokenized is kept for the source that trains on it (data/kept.py), so no record is tokenized
    twice in a start-up."""
    from maxtext_rocm.data.buckets import row_buckets
    from maxtext_rocm.data.chat_template import load_chat_template, reply_problem
    from maxtext_rocm.data.kept import KeptExamples, TokenizedRecords, leave_for_source

    records, tokenize, kept_as = format_dataset(files, data_cfg, tokenizer)
    dataset = TokenizedRecords(records, tokenize)
    if records.has_messages:
        problem = reply_problem(load_chat_template(data_cfg, tokenizer))
        if problem:
            raise TemplateError(problem)
    preference = data_cfg.get("format") == "preference"
    unpacked = data_cfg.get("packing", "concat") == "none"  # the one mode that truncates
    within = not preference and unpacked and seq_len
    # Batches planned over buckets need every record's length (data/bucketed.py): all are tokenized.
    # Packed pairs are never cut: every pair is measured against a row (data/packed_pairs.py).
    from maxtext_rocm.data.packed_pairs import packs_pairs

    packed = packs_pairs(data_cfg) and seq_len
    exhaustive = within or packed or (seq_len and row_buckets(data_cfg, seq_len))
    trains = lambda item: usable_pair(item, seq_len) if preference else trains_a_token(item)  # noqa: E731
    seen, trained = set(), False
    kept = KeptExamples(len(records), owners=(tokenize.tokenizer, tokenize.template))
    for index in range(len(records)):
        if not exhaustive:
            pattern = role_pattern(records[index][0])
            if pattern in seen:
                continue
            seen.add(pattern)
        example = dataset[index]
        kept.keep(index, example)
        trained = trained or trains(example)
        if within:
            check_trained_within(example, seq_len, records.where(index))
        if packed:
            check_pair_fits(example, seq_len, records.where(index))
    if not trained and not any(trains(dataset[index]) for index in range(len(records))):
        raise _trains_nothing(data_cfg, files, key)
    leave_for_source(kept_as, kept)


def _trains_nothing(data_cfg, files, key: str) -> DataError:
    fmt = data_cfg.get("format")
    if fmt == "preference":
        return DataError(f"no pair of {key} ({_names(files)}) has a chosen response that differs from its rejected "
                         "one, so DPO would stay at ln 2 with no gradient; give pairs whose chosen and rejected "
                         "responses differ")
    what = "assistant turn" if fmt == "chat" else "completion"
    eos = "" if data_cfg.get("add_eos", True) or fmt == "chat" else ", or set data.add_eos=true to train each end"
    return DataError(f"no record of {key} ({_names(files)}) leaves a token to train on (every weight would be 0, "
                     f"and so the loss and the gradient at every step); give records whose {what} is not empty{eos}")
