"""Qwen3's published chat template (data/builtin_templates.py's QWEN3) under data.format chat and
prompt_completion: token ids and trained masks against transformers.

The published template has no `{% generation %}` marks, so transformers' own
`return_assistant_tokens_mask` under it is all zeros. The reference is transformers' mask under
QWEN3_GENERATION, the same template with marks around what the assistant writes after its
`<|im_start|>assistant\\n` header (its <think> block, its words, <|im_end|>); the first test holds
the two templates to the same text, token for token, so that mask is QWEN3's.

Qwen3's template renders an assistant turn after the last user message with a <think> block
(empty where it has no reasoning) and every earlier one without it, so the conversation up to an
earlier turn is not a prefix of the whole, and rendering prefixes cannot find the assistant's
turns. The published template is therefore read as QWEN3_GENERATION (data/builtin_templates.py),
whose marks say where each turn is, as they tell transformers.
"""

import numpy as np
import pytest

from chat_helpers import CHATS, QWEN3, QWEN3_ADDED, QWEN3_GENERATION, QWEN3_NAMES, QWEN3_SPECIALS, make_chat_tokenizer
from maxtext_rocm.data.chat_template import TemplateError, end_of_turn, load_chat_template
from maxtext_rocm.data.formats import Tokenize, chat_example
from maxtext_rocm.data.tokenizer import load_tokenizer

transformers = pytest.importorskip("transformers")

REASONING = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "What is 2+2?"},
             {"role": "assistant", "content": "<think>\ntwo plus two\n</think>\n\nthe answer is four."}]
SINGLE_TURN = [CHATS[1], REASONING,
               [{"role": "user", "content": "Grüße?"}, {"role": "assistant", "content": "\naus Köln"}]]
MULTI_TURN = [chat for chat in CHATS if sum(m["role"] == "assistant" for m in chat) > 1]
MULTI_TURN.append(REASONING + [{"role": "user", "content": "And 3+3?"},
                               {"role": "assistant", "content": "<think>\nthree plus three\n</think>\n\nsix"}])


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """(published, marked): the same tiny Qwen3 tokenizer with QWEN3, and with QWEN3_GENERATION."""
    base = tmp_path_factory.mktemp("qwen3_tok")
    return tuple(make_chat_tokenizer(base / name, template=template, specials=QWEN3_SPECIALS, names=QWEN3_NAMES,
                                     added=QWEN3_ADDED)
                 for name, template in (("published", QWEN3), ("marked", QWEN3_GENERATION)))


@pytest.fixture(scope="module")
def ours(folders):
    """(our template from the published folder, our tokenizer)."""
    import ml_collections

    tok = load_tokenizer(str(folders[0] / "tokenizer.json"))
    return load_chat_template(ml_collections.ConfigDict({"chat_template": ""}), tok), tok


def reference(folders, messages):
    """transformers' input_ids and assistant mask of `messages` under the marked template."""
    marked = transformers.AutoTokenizer.from_pretrained(str(folders[1]))
    out = marked.apply_chat_template(messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
    return list(out["input_ids"]), np.asarray(out["assistant_masks"], bool)


def test_marks_change_no_text(folders, ours):
    """QWEN3_GENERATION renders every conversation here as QWEN3 does, in transformers and here."""
    template, _ = ours
    published, marked = (transformers.AutoTokenizer.from_pretrained(str(f)) for f in folders)
    for chat in SINGLE_TURN + MULTI_TURN:
        for k in range(1, len(chat) + 1):
            for prompt in (False, True):
                text = published.apply_chat_template(chat[:k], tokenize=False, add_generation_prompt=prompt)
                assert marked.apply_chat_template(chat[:k], tokenize=False, add_generation_prompt=prompt) == text
                assert template.render(chat[:k], add_generation_prompt=prompt) == text
    # What the module's doc says of Qwen3: an earlier assistant turn loses its <think> block.
    whole = template.render(MULTI_TURN[-1])
    assert "two plus two" not in whole and "<think>\nthree plus three\n</think>\n\nsix<|im_end|>" in whole
    assert "<think>\n\n</think>\n\nhello world<|im_end|>" in template.render(CHATS[1])


def test_single_turn_mask_equals_transformers(folders, ours):
    """A chat with one assistant turn: ids and mask equal transformers' (the reply's <think> block,
    empty or not, its words and <|im_end|> trained; the newline after <|im_end|> not)."""
    template, tok = ours
    for chat in SINGLE_TURN:
        ids, mask = reference(folders, chat)
        example = chat_example(template, tok, chat)
        assert example.tokens.tolist() == ids
        assert example.trained.tolist() == mask.tolist()
        assert mask.any() and not mask[-1]  # the trailing "\n"


def last_run(mask: np.ndarray) -> np.ndarray:
    """`mask` with only its last run of True left."""
    end = len(mask) - int(np.argmax(mask[::-1]))
    start = end - int(np.argmin(mask[:end][::-1])) if not mask[:end].all() else 0
    out = np.zeros_like(mask)
    out[start:end] = True
    return out


def test_each_turn_as_a_prompt_completion_record_equals_transformers(folders, ours):
    """A multi-turn chat split into one prompt_completion record per assistant turn (the messages
    before it as the prompt): the record's ids are transformers' rendering of the chat up to that
    turn, and exactly that turn is trained, where transformers' mask puts it."""
    template, tok = ours
    tokenize = Tokenize("prompt_completion", tok, template)
    records = 0
    for chat in MULTI_TURN:
        for k in [k for k, m in enumerate(chat) if m["role"] == "assistant"]:
            example = tokenize(({"prompt": chat[:k], "completion": chat[k]["content"]}, f"turn {k}"))
            ids, mask = reference(folders, chat[:k + 1])
            assert example.tokens.tolist() == ids
            assert example.trained.tolist() == last_run(mask).tolist()
            records += 1
    assert records == 6


def test_end_of_turn_is_im_end(ours):
    """generate --chat stops a Qwen3 reply at <|im_end|>, the tokenizer's EOS."""
    template, tok = ours
    assert end_of_turn(template, tok).stop_ids == (tok.tok.token_to_id("<|im_end|>"),)


def test_multi_turn_chat_mask_equals_transformers(folders, ours):
    """What issue #50 asks: the mask of a whole multi-turn chat equal to transformers'. The
    published template is read as its marked copy (data/builtin_templates.py), whose blocks say
    where each turn is; by prefixes it could not be found (the next test)."""
    template, tok = ours
    for chat in MULTI_TURN:
        ids, mask = reference(folders, chat)
        example = chat_example(template, tok, chat)
        assert example.tokens.tolist() == ids and example.trained.tolist() == mask.tolist()


def test_without_the_marks_a_multi_turn_chat_is_refused_naming_the_way_out(folders, ours):
    """The published template read as it is, without its marked copy, leaves only prefix rendering, which Qwen3's earlier turns defeat: refused in one sentence that names
    the built-in marked copy."""
    from maxtext_rocm.data.chat_template import ChatTemplate

    template, tok = ours
    unmarked = ChatTemplate(QWEN3, template.specials, "an unmarked copy")
    assert not unmarked.render_marked(MULTI_TURN[0])[1]
    with pytest.raises(TemplateError, match="built-in 'qwen3'"):
        chat_example(unmarked, tok, MULTI_TURN[0])
