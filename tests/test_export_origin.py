"""`to-hf` of runs that started from a `from-hf` export, full and LoRA, checked through
transformers and peft: the original's config keys and generation config are kept (a chat run's
end-of-turn token among the EOS ids, so `generate` stops there), the LoRA merge is made from the
fp32 base, and the PEFT adapter names the original folder. Skipped without peft (the test extra)."""

import json
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
from chat_helpers import CHATS, make_chat_tokenizer, write_jsonl  # noqa: E402
from test_convert import TOL, hf_logits, max_err  # noqa: E402

from maxtext_rocm import config as config_lib  # noqa: E402
from maxtext_rocm.convert.__main__ import main as convert_main  # noqa: E402
from maxtext_rocm.train import Trainer  # noqa: E402

transformers.utils.logging.disable_progress_bar()
# Keys transformers itself rewrites on save, and the dtype to-hf states for what it wrote.
REWRITTEN = {"transformers_version", "dtype", "torch_dtype"}
ORIGINAL_GENERATION = {"temperature": 0.6, "top_p": 0.9, "do_sample": True}  # ours to recognise
RANK, ALPHA = 4, 8.0


def make_chat_llama(folder: Path, *, generation_config: bool) -> Path:
    """A tiny random fp32 Llama with a chat tokenizer beside it; its config names that tokenizer's
    ids, its context (256) is longer than the runs' seq_len; with or without generation_config.json."""
    make_chat_tokenizer(folder)
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    ids = {name: tok.token_to_id(token) for name, token in (
        ("bos_token_id", "<|begin_of_text|>"), ("eos_token_id", "<|end_of_text|>"),
        ("pad_token_id", "<|finetune_right_pad_id|>"))}
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=320, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                      tie_word_embeddings=False, **ids)
    model = transformers.LlamaForCausalLM(config)
    with torch.no_grad():  # wider than transformers' init, so a bf16 rounding of W is far above fp32's
        for name, param in model.named_parameters():
            param.uniform_(0.5, 1.5) if "norm" in name else param.normal_(0.0, 0.15)
    model.eval().save_pretrained(folder)
    generation = folder / "generation_config.json"
    if generation_config:
        generation.write_text(json.dumps({**ids, **ORIGINAL_GENERATION}))
    else:
        generation.unlink(missing_ok=True)
    return folder


def train_from_export(tmp_path, export: Path, run: Path, devices, **overrides):
    data = write_jsonl(tmp_path / "chats.jsonl", [{"messages": chat} for chat in CHATS] * 4)
    cfg = config_lib.load(str(export / "preset.py"), overrides={
        "data.paths": str(data), "train.seq_len": 32, "train.per_device_batch_size": 1, "train.steps": 2,
        "log.every": 1, "log.tensorboard": False, "checkpoint.async_save": False, "optimizer.lr": 3e-2,
        "optimizer.warmup_steps": 0, "output_dir": str(run), **overrides})
    assert cfg.data.format == "chat" and cfg.train.seq_len == 32
    trainer = Trainer(cfg, devices=devices[:1], log=lambda *_: None)
    trainer.run()
    trainer.close()
    return cfg, trainer


def eot_and_eos(hf: Path) -> tuple[int, int]:
    tokenizer = transformers.AutoTokenizer.from_pretrained(hf)
    return tokenizer.convert_tokens_to_ids("<|eot_id|>"), tokenizer.eos_token_id


def assert_original_config_kept(original: Path, exported: Path):
    before = json.loads((original / "config.json").read_text())
    after = json.loads((exported / "config.json").read_text())
    assert after["max_position_embeddings"] == 256  # the original's context, not train.seq_len
    for key, value in before.items():
        if key not in REWRITTEN:
            assert after.get(key) == value, (key, after.get(key), value)


class ForceToken(transformers.LogitsProcessor):
    """Makes `token` the greedy choice at every step, so that only a stop criterion ends the reply."""

    def __init__(self, token: int):
        self.token = token

    def __call__(self, input_ids, scores):
        scores[:, self.token] = scores.max() + 1e4
        return scores


def test_full_run_export_keeps_the_original_config_and_stops_at_eot(tmp_path, devices):
    """A full SFT run from an import: to-hf writes the original's config keys (token ids, context)
    and a generation_config.json built from its token ids plus <|eot_id|>, which generate stops at."""
    hf = make_chat_llama(tmp_path / "hf", generation_config=False)
    assert convert_main(["from-hf", str(hf), str(tmp_path / "export"), "--config.model.scan_layers=true"]) == 0
    train_from_export(tmp_path, tmp_path / "export", tmp_path / "run", devices, **{"precision.policy": "fp32"})
    out = tmp_path / "out"
    assert convert_main(["to-hf", str(tmp_path / "run"), str(out)]) == 0

    assert_original_config_kept(hf, out)
    eot, eos = eot_and_eos(out)
    generation = json.loads((out / "generation_config.json").read_text())
    original = json.loads((hf / "config.json").read_text())
    assert generation["bos_token_id"] == original["bos_token_id"] and generation["pad_token_id"] == original["pad_token_id"]
    assert set(generation["eos_token_id"]) == {eos, eot}

    model = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    prompt = torch.tensor([[7, 40, 41, 42]])
    with torch.no_grad():
        reply = model.generate(prompt, max_new_tokens=8, do_sample=False,
                               logits_processor=transformers.LogitsProcessorList([ForceToken(eot)]))
    assert reply[0, prompt.shape[1]:].tolist() == [eot]  # stopped at the end of the turn

    # The run's `checkpoint export` (a second hop to the original) gives the same two files.
    from maxtext_rocm.checkpoint.params import export_params

    export_params(tmp_path / "run", tmp_path / "run_export")
    assert convert_main(["to-hf", str(tmp_path / "run_export"), str(tmp_path / "out2")]) == 0
    for name in ("config.json", "generation_config.json"):
        assert (tmp_path / "out2" / name).read_text() == (out / name).read_text(), name


def test_lora_run_export_merges_fp32_base_and_adapter_loads_by_its_base_name(tmp_path, devices):
    """A bf16-policy LoRA run from an fp32 import: the merged kernels are W_fp32 + (alpha/r) A B to
    fp32 rounding; the generation config is the original's with <|eot_id|> added; the PEFT adapter
    names the original folder, so AutoPeftModelForCausalLM loads it and gives the merged logits."""
    hf = make_chat_llama(tmp_path / "hf", generation_config=True)
    assert convert_main(["from-hf", str(hf), str(tmp_path / "export"), "--config.model.scan_layers=true"]) == 0
    cfg, trainer = train_from_export(tmp_path, tmp_path / "export", tmp_path / "run", devices, **{
        "precision.policy": "bf16", "lora.rank": RANK, "lora.alpha": ALPHA, "lora.targets": ("q", "down")})
    adapters = {name: np.asarray(x) for name, x in flat(trainer.state.params).items()}
    merged, adapter = tmp_path / "merged", tmp_path / "adapter"
    assert convert_main(["to-hf", str(tmp_path / "run"), str(merged)]) == 0
    assert convert_main(["to-hf", str(tmp_path / "run"), str(adapter), "--adapter"]) == 0

    # The merge, against numpy in float64 from the original's fp32 tensors and the run's adapters.
    from safetensors.numpy import load_file

    before, after = load_file(str(hf / "model.safetensors")), load_file(str(merged / "model.safetensors"))
    for block, ours, theirs in (("attention", "q", "self_attn.q_proj"), ("mlp", "down", "mlp.down_proj")):
        a, b = adapters[f"layers/{block}/{ours}/dot/a"], adapters[f"layers/{block}/{ours}/dot/b"]
        for layer in range(cfg.model.n_layers):
            name = f"model.layers.{layer}.{theirs}.weight"
            product = a[layer].reshape(-1, RANK).astype(np.float64) @ b[layer].reshape(RANK, -1).astype(np.float64)
            expected = before[name].astype(np.float64) + (ALPHA / RANK) * product.T
            assert np.abs(product).max() > 1e-3, "training moved the adapters"
            assert after[name].dtype == np.float32
            np.testing.assert_allclose(after[name], expected, rtol=0, atol=2e-6 * np.abs(expected).max(), err_msg=name)

    assert_original_config_kept(hf, merged)
    eot, eos = eot_and_eos(merged)
    generation = json.loads((merged / "generation_config.json").read_text())
    assert {k: generation[k] for k in ORIGINAL_GENERATION} == ORIGINAL_GENERATION
    assert set(generation["eos_token_id"]) == {eos, eot}

    config = json.loads((adapter / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str(hf.resolve())
    peft_model = peft.AutoPeftModelForCausalLM.from_pretrained(adapter, dtype=torch.float32).eval()
    tokens = np.random.default_rng(1).integers(0, 320, (2, 24))
    assert max_err(hf_logits(peft_model, tokens), hf_logits(merged, tokens)) <= TOL


def flat(tree, prefix=""):
    out = {}
    for key, value in tree.items():
        if isinstance(value, dict) or hasattr(value, "items"):
            out.update(flat(value, f"{prefix}{key}/"))
        else:
            out[f"{prefix}{key}"] = value
    return out


def test_a_chat_run_whose_tokenizer_is_gone_still_exports_and_says_what_is_missing(capsys):
    """The weights need no tokenizer: a chat run whose tokenizer folder was deleted (or whose
    relative data.tokenizer points elsewhere from here) exports, with a warning that
    generation_config.json lacks the end-of-turn id; the token ids the original gave are kept."""
    from maxtext_rocm.convert import origin as origin_lib

    cfg = config_lib.load_preset("tiny_llama")  # as a run's config.json gives it: no validation of its files now
    cfg.data.update(format="chat", tokenizer="/no/such/tokenizer.json")
    found = origin_lib.Origin(hf_config={"bos_token_id": 1, "eos_token_id": 2}, hf_dir=None, generation_config=None)
    assert origin_lib.generation_config(found, cfg) == {"bos_token_id": 1, "eos_token_id": 2}
    assert "lists no end-of-turn token among eos_token_id" in capsys.readouterr().err
