"""data.format chat / prompt_completion / preference: rendering and masks against transformers'
apply_chat_template and hand-built token lists, the rows the files source makes of them, and bad
records named by file and line."""

import json

import ml_collections
import numpy as np
import pytest

from chat_helpers import CHATS, CHATML_GENERATION, LLAMA3_GENERATION, make_chat_tokenizer, write_jsonl
from maxtext_rocm.data.chat_template import encode_rendered, end_of_turn, load_chat_template
from maxtext_rocm.data.checks import DataError
from maxtext_rocm.data.files import FilesSource, check_inputs
from maxtext_rocm.data.formats import chat_example
from maxtext_rocm.data.preference import truncate_pair
from maxtext_rocm.data.tokenizer import load_tokenizer
from maxtext_rocm.errors import ConfigError

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    return make_chat_tokenizer(tmp_path_factory.mktemp("chat_tok"))


@pytest.fixture(scope="module")
def tok(tok_dir):
    return load_tokenizer(str(tok_dir / "tokenizer.json"))


def data_cfg(tok_dir, **keys):
    base = dict(source="files", paths="", eval_paths="", tokenizer=str(tok_dir / "tokenizer.json"), format="chat",
                chat_template="", train_on_prompt=False, text_field="text", add_bos=True, add_eos=True,
                packing="concat", epochs=0, prefetch=2, seed=0, allow_changed=False)
    base.update(keys)
    return ml_collections.ConfigDict(base)


@pytest.mark.parametrize("template", ["own", "llama3"])
def test_rendering_and_ids_equal_transformers(template, tok_dir, tok):
    """Our Jinja rendering and token ids equal transformers' for multi-turn chats, with and
    without the generation prompt, for the tokenizer's template and the built-in llama3."""
    cfg = data_cfg(tok_dir, chat_template="" if template == "own" else "llama3")
    ours = load_chat_template(cfg, tok)
    ref = transformers.AutoTokenizer.from_pretrained(str(tok_dir))
    source = None if template == "own" else ours.source
    for chat in CHATS:
        for prompt in (False, True):
            want = ref.apply_chat_template(chat, tokenize=False, add_generation_prompt=prompt, chat_template=source)
            assert ours.render(chat, add_generation_prompt=prompt) == want
        ids = ref.apply_chat_template(chat, tokenize=True, return_dict=True, chat_template=source)["input_ids"]
        assert encode_rendered(tok, ours.render(chat)) == list(ids)


@pytest.mark.parametrize("kind", ["llama3", "chatml"])
def test_mask_equals_transformers_assistant_mask(kind, tok_dir, tok, tmp_path):
    """Every assistant turn is trained, exactly where transformers' {% generation %} mask says."""
    if kind == "chatml":
        tok_dir = make_chat_tokenizer(tmp_path / "chatml", template=CHATML_GENERATION)
        tok = load_tokenizer(str(tok_dir / "tokenizer.json"))
    template = load_chat_template(data_cfg(tok_dir), tok)
    ref = transformers.AutoTokenizer.from_pretrained(str(tok_dir))
    for chat in CHATS:
        example = chat_example(template, tok, chat)
        want = ref.apply_chat_template(chat, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
        assert example.tokens.tolist() == list(want["input_ids"])
        assert example.trained.astype(int).tolist() == want["assistant_masks"]


def test_mask_against_a_hand_built_conversation(tok_dir, tok):
    """The built-in llama3 template (no generation marks): the conversation built piece by piece,
    trained exactly on each assistant's (trimmed) words and its <|eot_id|>."""
    template = load_chat_template(data_cfg(tok_dir, chat_template="llama3"), tok)
    special = {name: tok.tok.token_to_id(name) for name in
               ("<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>")}
    for chat in CHATS:
        ids, trained = [special["<|begin_of_text|>"]], [False]
        for m in chat:
            head = ([special["<|start_header_id|>"]] + tok.encode(m["role"]).tolist()
                    + [special["<|end_header_id|>"]] + tok.encode("\n\n").tolist())
            body = tok.encode(m["content"].strip()).tolist() + [special["<|eot_id|>"]]
            ids += head + body
            trained += [False] * len(head) + [m["role"] == "assistant"] * len(body)
        example = chat_example(template, tok, chat)
        assert example.tokens.tolist() == ids
        assert example.trained.tolist() == trained


def test_end_of_turn_is_eot(tok_dir, tok):
    stop = end_of_turn(load_chat_template(data_cfg(tok_dir), tok), tok)
    assert stop.text == "<|eot_id|>"
    assert stop.stop_ids == (tok.tok.token_to_id("<|eot_id|>"), tok.eos_id)


def test_chat_rows_keep_conversations_apart_and_weight_assistants(tok_dir, tok, tmp_path):
    path = write_jsonl(tmp_path / "chats.jsonl", [{"messages": c} for c in CHATS])
    template = load_chat_template(data_cfg(tok_dir), tok)
    examples = {tuple(e.tokens.tolist()): e for e in (chat_example(template, tok, c) for c in CHATS)}
    for train_on_prompt in (False, True):
        cfg = data_cfg(tok_dir, paths=str(path), train_on_prompt=train_on_prompt, packing="best_fit")  # whole chats
        source = FilesSource(cfg, vocab_size=tok.vocab_size, global_batch=2, seq_len=256)
        try:
            batch = source.batch(0)
        finally:
            source.close()
        seen = 0
        for row in range(2):
            segments = batch["segment_ids"][row]
            for s in set(segments.tolist()) - {0}:
                at = np.flatnonzero(segments == s)
                tokens = np.concatenate([batch["inputs"][row, at], batch["targets"][row, at[-1:]]])
                example = examples[tuple(tokens.tolist())]  # each segment is one whole conversation
                want = np.ones(len(at)) if train_on_prompt else example.trained[1:]
                np.testing.assert_array_equal(batch["weights"][row, at], want)
                seen += 1
            assert not batch["weights"][row, segments == 0].any()
        assert seen >= len(CHATS)  # rows fill on into the next epoch


def test_prompt_completion(tok_dir, tok, tmp_path):
    """A string prompt: [BOS] prompt completion [EOS], trained on completion + EOS. A messages
    prompt: the completion is the assistant's next turn, trained alone (earlier turns are prompt)."""
    records = [{"prompt": "what is two plus two?", "completion": " the answer is four."},
               {"prompt": CHATS[0][:4], "completion": "Six."}]
    path = write_jsonl(tmp_path / "pc.jsonl", records)
    cfg = data_cfg(tok_dir, paths=str(path), format="prompt_completion", packing="none")
    source = FilesSource(cfg, vocab_size=tok.vocab_size, global_batch=2, seq_len=64)
    try:
        examples = [source.dataset[i] for i in range(2)]
    finally:
        source.close()
    head, tail = tok.encode(records[0]["prompt"], bos=True), tok.encode(records[0]["completion"], eos=True)
    assert examples[0].tokens.tolist() == head.tolist() + tail.tolist()
    assert examples[0].trained.tolist() == [False] * len(head) + [True] * len(tail)
    template = load_chat_template(cfg, tok)
    full = chat_example(template, tok, CHATS[0][:4] + [{"role": "assistant", "content": "Six."}])
    assert examples[1].tokens.tolist() == full.tokens.tolist()
    last = encode_rendered(tok, "Six.<|eot_id|>")
    assert examples[1].trained.sum() == len(last) and examples[1].tokens[examples[1].trained].tolist() == last


def test_preference_rows_are_paired_and_masked(tok_dir, tok, tmp_path):
    records = [{"prompt": "what is two plus two?", "chosen": " four.", "rejected": " the lazy dog jumps"},
               {"prompt": CHATS[1][:1], "chosen": "hello world", "rejected": "no"}]
    path = write_jsonl(tmp_path / "pref.jsonl", records)
    cfg = data_cfg(tok_dir, paths=str(path), format="preference")
    source = FilesSource(cfg, vocab_size=tok.vocab_size, global_batch=4, seq_len=48)
    try:
        batch, state = source.batch(0), source.state()
        pairs = [source.dataset[i] for i in range(2)]
    finally:
        source.close()
    assert state["cursor"] == 0 and state["epoch"] == 1  # both records read: the position advanced past them
    def row_of(p):
        n = len(p.chosen.tokens) - 1
        return batch["inputs"][:, :n].tolist().index(p.chosen.tokens[:-1].tolist()) // 2

    order = sorted(range(2), key=lambda i: row_of(pairs[i]))  # the epoch's shuffled order
    for r, i in enumerate(order):
        for k, example in enumerate(pairs[i]):
            row, n = 2 * r + k, len(example.tokens) - 1
            np.testing.assert_array_equal(batch["inputs"][row, :n], example.tokens[:-1])
            np.testing.assert_array_equal(batch["targets"][row, :n], example.tokens[1:])
            np.testing.assert_array_equal(batch["weights"][row, :n], example.trained[1:])
            assert batch["segment_ids"][row].tolist() == [1] * n + [0] * (48 - n)
            assert not batch["weights"][row, n:].any()
        prompt = np.flatnonzero(pairs[i].chosen.trained)[0]
        assert prompt == np.flatnonzero(pairs[i].rejected.trained)[0]
        np.testing.assert_array_equal(batch["inputs"][2 * r, :prompt], batch["inputs"][2 * r + 1, :prompt])
    with pytest.raises(DataError, match="even"):
        FilesSource(cfg, vocab_size=tok.vocab_size, global_batch=3, seq_len=48)


def test_preference_truncation_cuts_the_prompt_from_the_left_then_the_response():
    from maxtext_rocm.data.example import TokenizedExample

    def example(prompt, response):
        return TokenizedExample(np.arange(prompt + response, dtype=np.int32),
                                np.array([False] * prompt + [True] * response))

    chosen, rejected = truncate_pair(example(10, 4), example(10, 2), seq_len=8)  # 9 tokens fit
    assert chosen.tokens.tolist() == list(range(5, 14)) and rejected.tokens.tolist() == list(range(5, 12))
    chosen, rejected = truncate_pair(example(10, 20), example(10, 2), seq_len=8)  # one prompt token stays
    assert chosen.tokens.tolist() == list(range(9, 18)) and chosen.trained.tolist() == [False] + [True] * 8
    assert rejected.tokens.tolist() == [9, 10, 11]


@pytest.mark.parametrize("record, words", [
    ({"text": "hi"}, "line 2 has no 'messages'"),
    ({"messages": [{"role": "user", "content": "hi"}, {"role": "bot", "content": "x"}]},
     "line 2: messages[1] has role 'bot'"),
    ({"messages": [{"role": "user", "content": ["hi"]}, {"role": "assistant", "content": "x"}]},
     "line 2: messages[0] content is list"),
    ({"messages": [{"role": "user", "content": "hi"}]}, "line 2: the conversation has no assistant turn"),
])
def test_bad_chat_records_name_file_and_line(record, words, tok_dir, tmp_path):
    path = write_jsonl(tmp_path / "bad.jsonl", [{"messages": CHATS[1]}, record])
    with pytest.raises(DataError, match=f"{path} {words}".replace("[", r"\[").replace("]", r"\]")):
        check_inputs(data_cfg(tok_dir, paths=str(path)), 512)


def test_bad_preference_and_template_inputs(tok_dir, tmp_path):
    path = write_jsonl(tmp_path / "pref.jsonl", [{"prompt": "p", "chosen": "a"}])
    with pytest.raises(DataError, match=f"{path} line 1 has no 'rejected'"):
        check_inputs(data_cfg(tok_dir, paths=str(path), format="preference"), 512)
    chats = write_jsonl(tmp_path / "chats.jsonl", [{"messages": CHATS[1]}])
    bare = make_chat_tokenizer(tmp_path / "bare", template=None)
    with pytest.raises(ConfigError, match="has no chat template"):
        check_inputs(data_cfg(bare, paths=str(chats)), 512)
    with pytest.raises(DataError, match=r"has \d+ tokens, more than train.seq_len=4 .* all \d+ of its trained"):
        check_inputs(data_cfg(tok_dir, paths=str(chats), packing="none"), 512, seq_len=4)
    with pytest.raises(ConfigError, match="byte tokenizer has no chat tokens"):
        check_inputs(data_cfg(tok_dir, paths=str(chats), tokenizer="byte"), 512)


def test_template_file_and_generation_marks(tok_dir, tok, tmp_path):
    """data.chat_template as a file renders as the tokenizer's own does (the same text)."""
    (tmp_path / "t.jinja").write_text(LLAMA3_GENERATION)
    cfg = data_cfg(tok_dir, chat_template=str(tmp_path / "t.jinja"))
    assert load_chat_template(cfg, tok).render(CHATS[0]) == load_chat_template(data_cfg(tok_dir), tok).render(CHATS[0])
    with pytest.raises(ConfigError, match="neither a file nor a built-in"):
        load_chat_template(data_cfg(tok_dir, chat_template="nope"), tok)
    json.dumps(CHATS)


def test_preference_position_resumes(tok_dir, tok, tmp_path):
    """The pair source's position is the files source's: a restored source continues with the batch
    an uninterrupted one gives next."""
    records = [{"prompt": f"what is {i} plus {i}?", "chosen": " four.", "rejected": " no"} for i in range(5)]
    cfg = data_cfg(tok_dir, paths=str(write_jsonl(tmp_path / "pref.jsonl", records)), format="preference")
    make = lambda: FilesSource(cfg, vocab_size=tok.vocab_size, global_batch=4, seq_len=32)  # noqa: E731
    first, again = make(), make()
    try:
        first.batch(0)
        state = {**first.state(), "step": 1}
        want = first.batch(1)
        again.restore(state)
        got = again.batch(1)
    finally:
        first.close(), again.close()
    for key in want:
        np.testing.assert_array_equal(got[key], want[key])


def test_config_checks_the_new_keys(tok_dir, tmp_path):
    from conftest import small_config

    from maxtext_rocm import config as config_lib

    with pytest.raises(ConfigError, match="data.format='chat' reads your own JSON Lines"):
        config_lib.validate(small_config(**{"data.format": "chat"}))
    from maxtext_rocm.trainer.preflight import check_inputs

    config_lib.validate(small_config(**{"data.chat_template": "llama2"}))  # a path: preflight looks for it
    with pytest.raises(ConfigError, match="data.chat_template='llama2' is neither a file nor a built-in"):
        check_inputs(small_config(**{"data.chat_template": "llama2"}))
    with pytest.raises(ConfigError, match="data.format='chats' is not valid"):
        config_lib.validate(small_config(**{"data.format": "chats"}))


def test_a_template_that_refuses_a_conversation_stops_the_cli_with_file_and_line(tok_dir, tmp_path, capsys):
    """A template's raise_exception (here: no system role, as some published templates say) is found
    at launch for the first record of each sequence of roles: one sentence, exit 2, no run dir."""
    from maxtext_rocm import train

    (tmp_path / "no_system.jinja").write_text(
        "{% for m in messages %}{% if m['role'] == 'system' %}{{ raise_exception('System role not supported') }}"
        "{% endif %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}")
    data = write_jsonl(tmp_path / "chats.jsonl", [{"messages": CHATS[1]}] * 3 + [{"messages": CHATS[0]}])
    status = train.main(["configs/tiny_llama.py", "--config.model.vocab_size=512", "--config.data.source=files",
                         f"--config.data.paths={data}", "--config.data.format=chat",
                         f"--config.data.tokenizer={tok_dir / 'tokenizer.json'}",
                         f"--config.data.chat_template={tmp_path / 'no_system.jinja'}",
                         f"--config.output_dir={tmp_path / 'run'}"])
    err = capsys.readouterr().err.strip().splitlines()
    assert status == 2 and len(err) == 1, err
    assert err[0].startswith(f"error: {data} line 4: the chat template of ") and "System role not supported" in err[0]
    assert not (tmp_path / "run").exists()


def test_a_chat_that_starts_with_the_assistant_is_one_sentence(tok_dir, tmp_path):
    path = write_jsonl(tmp_path / "first.jsonl", [{"messages": CHATS[1][1:] + CHATS[1]}])
    with pytest.raises(DataError, match=f"{path} line 1: the conversation starts with an assistant turn"):
        check_inputs(data_cfg(tok_dir, paths=str(path), chat_template="llama3"), 512)


def test_finetune_keys_of_a_hf_folder(tok_dir, tok):
    """The preset's data keys: the folder's tokenizer (absolute), chat where it has a template, the
    context length; a tokenizer larger than the model is left out rather than failing the conversion."""
    from maxtext_rocm.convert.preset import finetune_keys

    keys = finetune_keys(tok_dir, {"vocab_size": 512, "max_position_embeddings": 64})
    assert keys == {"data.source": "files", "data.tokenizer": str((tok_dir / "tokenizer.json").resolve()),
                    "data.format": "chat", "train.seq_len": 64}
    assert finetune_keys(tok_dir, {"vocab_size": tok.vocab_size - 1}) == {"data.source": "files"}
