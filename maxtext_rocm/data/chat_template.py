"""Chat templates: a conversation (a list of {"role", "content"} messages) rendered to text as
transformers' `tokenizer.apply_chat_template` renders it, and that text turned into token ids.

The template is `data.chat_template` (a Jinja file, or the built-in "llama3" or "qwen3":
data/builtin_templates.py), else the tokenizer's own: `chat_template.jinja` beside the tokenizer.json that `data.tokenizer` names, else the
`chat_template` of the tokenizer_config.json there (transformers reads them in that order); a published template
known to builtin_templates.py is read as its copy with generation marks, the same text. It is
rendered in transformers' Jinja environment: sandboxed, `trim_blocks` and `lstrip_blocks`, the
loop controls, `raise_exception`, `strftime_now`, a `tojson` that leaves non-ASCII and HTML alone,
`{% generation %}` blocks (rendered as their body, and reported as the assistant's spans by
`render_marked`), and the special tokens (`bos_token`,
`eos_token`, ...) as variables. transformers' own rendering is the reference in the tests.
"""
from __future__ import annotations

import functools
import json
import re
from datetime import datetime
from pathlib import Path
from typing import NamedTuple

from maxtext_rocm.data.builtin_templates import BUILT_IN, marked_equivalent
from maxtext_rocm.errors import ConfigError

# Where a `{% generation %}` block's text starts and ends in a raw rendering: private-use code
# points, stripped from every text a ChatTemplate returns (a message holding one is refused).
GENERATION_OPEN, GENERATION_CLOSE = "\U000F0000", "\U000F0001"
# The keys transformers passes as template variables (its SPECIAL_TOKENS_ATTRIBUTES).
SPECIAL_KEYS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
ROLES = ("system", "user", "assistant", "tool", "ipython")


class TemplateError(ConfigError):
    """A chat template that cannot be read, compiled, or refuses a conversation."""


def _environment():
    """transformers' chat-template environment (utils/chat_template_utils.py), its assistant-mask
    tracker aside: `{% generation %}` renders its body between GENERATION_OPEN and
    GENERATION_CLOSE, which ChatTemplate reads off as the assistant's spans."""
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(jinja2.ext.Extension):
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return GENERATION_OPEN + caller() + GENERATION_CLOSE

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[Generation, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    class Namespace(jinja2.utils.Namespace):  # as transformers': no underscore attributes (CPython internals)
        def __setitem__(self, name, value):
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(f"chat templates cannot set {name!r} on a namespace")
            super().__setitem__(name, value)

    env.globals.update(raise_exception=raise_exception, strftime_now=lambda fmt: datetime.now().strftime(fmt),
                       dict=lambda *a, **k: dict(*a, **k), namespace=Namespace)
    return env


class ChatTemplate:
    """`render(messages, add_generation_prompt)` -> text; `where` names the template's origin."""

    def __init__(self, source: str, specials: dict[str, str], where: str):
        import jinja2

        self.source, self.specials, self.where = source, specials, where
        try:
            self._template = _environment().from_string(source)
        except jinja2.TemplateError as error:
            raise TemplateError(f"the chat template of {where} is not valid Jinja ({error})") from None

    def render(self, messages: list[dict], add_generation_prompt: bool = False) -> str:
        return self.render_marked(messages, add_generation_prompt)[0]

    def render_marked(self, messages: list[dict], add_generation_prompt: bool = False):
        """(the text, [start, end) of each `{% generation %}` block in it): the template's own
        account of what the assistant wrote, where it has marks (else no spans)."""
        import jinja2

        if any(GENERATION_OPEN in str(m.get("content")) or GENERATION_CLOSE in str(m.get("content"))
               for m in messages):
            raise TemplateError(f"a message holds the code point U+F0000 or U+F0001, which {self.where}'s "
                                "rendering reserves; remove it from the data")
        try:
            raw = self._template.render(messages=messages, tools=None, documents=None,
                                        add_generation_prompt=add_generation_prompt, **self.specials)
        except jinja2.TemplateError as error:
            raise TemplateError(f"the chat template of {self.where} refused the conversation ({error})") from None
        text, spans, start = [], [], None
        for piece in re.split(f"({GENERATION_OPEN}|{GENERATION_CLOSE})", raw):
            if piece == GENERATION_OPEN:
                start = sum(map(len, text))
            elif piece == GENERATION_CLOSE:
                spans.append((start, sum(map(len, text))))
            else:
                text.append(piece)
        return "".join(text), spans


class EndOfTurn(NamedTuple):
    """What the template writes after an assistant's content, and the token ids a reply stops at."""

    text: str
    stop_ids: tuple[int, ...]


def _specials_from_config(folder: Path, tokenizer) -> dict[str, str]:
    """The special tokens as strings, as transformers' `special_tokens_map` gives them."""
    specials = {}
    config = folder / "tokenizer_config.json"
    record = json.loads(config.read_text()) if config.is_file() else {}
    for key in SPECIAL_KEYS:
        value = record.get(key)
        value = value.get("content") if isinstance(value, dict) else value
        if isinstance(value, str):
            specials[key] = value
    names = {"bos_token": tokenizer.bos_id, "eos_token": tokenizer.eos_id, "pad_token": tokenizer.pad_id}
    for key, token_id in names.items():  # a tokenizer without a config: its specials by their ids
        if key not in specials and token_id is not None:
            name = token_name(tokenizer, token_id)
            if name is not None:
                specials[key] = name
    return specials


def token_name(tokenizer, token_id: int) -> str | None:
    if hasattr(tokenizer, "tok"):
        return tokenizer.tok.id_to_token(token_id)
    if hasattr(tokenizer, "enc"):
        return tokenizer.enc.decode_single_token_bytes(token_id).decode("utf-8", errors="replace")
    if hasattr(tokenizer, "sp"):
        return tokenizer.sp.id_to_piece(token_id)
    return None


def load_chat_template(data_cfg, tokenizer) -> ChatTemplate:
    """The template `data.chat_template` names, or the tokenizer's own (see the module's doc)."""
    spec = data_cfg.get("chat_template", "") or ""
    path = getattr(tokenizer, "path", None)
    if path is None:
        raise ConfigError("chats are rendered with a chat template, which needs a tokenizer file: set data.tokenizer "
                          "to a tokenizer.json (or a tiktoken/SentencePiece file with data.chat_template='llama3'); "
                          "the byte tokenizer has no chat tokens")
    folder = Path(path).parent
    specials = _specials_from_config(folder, tokenizer)
    return _load(spec, str(folder), tuple(sorted(specials.items())))


@functools.lru_cache(maxsize=8)
def _load(spec: str, folder: str, specials: tuple) -> ChatTemplate:
    folder, specials = Path(folder), dict(specials)
    if spec in BUILT_IN:
        return ChatTemplate(BUILT_IN[spec], specials, f"data.chat_template={spec!r}")
    if spec:
        file = Path(spec).expanduser()
        if not file.is_file():
            raise ConfigError(f"data.chat_template={spec!r} is neither a file nor a built-in template; use a Jinja "
                              f"file, one of {', '.join(map(repr, BUILT_IN))}, or '' for the tokenizer's own")
        return ChatTemplate(marked_equivalent(file.read_text(encoding="utf-8")), specials, str(file))
    jinja_file, config = folder / "chat_template.jinja", folder / "tokenizer_config.json"
    if jinja_file.is_file():
        return ChatTemplate(marked_equivalent(jinja_file.read_text(encoding="utf-8")), specials, str(jinja_file))
    source = json.loads(config.read_text()).get("chat_template") if config.is_file() else None
    if isinstance(source, list):  # [{"name": "default", "template": ...}, {"name": "tool_use", ...}]
        source = next((t.get("template") for t in source if isinstance(t, dict) and t.get("name") == "default"), None)
    if not isinstance(source, str) or not source:
        raise ConfigError(f"the tokenizer in {folder} has no chat template (no chat_template.jinja, no chat_template "
                          f"in its tokenizer_config.json); set data.chat_template to a Jinja file or "
                          f"{', '.join(map(repr, BUILT_IN))}")
    return ChatTemplate(marked_equivalent(source), specials, str(config))


def encode_rendered(tokenizer, text: str) -> list[int]:
    """Token ids of rendered chat text, its special tokens (`<|eot_id|>`) read as the tokens they
    name, as transformers does (`add_special_tokens=False`: the template writes BOS itself)."""
    if hasattr(tokenizer, "tok"):  # tokenizers: added tokens in the text are matched already
        return tokenizer.tok.encode(text, add_special_tokens=False).ids
    if hasattr(tokenizer, "enc"):  # tiktoken
        return tokenizer.enc.encode(text, allowed_special="all")
    if hasattr(tokenizer, "sp"):  # SentencePiece: control pieces by their text, the rest encoded between
        specials = {token_name(tokenizer, i): i for i in (tokenizer.bos_id, tokenizer.eos_id) if i is not None}
        ids, rest = [], text
        while rest:
            hits = [(rest.find(name), name) for name in specials if rest.find(name) >= 0]
            if not hits:
                return ids + tokenizer.sp.encode(rest)
            at, name = min(hits)
            ids += (tokenizer.sp.encode(rest[:at]) if at else []) + [specials[name]]
            rest = rest[at + len(name):]
        return ids
    raise ConfigError("chat templates need a tokenizer file (data.tokenizer), not the byte tokenizer")


PROBE_REPLY = "4242"  # a reply that trimming, case changes and escaping leave as it is


def reply_problem(template: ChatTemplate) -> str | None:
    """The sentence that refuses a template which would train nothing, or None: one that renders
    nothing, or never writes the assistant's words (they are what a chat trains on), found by
    rendering a probe conversation. A template that refuses the probe is judged on the data instead
    (data/formats.py renders a record of each sequence of roles)."""
    try:
        text = template.render([{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": PROBE_REPLY}])
    except TemplateError:
        return None
    remedy = (f"set data.chat_template to a Jinja file that writes every message, or one of "
              f"{', '.join(map(repr, BUILT_IN))}")
    if not text.strip():
        return (f"the chat template of {template.where} renders nothing (an empty text for a user and an assistant "
                f"turn), so no token would be trained; {remedy}")
    if PROBE_REPLY not in text:
        return (f"the chat template of {template.where} never renders the assistant's words (a reply "
                f"{PROBE_REPLY!r} is not in its text for a user and an assistant turn), so no token would be "
                f"trained; {remedy}")
    return None


def end_of_turn(template: ChatTemplate, tokenizer) -> EndOfTurn:
    """What the template writes after an assistant's words (Llama 3: `<|eot_id|>`; ChatML:
    `<|im_end|>\\n`), found by rendering a probe reply: the reply stops at its first token (and at
    the tokenizer's EOS)."""
    probe = PROBE_REPLY
    asked = [{"role": "user", "content": "2+2?"}]
    prompt = template.render(asked, add_generation_prompt=True)
    full = template.render(asked + [{"role": "assistant", "content": probe}])
    reply = full[len(prompt):] if full.startswith(prompt) else full
    after = reply[reply.rfind(probe) + len(probe):] if probe in reply else ""
    stop = encode_rendered(tokenizer, after.strip())[:1] if after.strip() else []
    if tokenizer.eos_id is not None and tokenizer.eos_id not in stop:
        stop.append(tokenizer.eos_id)
    return EndOfTurn(after, tuple(int(i) for i in stop))
