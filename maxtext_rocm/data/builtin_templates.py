"""Chat templates built in by name (data.chat_template="llama3" or "qwen3"), and the published
templates that are replaced by an equivalent one with `{% generation %}` marks.

A template whose earlier turns render differently once later turns follow (Qwen3's drops each
earlier assistant turn's <think> block) cannot have its assistant turns found by rendering
prefixes (data/formats.py); with generation marks, the render itself says where they are.
`marked_equivalent` swaps a known published template for its marked copy, which renders the
same text (tests/test_chat_qwen3.py).
"""

# Meta-Llama-3-8B-Instruct's published chat_template (tokenizer_config.json), byte for byte.
LLAMA3 = ("{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = "
          "'<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + "
          "'<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}"
          "{{ content }}{% endfor %}{% if add_generation_prompt %}"
          "{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}")

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
        if template.count(old) != count:
            raise AssertionError(f"the template to mark has {template.count(old)} of {old!r}, not {count}")
        template = template.replace(old, new)
    return template


# QWEN3 with transformers' {% generation %} marks around what the assistant writes after its
# `<|im_start|>assistant\n` header: the <think> block where there is one, its words, <|im_end|>.
# The marks change no text (tests/test_chat_qwen3.py holds the renderings equal in transformers and
# here), so the assistant's spans are read from the marks (formats.assistant_spans) where prefixes
# of a conversation render differently from the whole, as they do under Qwen3's template.
_HEADER = "'<|im_start|>' + message.role + '\\n'"
QWEN3_GENERATION = _marked(QWEN3, [
    ("{%- if loop.index0 > ns.last_query_index %}",
     "{{- " + _HEADER + " }}\n        {%- generation %}\n        {%- if loop.index0 > ns.last_query_index %}", 1),
    ("'<|im_start|>' + message.role + '\\n<think>\\n'", "'<think>\\n'", 1),
    ("{{- " + _HEADER + " + content }}", "{{- content }}", 2),
    ("{{- '<|im_end|>\\n' }}\n    {%- elif message.role == \"tool\" %}",
     "{{- '<|im_end|>' }}\n        {%- endgeneration %}\n        {{- '\\n' }}\n    {%- elif message.role == \"tool\" %}", 1),
])


BUILT_IN = {"llama3": LLAMA3, "qwen3": QWEN3_GENERATION}  # named in config/keys_run.py's CHAT_TEMPLATES
# Published templates -> their marked equivalents.
_MARKED = {QWEN3.strip(): QWEN3_GENERATION}


def marked_equivalent(source: str) -> str:
    """`source`, or its copy with generation marks where it is a published template known here."""
    return _MARKED.get(source.strip(), source)
