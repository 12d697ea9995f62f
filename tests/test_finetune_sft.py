"""From a Hugging Face folder to supervised fine-tuning on chats and back: `convert from-hf` writes a
fine-tuning preset (the folder's tokenizer, its context length, files asked for), SFT on a chat file
lowers the assistant tokens' loss as transformers measures it on the exported model, and
`generate --chat` answers through the chat template and stops at the end-of-turn token."""

import json
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import maxtext_rocm as mr  # noqa: E402
from chat_helpers import make_chat_tokenizer, write_jsonl  # noqa: E402
from maxtext_rocm import config as config_lib  # noqa: E402
from maxtext_rocm.convert.__main__ import main as convert_main  # noqa: E402
from maxtext_rocm.generate import main as generate_main  # noqa: E402

CHAT = [{"role": "user", "content": "Say hello."}, {"role": "assistant", "content": "hello world"}]


def make_hf_chat_model(folder: Path, max_positions: int = 96) -> Path:
    """A tiny random Llama saved by transformers, with a chat tokenizer in the same folder."""
    make_chat_tokenizer(folder)
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=320, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2,
                                      max_position_embeddings=max_positions, tie_word_embeddings=False)
    transformers.LlamaForCausalLM(config).eval().save_pretrained(folder)
    return folder


def hf_token_losses(folder: Path, ids: list[int], trained: np.ndarray) -> tuple[float, float]:
    """transformers' mean cross-entropy over the assistant's targets and over the other targets."""
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0, :-1]
    losses = torch.nn.functional.cross_entropy(logits, torch.tensor(ids[1:]), reduction="none").numpy()
    mask = trained[1:]
    return float(losses[mask].mean()), float(losses[~mask].mean())


def test_from_hf_writes_a_finetuning_preset(tmp_path, monkeypatch, capsys):
    """From another working directory, with relative paths: the preset names the folder's tokenizer
    by absolute path, trains chats at the published context length, and asks for data.paths."""
    make_hf_chat_model(tmp_path / "hf", max_positions=80)
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    assert convert_main(["from-hf", "../hf", "out"]) == 0
    assert "--config.data.paths=" in capsys.readouterr().out
    monkeypatch.chdir(tmp_path)
    cfg = config_lib.load_preset(str(tmp_path / "elsewhere" / "out" / "preset.py"))
    assert cfg.data.tokenizer == str((tmp_path / "hf" / "tokenizer.json").resolve())
    assert (cfg.data.source, cfg.data.format, cfg.train.seq_len, cfg.name) == ("files", "chat", 80, "out")
    assert cfg.checkpoint.load_params_from == str(tmp_path / "elsewhere" / "out")
    with pytest.raises(config_lib.ConfigError, match="needs data.paths"):
        config_lib.load(str(tmp_path / "elsewhere" / "out" / "preset.py"))


@pytest.mark.slow
def test_from_hf_preset_sft_back_to_hf_and_chat(tmp_path, monkeypatch, devices, capsys):
    hf = make_hf_chat_model(tmp_path / "hf")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)  # relative paths, from a directory that is neither input's
    assert convert_main(["from-hf", "../hf", "tiny_chat"]) == 0
    assert "--config.data.paths=" in capsys.readouterr().out
    preset = elsewhere / "tiny_chat" / "preset.py"
    with pytest.raises(config_lib.ConfigError, match="needs data.paths"):
        config_lib.load(str(preset))
    data = write_jsonl(tmp_path / "chats.jsonl", [{"messages": CHAT}] * 8)
    cfg = config_lib.load("tiny_chat/preset.py", [
        f"--config.data.paths={data}", "--config.train.steps=40", "--config.train.per_device_batch_size=1",
        "--config.train.seq_len=32", "--config.optimizer.lr=0.01", "--config.optimizer.warmup_steps=2",
        "--config.log.every=5", "--config.log.tensorboard=false", "--config.checkpoint.async_save=false",
        "--config.precision.policy=fp32"])
    assert cfg.data.tokenizer == str((tmp_path / "hf" / "tokenizer.json").resolve())
    assert (cfg.data.source, cfg.data.format, cfg.name) == ("files", "chat", "tiny_chat")
    assert config_lib.load_preset(str(preset)).train.seq_len == 96  # the published context length
    trainer = mr.Trainer(cfg, devices=devices, log=lambda *_: None)
    trainer.run()
    trainer.close() if hasattr(trainer, "close") else None
    run = elsewhere / "runs" / "tiny_chat"
    losses = [json.loads(line)["loss"] for line in (run / "metrics.jsonl").read_text().splitlines()
              if "loss" in json.loads(line)]
    assert losses[-1] < 0.2 * losses[0], losses

    # Back to Hugging Face: the assistant's tokens learned, measured by transformers.
    assert convert_main(["to-hf", "runs/tiny_chat", "tiny_chat_hf"]) == 0
    exported = transformers.AutoTokenizer.from_pretrained(elsewhere / "tiny_chat_hf")  # tokenizer copied along
    assert exported.apply_chat_template(CHAT, tokenize=False).endswith("hello world<|eot_id|>")
    from maxtext_rocm.data.chat_template import load_chat_template
    from maxtext_rocm.data.formats import chat_example
    from maxtext_rocm.data.tokenizer import load_tokenizer

    tok = load_tokenizer(cfg.data.tokenizer)
    example = chat_example(load_chat_template(cfg.data, tok), tok, CHAT)
    before = hf_token_losses(hf, example.tokens.tolist(), example.trained)
    after = hf_token_losses(elsewhere / "tiny_chat_hf", example.tokens.tolist(), example.trained)
    with capsys.disabled():
        print(f"transformers CE assistant {before[0]:.3f} -> {after[0]:.3f}, others {before[1]:.3f} -> {after[1]:.3f}")
    assert after[0] < 0.1 * before[0] and after[0] < 0.5
    assert after[1] > 10 * after[0]  # the prompt's tokens were not trained

    # Chat generation: the template's prompt in, the reply out, stopped at <|eot_id|>.
    params = mr.load_params("runs/tiny_chat")
    assert mr.chat(cfg, params, CHAT[:1], max_new_tokens=20) == "hello world"
    capsys.readouterr()
    assert generate_main(["runs/tiny_chat", "--chat", "Say hello.", "--max-new-tokens", "20"]) == 0
    assert capsys.readouterr().out == "hello world\n"
    eot = tok.tok.token_to_id("<|eot_id|>")
    prompt = tok.tok.encode(load_chat_template(cfg.data, tok).render(CHAT[:1], add_generation_prompt=True),
                            add_special_tokens=False).ids
    reply = mr.generate(cfg, params, prompt, max_new_tokens=20, eos_id=[eot, tok.eos_id])
    assert reply[-1] == eot and len(reply) < 20
    assert len(mr.generate(cfg, params, prompt, max_new_tokens=20)) == 20  # without the stop it runs on
