"""Data and objectives that would train nothing are refused at launch, through the CLI: one
sentence, exit 2, nothing written to the run directory (no config.json, no metrics, no compilation
cache), before any compilation. A chat template that never renders the assistant's words (or
renders nothing), records that leave no trained token, preference pairs whose chosen and rejected
are the same, and a file of one format given under another's data.format."""

import pytest

from chat_helpers import CHATS, make_chat_tokenizer, write_jsonl
from maxtext_rocm import train

pytest.importorskip("tokenizers")

TINY = ["configs/tiny_llama.py", "--config.model.vocab_size=512", "--config.model.d_model=64",
        "--config.model.n_layers=2", "--config.model.n_heads=4", "--config.model.n_kv_heads=2",
        "--config.model.head_dim=16", "--config.model.mlp_dim=128", "--config.train.seq_len=32",
        "--config.train.steps=2", "--config.log.every=1", "--config.checkpoint.every=0",
        "--config.log.tensorboard=false", "--config.data.source=files"]
# Llama 3's template with the assistant's turns left out, as a template that filters roles wrongly does.
USER_ONLY = ("{{ bos_token }}{% for m in messages %}{% if m['role'] != 'assistant' %}<|start_header_id|>"
             "{{ m['role'] }}<|end_header_id|>\n\n{{ m['content'] }}<|eot_id|>{% endif %}{% endfor %}")


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    return make_chat_tokenizer(tmp_path_factory.mktemp("refusal_tok"))


def refused(capsys, tmp_path, *flags) -> str:
    """The one line the CLI prints for a refusal (exit 2, no run directory made)."""
    run = tmp_path / "run"
    status = train.main([*TINY, f"--config.output_dir={run}", *flags])
    err = [line for line in capsys.readouterr().err.strip().splitlines() if line]
    assert status == 2 and len(err) == 1, (status, err)
    assert not run.exists(), sorted(p.name for p in run.iterdir())
    return err[0]


def chat_flags(tok_dir, data, template=None):
    return [f"--config.data.paths={data}", "--config.data.format=chat",
            f"--config.data.tokenizer={tok_dir / 'tokenizer.json'}",
            *([f"--config.data.chat_template={template}"] if template is not None else [])]


def test_a_template_that_never_renders_the_assistant_is_refused(tok_dir, tmp_path, capsys):
    (tmp_path / "user_only.jinja").write_text(USER_ONLY)
    data = write_jsonl(tmp_path / "chats.jsonl", [{"messages": c} for c in CHATS])
    line = refused(capsys, tmp_path, *chat_flags(tok_dir, data, tmp_path / "user_only.jinja"))
    assert line.startswith(f"error: the chat template of {tmp_path / 'user_only.jinja'} never renders the "
                           "assistant's words"), line


def test_an_empty_template_is_refused_naming_the_tokenizers_template(tmp_path, capsys):
    empty_tok = make_chat_tokenizer(tmp_path / "tok", template="{# nothing #}")
    data = write_jsonl(tmp_path / "chats.jsonl", [{"messages": c} for c in CHATS])
    line = refused(capsys, tmp_path, *chat_flags(empty_tok, data))
    assert line.startswith(f"error: the chat template of {empty_tok / 'tokenizer_config.json'} renders nothing"), line


def test_records_that_leave_no_trained_token_are_refused(tok_dir, tmp_path, capsys):
    """Each completion is empty and the end of text is not added: no record has a token to learn."""
    data = write_jsonl(tmp_path / "pc.jsonl", [{"prompt": f"say {i}", "completion": ""} for i in range(4)])
    line = refused(capsys, tmp_path, f"--config.data.paths={data}", "--config.data.format=prompt_completion",
                   f"--config.data.tokenizer={tok_dir / 'tokenizer.json'}", "--config.data.add_eos=false")
    assert line.startswith(f"error: no record of data.paths ({data}) leaves a token to train on"), line


def test_preference_pairs_all_alike_are_refused(tok_dir, tmp_path, capsys):
    data = write_jsonl(tmp_path / "pairs.jsonl", [{"prompt": f"what is {i}?", "chosen": " four", "rejected": " four"}
                                                  for i in range(4)])
    line = refused(capsys, tmp_path, f"--config.data.paths={data}", "--config.data.format=preference",
                   "--config.train.objective=dpo", f"--config.data.tokenizer={tok_dir / 'tokenizer.json'}")
    assert line.startswith(f"error: no pair of data.paths ({data}) has a chosen response that differs from its "
                           "rejected one"), line


@pytest.mark.parametrize("given, record, hint", [
    ("chat", {"prompt": "p", "chosen": "a", "rejected": "b"}, "data.format='preference'"),
    ("chat", {"prompt": "p", "completion": "a"}, "data.format='prompt_completion'"),
    ("prompt_completion", {"messages": CHATS[1]}, "data.format='chat'"),
    ("preference", {"prompt": "p", "completion": "a"}, "data.format='prompt_completion'"),
    ("prompt_completion", {"text": "plain text"}, "data.format='text'"),
    ("text", {"prompt": "p", "chosen": "a", "rejected": "b"}, "data.format='preference'"),
    ("text", {"messages": CHATS[1]}, "data.format='chat'"),
])
def test_a_file_of_another_format_names_the_format_its_fields_fit(given, record, hint, tok_dir, tmp_path, capsys):
    data = write_jsonl(tmp_path / "data.jsonl", [record])
    line = refused(capsys, tmp_path, f"--config.data.paths={data}", f"--config.data.format={given}",
                   f"--config.data.tokenizer={tok_dir / 'tokenizer.json'}",
                   *(["--config.train.objective=dpo"] if given == "preference" else []))
    assert f"{data} line 1" in line and hint in line, line
