"""Hugging Face interoperability: tiny random Llama / Mixtral models built by transformers itself,
imported, compared logit by logit in fp32, exported back, and refused when they should be."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
from safetensors.numpy import load_file, save_file  # noqa: E402

transformers.utils.logging.disable_progress_bar()

import maxtext_rocm as mr  # noqa: E402
from maxtext_rocm import config as config_lib  # noqa: E402
from maxtext_rocm.convert import ConvertError, from_hf  # noqa: E402
from maxtext_rocm.convert.__main__ import main as convert_main  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
TOL = 1e-4  # max abs logit difference, fp32 (the logits themselves are O(1))
FP32 = {"precision.policy": "fp32"}
LLAMA31_ROPE = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                    original_max_position_embeddings=16)


def make_hf(path, family="llama", *, n_kv_heads=2, tie=False, rope_scaling=None, vocab=97, seed=0,
            shard_size=None, dtype=torch.float32, legacy_rope=False, sliding_window=None):
    """A tiny random model saved by transformers (safetensors). Weights are drawn wider than
    transformers' init (std 0.15, norms around 1) so that attention is sharp and a wrong rotary
    layout, norm or expert mapping moves the logits far beyond the tolerance."""
    torch.manual_seed(seed)
    common = dict(vocab_size=vocab, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=n_kv_heads, max_position_embeddings=256,
                  rms_norm_eps=1e-5, tie_word_embeddings=tie, rope_theta=10000.0, rope_scaling=rope_scaling)
    if family == "llama":
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**common))
    else:
        model = transformers.MixtralForCausalLM(transformers.MixtralConfig(
            **common, num_local_experts=4, num_experts_per_tok=2, sliding_window=sliding_window))
    model = widened(model).to(dtype).eval()
    kwargs = {"max_shard_size": shard_size} if shard_size else {}
    model.save_pretrained(path, **kwargs)
    if legacy_rope:  # published checkpoints' spelling: rope_theta + rope_scaling at the top level
        config = json.loads((Path(path) / "config.json").read_text())
        rope = config.pop("rope_parameters")
        config["rope_theta"] = rope.pop("rope_theta")
        config["rope_scaling"] = None if rope["rope_type"] == "default" else rope
        (Path(path) / "config.json").write_text(json.dumps(config))
    return model


def widened(model):
    """`model` with its weights redrawn wider than transformers' init (std 0.15, norm scales
    around 1), in place."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.uniform_(0.5, 1.5)
            else:
                param.normal_(0.0, 0.15)
    return model


def hf_logits(model_or_dir, tokens):
    model = model_or_dir
    if not isinstance(model, torch.nn.Module):
        model = transformers.AutoModelForCausalLM.from_pretrained(model_or_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return model.float()(torch.tensor(np.asarray(tokens), dtype=torch.long)).logits.numpy()


def tokens_for(vocab, batch=2, seq=32, seed=1):
    return np.random.default_rng(seed).integers(0, vocab, (batch, seq))


def max_err(a, b):
    return float(np.max(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64))))


# ----------------------------------------------------------------------------------------------
# Logits parity


LLAMA_CASES = {
    "gqa-untied": dict(n_kv_heads=2),
    "mha-tied": dict(n_kv_heads=4, tie=True),
    "gqa-llama31-rope": dict(n_kv_heads=2, rope_scaling=LLAMA31_ROPE),
    "gqa-tied-llama31-rope-published-spelling": dict(n_kv_heads=1, tie=True, rope_scaling=LLAMA31_ROPE,
                                                     legacy_rope=True, vocab=131),
}


# Unrolled layers are slow-marked for the CI budget; the Mixtral parity test covers that layout.
@pytest.mark.parametrize("scan_layers", [True, pytest.param(False, marks=pytest.mark.slow)], ids=["scan", "unrolled"])
@pytest.mark.parametrize("case", list(LLAMA_CASES))
def test_llama_logits_match_transformers(case, scan_layers, tmp_path):
    model = make_hf(tmp_path / "hf", **LLAMA_CASES[case])
    cfg, params = from_hf(tmp_path / "hf", {**FP32, "model.scan_layers": scan_layers})
    assert cfg.model.family == "llama" and cfg.model.tie_embeddings == LLAMA_CASES[case].get("tie", False)
    assert (cfg.model.rope_scaling is not None) == ("rope_scaling" in LLAMA_CASES[case])
    tokens = tokens_for(cfg.model.vocab_size)
    expected = hf_logits(model, tokens)
    assert np.abs(expected).max() > 1.0  # the comparison is not between near-zero numbers
    err = max_err(mr.forward(cfg, params, tokens), expected)
    print(f"llama {case} scan={scan_layers}: max abs logit error {err:.2e}")
    assert err <= TOL


# (safetensors layout, scan_layers, moe_impl, sliding window). Only the exact implementations;
# the default ("auto") must be one of them on every backend ("capacity" may drop tokens: 0.16 off).
MIXTRAL_CASES = {
    "default": ("per-expert", True, "auto", None),
    "per-expert-scan": ("per-expert", True, "dense", None),
    "fused-scan": ("fused", True, "dense", None),
    "per-expert-unrolled": ("per-expert", False, "dense", None),
    "fused-unrolled": ("fused", False, "dense", None),
    "dropless-sliding-window": ("per-expert", True, "dropless", 8),
}


@pytest.mark.parametrize("case", list(MIXTRAL_CASES))
def test_mixtral_logits_match_transformers(case, tmp_path):
    layout, scan_layers, moe_impl, window = MIXTRAL_CASES[case]
    hf_dir = tmp_path / "hf"
    model = make_hf(hf_dir, "mixtral", sliding_window=window)
    if layout == "fused":  # transformers 5's in-memory names: mlp.gate, mlp.experts.gate_up_proj / down_proj
        state = {k: v.contiguous().numpy() for k, v in model.state_dict().items()}
        assert "model.layers.0.mlp.experts.gate_up_proj" in state
        os.remove(hf_dir / "model.safetensors")
        save_file(state, str(hf_dir / "model.safetensors"), metadata={"format": "pt"})
    cfg, params = from_hf(hf_dir, {**FP32, "model.scan_layers": scan_layers, "model.moe_impl": moe_impl})
    assert (cfg.model.family, cfg.model.n_experts, cfg.model.experts_per_token) == ("mixtral", 4, 2)
    assert cfg.model.sliding_window == (window or 0)
    tokens = tokens_for(cfg.model.vocab_size)
    err = max_err(mr.forward(cfg, params, tokens), hf_logits(model, tokens))
    print(f"mixtral {case}: max abs logit error {err:.2e}")
    assert err <= TOL


def test_parity_test_would_catch_an_interleaved_rotary_layout(tmp_path):
    """The claim that q/k need no permutation, checked from the other side: permuting q/k rows to
    the interleaved (GPT-J) pairing that Meta's original checkpoints use moves the logits by far
    more than the tolerance, so the parity tests above do test the rotary layout."""
    model = make_hf(tmp_path / "hf")
    cfg, params = from_hf(tmp_path / "hf", FP32)
    tokens = tokens_for(cfg.model.vocab_size)
    hd = cfg.model.head_dim
    # column order of q/k heads [0, hd/2, 1, hd/2 + 1, ...]: what a converter that permutes would do
    perm = np.stack([np.arange(hd // 2), np.arange(hd // 2) + hd // 2], axis=1).reshape(-1)
    for name in ("q", "k"):
        kernel = params["layers"]["attention"][name]["kernel"]
        params["layers"]["attention"][name]["kernel"] = kernel[..., perm]
    err = max_err(mr.forward(cfg, params, tokens), hf_logits(model, tokens))
    assert err > 100 * TOL, err


def test_rope_scaling_matters_at_these_lengths(tmp_path):
    """Dropping the Llama 3.1 scaling must break parity, so the scaled cases test it."""
    model = make_hf(tmp_path / "hf", rope_scaling=LLAMA31_ROPE)
    cfg, params = from_hf(tmp_path / "hf", FP32)
    cfg.model.rope_scaling = None
    tokens = tokens_for(cfg.model.vocab_size)
    assert max_err(mr.forward(cfg, params, tokens), hf_logits(model, tokens)) > 100 * TOL


# ----------------------------------------------------------------------------------------------
# Round trips through the command line


def _tensors(folder):
    out = {}
    for path in sorted(Path(folder).glob("*.safetensors")):
        out.update(load_file(str(path)))
    return out


@pytest.mark.parametrize("family, kwargs, dtype", [
    ("llama", dict(tie=True, rope_scaling=LLAMA31_ROPE, shard_size="40KB"), torch.float32),
    ("mixtral", dict(shard_size="40KB"), torch.float32),
    ("llama", dict(), torch.bfloat16),
], ids=["llama-tied-sharded", "mixtral-sharded", "llama-bf16"])
def test_round_trip_gives_identical_tensors_and_logits(family, kwargs, dtype, tmp_path):
    hf_in, export, hf_out = tmp_path / "hf_in", tmp_path / "export", tmp_path / "hf_out"
    model = make_hf(hf_in, family, dtype=dtype, **kwargs)
    if "shard_size" in kwargs:
        assert (hf_in / "model.safetensors.index.json").is_file()
    assert convert_main(["from-hf", str(hf_in), str(export)]) == 0
    assert sorted(p.name for p in export.iterdir()) == ["checksums.json", "config.json", "params", "preset.py"]
    extra = ["--max-shard-size", "40KB"] if "shard_size" in kwargs else []
    assert convert_main(["to-hf", str(export), str(hf_out), *extra]) == 0
    if "shard_size" in kwargs:
        index = json.loads((hf_out / "model.safetensors.index.json").read_text())
        assert len(set(index["weight_map"].values())) > 1

    before, after = _tensors(hf_in), _tensors(hf_out)
    assert sorted(before) == sorted(after)
    for name in before:
        assert before[name].dtype == after[name].dtype, name
        np.testing.assert_array_equal(before[name], after[name], err_msg=name)

    reloaded = transformers.AutoModelForCausalLM.from_pretrained(hf_out, dtype=dtype).eval()
    assert type(reloaded).__name__ == type(model).__name__
    assert reloaded.config.tie_word_embeddings == model.config.tie_word_embeddings
    assert reloaded.config.rope_parameters == model.config.rope_parameters
    # Loaded the same way as the original (a bf16 model built in memory keeps bf16 rotary
    # frequencies that a loaded one recomputes in fp32, so compare loaded with loaded).
    original = transformers.AutoModelForCausalLM.from_pretrained(hf_in, dtype=dtype).eval()
    tokens = tokens_for(model.config.vocab_size)
    np.testing.assert_array_equal(hf_logits(reloaded, tokens), hf_logits(original, tokens))


def test_trained_run_exports_to_transformers_with_our_logits(tmp_path, devices):
    """A run of our own (no Hugging Face origin) -> to-hf -> transformers gives our logits."""
    from conftest import small_config

    from maxtext_rocm.train import Trainer

    cfg = small_config(**{"output_dir": str(tmp_path / "run"), "checkpoint.async_save": False,
                          "model.tie_embeddings": False, "train.steps": 2})
    trainer = Trainer(cfg, devices=devices[:2], log=lambda *_: None)
    trainer.run()
    params = jax_to_numpy(trainer.state.params)
    assert convert_main(["to-hf", str(tmp_path / "run"), str(tmp_path / "hf")]) == 0
    tokens = tokens_for(cfg.model.vocab_size)
    err = max_err(hf_logits(tmp_path / "hf", tokens), mr.forward(cfg, params, tokens))
    print(f"our run -> transformers: max abs logit error {err:.2e}")
    assert err <= TOL


def jax_to_numpy(tree):
    import jax

    return jax.tree_util.tree_map(np.asarray, tree)


# ----------------------------------------------------------------------------------------------
# Starting a run from an import


@pytest.mark.parametrize("family", ["llama", "mixtral"])
def test_run_from_import_starts_at_transformers_loss(family, tmp_path, devices):
    """Train one step from the export through its preset.py (checkpoint.load_params_from): the
    first logged loss is the cross-entropy transformers computes on the same batch."""
    from maxtext_rocm.train import Trainer

    model = make_hf(tmp_path / "hf", family, rope_scaling=LLAMA31_ROPE if family == "llama" else None)
    assert convert_main(["from-hf", str(tmp_path / "hf"), str(tmp_path / "export"),
                         "--config.model.scan_layers=true"]) == 0
    cfg = config_lib.load(str(tmp_path / "export" / "preset.py"), overrides={
        "precision.policy": "fp32", "model.moe_impl": "dense", "data.source": "synthetic", "train.seq_len": 32,
        "train.per_device_batch_size": 1, "train.steps": 1, "log.every": 1, "log.tensorboard": False,
        "checkpoint.enabled": False, "output_dir": str(tmp_path / "run")})
    assert Path(cfg.checkpoint.load_params_from) == tmp_path / "export"
    messages = []
    trainer = Trainer(cfg, devices=devices, log=messages.append)
    batch = trainer.data.batch(0)
    first = trainer.run(1)
    assert any("parameters from" in str(m) for m in messages)

    logits = torch.tensor(hf_logits(model, batch["inputs"]), dtype=torch.float64)
    expected = torch.nn.functional.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), torch.tensor(batch["targets"], dtype=torch.long).reshape(-1))
    print(f"{family}: first loss {first['loss']:.6f}, transformers {float(expected):.6f}")
    assert first["loss"] == pytest.approx(float(expected), rel=1e-5)


# ----------------------------------------------------------------------------------------------
# Refusals: one sentence naming the file or tensor, exit status 2, nothing written


def _refused(capsys, args, *needles):
    out_dir = Path(args[2])
    existed = out_dir.exists()
    before = sorted(p.name for p in out_dir.iterdir()) if existed else None
    capsys.readouterr()  # drop what building the model printed
    assert convert_main(args) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1, err
    for needle in needles:
        assert needle in err, err
    assert out_dir.exists() == existed
    if existed:
        assert sorted(p.name for p in out_dir.iterdir()) == before
    assert not list(out_dir.parent.glob(f".{out_dir.name}.tmp-*"))
    return err


def test_pickles_are_refused(tmp_path, capsys):
    hf = tmp_path / "hf"
    model = make_hf(hf)
    os.remove(hf / "model.safetensors")
    torch.save(model.state_dict(), hf / "pytorch_model.bin")
    _refused(capsys, ["from-hf", str(hf), str(tmp_path / "out")], "pytorch_model.bin", "safetensors")


def test_pickle_refusal_exits_2_from_the_command_line(tmp_path):
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    torch.save({"x": torch.zeros(1)}, hf / "consolidated.00.pt")
    result = subprocess.run([sys.executable, "-m", "maxtext_rocm.convert", "from-hf", str(hf), str(tmp_path / "out")],
                            cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr and "consolidated.00.pt" in result.stderr
    assert not (tmp_path / "out").exists()


def test_unsupported_architecture_is_refused(tmp_path, capsys):
    hf = tmp_path / "hf"
    make_hf(hf)
    config = json.loads((hf / "config.json").read_text())
    config.update(architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3")
    (hf / "config.json").write_text(json.dumps(config))
    _refused(capsys, ["from-hf", str(hf), str(tmp_path / "out")], "DeepseekV3ForCausalLM", "LlamaForCausalLM",
             "Qwen3MoeForCausalLM")


def test_missing_tensor_is_named(tmp_path, capsys):
    hf = tmp_path / "hf"
    make_hf(hf)
    tensors = load_file(str(hf / "model.safetensors"))
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, str(hf / "model.safetensors"), metadata={"format": "pt"})
    _refused(capsys, ["from-hf", str(hf), str(tmp_path / "out")], "model.layers.1.mlp.up_proj.weight is missing")


def test_shape_mismatch_is_named_and_existing_out_dir_untouched(tmp_path, capsys):
    hf = tmp_path / "hf"
    make_hf(hf)
    config = json.loads((hf / "config.json").read_text())
    config["intermediate_size"] = 80
    (hf / "config.json").write_text(json.dumps(config))
    err = _refused(capsys, ["from-hf", str(hf), str(tmp_path / "out")], "has shape", "config.json implies")
    assert "mlp" in err and "80" in err and "96" in err
    # an existing output directory is never written into
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "keep.txt").write_text("mine")
    config["intermediate_size"] = 96
    (hf / "config.json").write_text(json.dumps(config))
    _refused(capsys, ["from-hf", str(hf), str(tmp_path / "taken")], "already exists")
    assert (tmp_path / "taken" / "keep.txt").read_text() == "mine"


def test_unexpected_tensor_is_named(tmp_path, capsys):
    hf = tmp_path / "hf"
    make_hf(hf)
    tensors = load_file(str(hf / "model.safetensors"))
    tensors["model.layers.0.self_attn.q_proj.bias"] = np.zeros(64, np.float32)
    save_file(tensors, str(hf / "model.safetensors"), metadata={"format": "pt"})
    _refused(capsys, ["from-hf", str(hf), str(tmp_path / "out")], "model.layers.0.self_attn.q_proj.bias")


def test_to_hf_refuses_a_folder_without_a_config(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    _refused(capsys, ["to-hf", str(tmp_path / "empty"), str(tmp_path / "out")], "config.json")
    with pytest.raises(ConvertError, match="not a directory"):
        from_hf(tmp_path / "nowhere")
