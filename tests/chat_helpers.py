"""Tiny chat tokenizers and chat files for the fine-tuning tests, built offline: a byte-level BPE
trained by `tokenizers` with Llama 3's chat tokens (or Qwen3's), saved with a tokenizer_config.json
that transformers' AutoTokenizer loads (its chat_template is the reference rendering)."""
from __future__ import annotations

import json
from pathlib import Path

SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>",
            "<|finetune_right_pad_id|>"]
LLAMA3_NAMES = {"bos_token": "<|begin_of_text|>", "eos_token": "<|end_of_text|>",
                "pad_token": "<|finetune_right_pad_id|>"}
# Qwen3's: three special tokens, and <think> / </think> added as plain (not special) tokens, no BOS;
# the chat models' tokenizer_config.json names <|im_end|> as EOS.
QWEN3_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
QWEN3_ADDED = ["<think>", "</think>"]
QWEN3_NAMES = {"bos_token": None, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}
# Llama 3's template with transformers' {% generation %} marks around what the assistant writes.
LLAMA3_GENERATION = (
    "{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
    "{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] | trim }}<|eot_id|>{% endgeneration %}"
    "{% else %}{{ m['content'] | trim }}<|eot_id|>{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}")
# ChatML (Qwen-style) with generation marks; this tokenizer has no <|im_start|>/<|im_end|> tokens, so
# they are plain text whose bytes may merge with their neighbours: boundaries inside tokens.
CHATML_GENERATION = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' }}{% if m['role'] == 'assistant' %}"
    "{% generation %}{{ m['content'] + '<|im_end|>' }}{% endgeneration %}{{ '\n' }}"
    "{% else %}{{ m['content'] + '<|im_end|>' + '\n' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
# Qwen/Qwen3-8B's published chat_template (tokenizer_config.json), as text. An assistant turn after
# the last user message gets a <think> block (empty if it has no reasoning); earlier ones are
# rendered without theirs, so a conversation's prefix is not rendered as the whole renders it.
QWEN3 = r"""{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content + '\n\n' }}
    {%- endif %}
    {{- "# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n" }}
{%- else %}
    {%- if messages[0].role == 'system' %}
        {{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}
    {%- endif %}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == "user" and message.content is string and not(message.content.startswith('<tool_response>') and message.content.endswith('</tool_response>')) %}
        {%- set ns.multi_step_tool = false %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if message.content is string %}
        {%- set content = message.content %}
    {%- else %}
        {%- set content = '' %}
    {%- endif %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\n' + content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {%- set reasoning_content = '' %}
        {%- if message.reasoning_content is string %}
            {%- set reasoning_content = message.reasoning_content %}
        {%- else %}
            {%- if '</think>' in content %}
                {%- set reasoning_content = content.split('</think>')[0].rstrip('\n').split('<think>')[-1].lstrip('\n') %}
                {%- set content = content.split('</think>')[-1].lstrip('\n') %}
            {%- endif %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index %}
            {%- if loop.last or (not loop.last and reasoning_content) %}
                {{- '<|im_start|>' + message.role + '\n<think>\n' + reasoning_content.strip('\n') + '\n</think>\n\n' + content.lstrip('\n') }}
            {%- else %}
                {{- '<|im_start|>' + message.role + '\n' + content }}
            {%- endif %}
        {%- else %}
            {{- '<|im_start|>' + message.role + '\n' + content }}
        {%- endif %}
        {%- if message.tool_calls %}
            {%- for tool_call in message.tool_calls %}
                {%- if (loop.first and content) or (not loop.first) %}
                    {{- '\n' }}
                {%- endif %}
                {%- if tool_call.function %}
                    {%- set tool_call = tool_call.function %}
                {%- endif %}
                {{- '<tool_call>\n{"name": "' }}
                {{- tool_call.name }}
                {{- '", "arguments": ' }}
                {%- if tool_call.arguments is string %}
                    {{- tool_call.arguments }}
                {%- else %}
                    {{- tool_call.arguments | tojson }}
                {%- endif %}
                {{- '}\n</tool_call>' }}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {%- if loop.first or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' }}
        {{- content }}
        {{- '\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\n\n</think>\n\n' }}
    {%- endif %}
{%- endif %}"""


def _marked(template: str, edits: list[tuple[str, str, int]]) -> str:
    for old, new, count in edits:
        assert template.count(old) == count, old
        template = template.replace(old, new)
    return template


# QWEN3 with transformers' {% generation %} marks around what the assistant writes after its
# `<|im_start|>assistant\n` header: the <think> block where there is one, its words, <|im_end|>
# (as CHATML_GENERATION marks ChatML's). The marks change no text (tests/test_chat_data.py checks
# the renderings are equal), so transformers' assistant mask under it is the reference for QWEN3.
_HEADER = "'<|im_start|>' + message.role + '\\n'"
QWEN3_GENERATION = _marked(QWEN3, [
    ("{%- if loop.index0 > ns.last_query_index %}",
     "{{- " + _HEADER + " }}\n        {%- generation %}\n        {%- if loop.index0 > ns.last_query_index %}", 1),
    ("'<|im_start|>' + message.role + '\\n<think>\\n'", "'<think>\\n'", 1),
    ("{{- " + _HEADER + " + content }}", "{{- content }}", 2),
    ("{{- '<|im_end|>\\n' }}\n    {%- elif message.role == \"tool\" %}",
     "{{- '<|im_end|>' }}\n        {%- endgeneration %}\n        {{- '\\n' }}\n    {%- elif message.role == \"tool\" %}", 1),
])
CORPUS = ["the quick brown fox jumps over the lazy dog", "hello world, hello tokenizer", "what is two plus two?",
          "the answer is four.", "system: you are terse", "Grüße aus Köln — 東京"] * 10

CHATS = [
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "What is 2+2?"},
     {"role": "assistant", "content": "4."}, {"role": "user", "content": "And 3+3?"},
     {"role": "assistant", "content": " Six, of course. "}],
    [{"role": "user", "content": "Say hello."}, {"role": "assistant", "content": "hello world"}],
    [{"role": "user", "content": "Grüße?"}, {"role": "assistant", "content": "aus Köln"},
     {"role": "user", "content": "more"}, {"role": "assistant", "content": "the quick brown fox"}],
]


def make_chat_tokenizer(folder: Path, template: str | None = LLAMA3_GENERATION, vocab: int = 320,
                        specials: list[str] = SPECIALS, names: dict = LLAMA3_NAMES, added: list[str] = ()) -> Path:
    """folder/tokenizer.json (`specials` special, `added` plain added tokens) + tokenizer_config.json
    (`names`: bos/eos/pad, and `template`); returns folder."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=list(specials),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS, trainer)
    tok.add_tokens(list(added))
    tok.save(str(folder / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", **names, "model_max_length": 256}
    if template is not None:
        config["chat_template"] = template
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


def write_jsonl(path: Path, records) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path
