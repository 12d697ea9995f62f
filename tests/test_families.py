"""The families beyond Llama and Mixtral (Qwen2/2.5, Qwen3, Qwen3-MoE, Mistral, Gemma 3, gpt-oss), each a tiny random
model built by transformers itself: logits and greedy KV-cache generation against transformers',
the round trip back to Hugging Face, export's refusals, a sharded run that resumes and exports,
and the new weights under every parallel layout."""

import json
import math
import re

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
from safetensors.numpy import load_file  # noqa: E402

transformers.utils.logging.disable_progress_bar()

import maxtext_rocm as mr  # noqa: E402
from maxtext_rocm import config as config_lib  # noqa: E402
from maxtext_rocm.convert import ConvertError, from_hf, to_hf  # noqa: E402
from maxtext_rocm.convert.__main__ import main as convert_main  # noqa: E402
from test_convert import widened  # noqa: E402

VOCAB = 96  # divides over the tensor axis of the sharded run
COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, rms_norm_eps=1e-5, max_position_embeddings=256)
MOE = dict(head_dim=16, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2)
# name -> (transformers class, its config class, config keys, our model keys the import must set)
FAMILIES = {
    "qwen2": ("Qwen2ForCausalLM", "Qwen2Config", dict(tie_word_embeddings=True),
              dict(family="qwen2", qkv_bias=True, qk_norm=False, tie_embeddings=True)),
    # head_dim apart from hidden_size / heads (Qwen3-0.6B's 128 beside 1024 / 16)
    "qwen3": ("Qwen3ForCausalLM", "Qwen3Config", dict(head_dim=24),
              dict(family="qwen3", qk_norm=True, qkv_bias=False, head_dim=24)),
    "qwen3_moe": ("Qwen3MoeForCausalLM", "Qwen3MoeConfig", dict(**MOE, norm_topk_prob=True),
                  dict(family="qwen3_moe", qk_norm=True, n_experts=4, experts_per_token=2, mlp_dim=96,
                       moe_mlp_dim=32, moe_renormalize=True)),
    # the chosen experts' weights left as the softmax gave them (the published default)
    "qwen3_moe-unnormalised": ("Qwen3MoeForCausalLM", "Qwen3MoeConfig", dict(**MOE, norm_topk_prob=False),
                               dict(family="qwen3_moe", moe_renormalize=False)),
    # a window shorter than the sequences and the generations compared
    "mistral": ("MistralForCausalLM", "MistralConfig", dict(sliding_window=8),
                dict(family="mistral", sliding_window=8, qk_norm=False, qkv_bias=False)),
    # Gemma 3's pattern as a unit of three that 8 layers do not divide (two left over), a window
    # of 6, each kind its own rope (linear scaling on the full layers), its own score scale
    "gemma3": ("Gemma3ForCausalLM", "Gemma3TextConfig", dict(
        num_hidden_layers=8, head_dim=16, sliding_window=6, query_pre_attn_scalar=24,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"] * 2 + ["sliding_attention"] * 2,
        rope_parameters={"full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 100000.0},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 1000.0}}),
               dict(family="gemma3", attention_kinds=("sliding", "sliding", "full"), sliding_window=6,
                    rope_theta=100000.0, rope_local_theta=1000.0, rope_linear_factor=4.0, query_pre_attn_scalar=24.0,
                    qk_norm=True, norm_unit_offset=True, post_norms=True, scale_embeddings=True,
                    mlp_activation="gelu_tanh", tie_embeddings=True)),
    # gpt-oss's alternation over 5 layers (one left over), a window of 6, YaRN whose ramp falls
    # inside head_dim 16 (original context 16, factor 16), every bias, sinks, the clamped experts
    "gpt_oss": ("GptOssForCausalLM", "GptOssConfig", dict(
        num_hidden_layers=5, head_dim=16, intermediate_size=32, num_local_experts=4, num_experts_per_tok=2,
        sliding_window=6, rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 16.0, "beta_fast": 32.0,
                                           "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 16}),
                dict(family="gpt_oss", attention_kinds=("sliding", "full"), sliding_window=6, n_experts=4,
                     experts_per_token=2, mlp_dim=32, qkv_bias=True, out_bias=True, attention_sinks=True, moe_bias=True,
                     moe_router="topk_softmax", mlp_activation="clamped_silu",
                     rope_yarn={"factor": 16.0, "beta_fast": 32.0, "beta_slow": 1.0, "original_max_position": 16,
                                "truncate": False, "attention_factor": None})),
}
FP32 = {"precision.policy": "fp32"}


def make_family(path, case: str, seed: int = 0, **extra):
    """A tiny random model of `case` saved by transformers (safetensors), fp32, eager attention.
    Weights are drawn wide (std 0.15, norms around 1, biases too) so that a missing bias, norm or
    window moves the logits far beyond the tolerance."""
    model_cls, config_cls, keys, _ = FAMILIES[case]
    torch.manual_seed(seed)
    config = getattr(transformers, config_cls)(**{**COMMON, **keys, **extra})
    config._attn_implementation = "eager"
    model = widened(getattr(transformers, model_cls)(config)).eval()
    if case == "gpt_oss":  # gate and up projections wide enough that the clamp at 7 bites
        with torch.no_grad():
            for layer in model.model.layers:
                layer.mlp.experts.gate_up_proj.mul_(5.0)
    model.generation_config.eos_token_id = None  # generations run their full length on both sides
    model.save_pretrained(path)
    return model


def tokens_for(batch=2, seq=32, seed=1):
    return np.random.default_rng(seed).integers(0, VOCAB, (batch, seq))


def hf_logits(model, tokens):
    with torch.no_grad():
        return model(torch.tensor(np.asarray(tokens), dtype=torch.long)).logits.numpy()


def relative_err(ours, theirs) -> float:
    theirs = np.asarray(theirs, np.float64)
    return float(np.max(np.abs(np.asarray(ours, np.float64) - theirs)) / np.max(np.abs(theirs)))


@pytest.mark.parametrize("case", list(FAMILIES))
def test_logits_and_greedy_generation_match_transformers(case, tmp_path):
    model = make_family(tmp_path / "hf", case)
    cfg, params = from_hf(tmp_path / "hf", FP32)
    for key, value in FAMILIES[case][3].items():
        ours = cfg.model[key]
        assert (ours.to_dict() if hasattr(ours, "to_dict") else ours) == value, key
    tokens = tokens_for()
    expected = hf_logits(model, tokens)
    assert np.abs(expected).max() > 1.0  # the comparison is not between near-zero numbers
    err = relative_err(mr.forward(cfg, params, tokens), expected)
    print(f"{case}: max logit error {err:.2e} of the logits' scale")
    assert err <= 1e-4

    prompts = tokens_for(seq=6, seed=2)  # 6 + 20 tokens: past Mistral's window of 8 in the cache
    with torch.no_grad():
        theirs = model.generate(torch.tensor(prompts), max_new_tokens=20, do_sample=False, pad_token_id=0)
    ours = mr.generate(cfg, params, prompts, max_new_tokens=20)
    np.testing.assert_array_equal(np.stack(ours), theirs[:, prompts.shape[1]:].numpy())


@pytest.mark.parametrize("case", ["qwen2", "qwen3", "qwen3_moe", "mistral", "gemma3", "gpt_oss"])
def test_round_trip_gives_identical_tensors_config_and_logits(case, tmp_path):
    hf_in, export, hf_out = tmp_path / "hf_in", tmp_path / "export", tmp_path / "hf_out"
    model = make_family(hf_in, case)
    assert convert_main(["from-hf", str(hf_in), str(export)]) == 0
    assert convert_main(["to-hf", str(export), str(hf_out)]) == 0
    before, after = load_file(str(hf_in / "model.safetensors")), load_file(str(hf_out / "model.safetensors"))
    assert sorted(before) == sorted(after)
    for name in before:
        np.testing.assert_array_equal(before[name], after[name], err_msg=name)
    original, written = (json.loads((d / "config.json").read_text()) for d in (hf_in, hf_out))
    assert written["model_type"] == original["model_type"] and written["architectures"] == original["architectures"]
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(hf_out, dtype=torch.float32).eval()
    assert type(reloaded).__name__ == type(model).__name__
    for key in ("sliding_window", "norm_topk_prob", "num_experts_per_tok", "moe_intermediate_size", "head_dim",
                "tie_word_embeddings", "layer_types", "rope_parameters", "query_pre_attn_scalar", "hidden_activation"):
        if key in original:
            assert getattr(reloaded.config, key) == getattr(model.config, key), key
    # Loaded the same way as the original (one built in memory computes its rotary tables apart).
    original_model = transformers.AutoModelForCausalLM.from_pretrained(hf_in, dtype=torch.float32).eval()
    tokens = tokens_for()
    np.testing.assert_array_equal(hf_logits(reloaded, tokens), hf_logits(original_model, tokens))


# ----------------------------------------------------------------------------------------------
# Export refuses what the family's class could not load (from-hf's refusals, and this one for
# head norms under llama: tests/test_family_refusals.py, against the sentences docs/models.md quotes)


@pytest.mark.parametrize("family, option", [("qwen3", "model.qkv_bias=True"), ("qwen2", "model.sliding_window=16")])
def test_export_refuses_options_its_family_cannot_hold(family, option, tmp_path):
    key, value = option.split("=")
    cfg = config_lib.defaults()
    cfg.model.update(family=family, vocab_size=VOCAB, d_model=32, n_layers=1, n_heads=2, n_kv_heads=2, head_dim=16,
                     mlp_dim=64, **{"qk_norm": family == "qwen3", "qkv_bias": family == "qwen2"})
    config_lib.apply_cli_overrides(cfg, [f"--config.{option}"])
    with pytest.raises(ConvertError, match=re.escape(option)):
        to_hf(cfg, {}, tmp_path / "out")
    assert not (tmp_path / "out").exists()


# ----------------------------------------------------------------------------------------------
# A sharded run: imported, trained on a mesh, resumed, exported


SHARDED = {"qwen3": {"mesh.ici.fsdp": 2, "mesh.ici.tensor": 2},
           "qwen3_moe": {"mesh.ici.fsdp": 2, "mesh.ici.expert": 2},
           "gemma3": {"mesh.ici.fsdp": 2, "mesh.ici.tensor": 2},
           "qwen2": {"mesh.ici.fsdp": 2, "mesh.ici.tensor": 2},
           "mistral": {"mesh.ici.fsdp": 2, "mesh.ici.tensor": 2},
           "gpt_oss": {"mesh.ici.fsdp": 4, "mesh.ici.expert": 2}}


# CI budget (~40 s each): Qwen3's dense and MoE, Gemma 3's and gpt-oss's run by default; Qwen2's and
# Mistral's in -m slow
@pytest.mark.parametrize("case", ["qwen3", "qwen3_moe", "gemma3", "gpt_oss", *(pytest.param(case, marks=pytest.mark.slow)
                                                           for case in ("qwen2", "mistral"))])
def test_sharded_run_matches_one_device_resumes_and_exports(case, tmp_path, devices):
    """from-hf on the command line, then 4 steps on fsdp x tensor (or expert; gpt-oss's on all 8
    devices) and on one device:
    the same losses; 2 + 2 steps across a restart: the same weights, bit for bit; to-hf of the
    sharded run: transformers computes the run's own logits."""
    import jax

    from maxtext_rocm.train import Trainer

    make_family(tmp_path / "hf", case)
    assert convert_main(["from-hf", str(tmp_path / "hf"), str(tmp_path / "export")]) == 0
    n_sharded = math.prod(SHARDED[case].values())
    batch = max(4, n_sharded)  # sequences per step, a row per device at least

    def trainer(name, n_devices, mesh):
        cfg = config_lib.load(str(tmp_path / "export" / "preset.py"), overrides={
            **FP32, "data.source": "synthetic", "train.seq_len": 32, "train.per_device_batch_size": batch // n_devices,
            "train.steps": 4, "log.every": 1, "log.tensorboard": False, "checkpoint.every": 2,
            "checkpoint.async_save": False, "output_dir": str(tmp_path / name),
            **{f"mesh.ici.{axis}": 1 for axis in ("fsdp", "tensor", "expert")}, **mesh})
        return Trainer(cfg, devices=devices[:n_devices], log=lambda *_: None)

    one, sharded = trainer("one", 1, {}), trainer("sharded", n_sharded, SHARDED[case])
    losses = [[float(t.step()["loss"]) for _ in range(4)] for t in (one, sharded)]
    print(f"{case}: one device {losses[0]}, sharded {losses[1]}")
    np.testing.assert_allclose(losses[1], losses[0], rtol=1e-5)

    interrupted = trainer("resumed", n_sharded, SHARDED[case])
    interrupted.run(2)
    interrupted.close()
    resumed = trainer("resumed", n_sharded, SHARDED[case])
    assert resumed.step_count == 2
    resumed.run()
    for a, b in zip(jax.tree_util.tree_leaves(resumed.state.params), jax.tree_util.tree_leaves(sharded.state.params)):
        assert np.array_equal(np.asarray(a), np.asarray(b))

    resumed.close()
    assert convert_main(["to-hf", str(tmp_path / "resumed"), str(tmp_path / "hf_out")]) == 0
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf_out", dtype=torch.float32).eval()
    params = jax.tree_util.tree_map(np.asarray, resumed.params_in_model_order())
    tokens = tokens_for()
    assert relative_err(mr.forward(resumed.cfg, params, tokens), hf_logits(reloaded, tokens)) <= 1e-4


# ----------------------------------------------------------------------------------------------
# The new weights under every parallel layout: q/k/v biases split with their heads, the q/k norms'
# scales replicated, each stacked over the layers like the kernels beside them


OPTIONS = {"model.qk_norm": True, "model.qkv_bias": True, "model.n_layers": 4, "model.remat": "full"}


@pytest.mark.parametrize("mesh, schedule", [
    ({"fsdp": 2, "tensor": 2, "sequence": 2}, {}),
    ({"stage": 2, "fsdp": 2, "tensor": 2}, {}),
    ({"stage": 2, "fsdp": 4}, {"pipeline.schedule": "1f1b", "pipeline.microbatches": 2}),
], ids=["fsdp-tensor-sequence", "gpipe-tensor", "1f1b"])
def test_biases_and_head_norms_under_a_mesh_match_one_device(mesh, schedule, devices, tmp_path):
    from conftest import small_config
    from helpers import assert_close, loss_and_grads

    single = {f"mesh.ici.{axis}": 1 for axis in config_lib.MESH_AXES}
    one = small_config(**OPTIONS, **single, **{"train.per_device_batch_size": 8, "output_dir": str(tmp_path / "one")})
    ref_loss, ref_grads, _ = loss_and_grads(one, devices[:1])
    for name in ("q_bias", "k_bias", "v_bias"):  # the comparison covers gradients that are not zero
        assert np.abs(np.asarray(ref_grads["layers"]["attention"][name])).max() > 0
    on_mesh = {**single, **{f"mesh.ici.{axis}": size for axis, size in mesh.items()}}
    cfg = small_config(**OPTIONS, **on_mesh, **schedule, **{"output_dir": str(tmp_path / "mesh")})
    loss, grads, _ = loss_and_grads(cfg, devices)
    assert_close(loss, ref_loss)
    assert_close(grads, ref_grads)


def test_the_text_model_of_a_gemma3_conditional_generation_checkpoint(tmp_path, capsys):
    """Gemma 3 4B and larger are published as Gemma3ForConditionalGeneration: from-hf imports the
    text model (its logits are transformers' text model's), says in one line that the vision tower
    and projector are not imported, and to-hf writes a Gemma3ForCausalLM."""
    torch.manual_seed(0)
    text = {**COMMON, **FAMILIES["gemma3"][2]}
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=28,
                  patch_size=14)
    config = transformers.Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4)
    config.text_config._attn_implementation = "eager"
    model = widened(transformers.Gemma3ForConditionalGeneration(config)).eval()
    model.save_pretrained(tmp_path / "hf")
    capsys.readouterr()
    assert convert_main(["from-hf", str(tmp_path / "hf"), str(tmp_path / "export")]) == 0
    said = capsys.readouterr().out.splitlines()
    assert said[-2] == (f"note: {tmp_path / 'hf'} holds a Gemma3ForConditionalGeneration; its text model was "
                        "imported (as a Gemma3ForCausalLM), not its vision_tower or multi_modal_projector")
    cfg, params = from_hf(tmp_path / "hf", FP32)
    tokens = tokens_for()
    with torch.no_grad():
        expected = model(input_ids=torch.tensor(tokens)).logits.numpy()
    assert relative_err(mr.forward(cfg, params, tokens), expected) <= 1e-4
    assert convert_main(["to-hf", str(tmp_path / "export"), str(tmp_path / "hf_out")]) == 0
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf_out", dtype=torch.float32).eval()
    assert type(reloaded).__name__ == "Gemma3ForCausalLM"
    assert relative_err(hf_logits(reloaded, tokens), expected) <= 1e-4


# ----------------------------------------------------------------------------------------------
# A stack of units (model.attention_kinds) under what else a run may ask of it


GEMMA_LIKE = {"model.family": "gemma3", "model.n_layers": 5, "model.attention_kinds": ("sliding", "full"),
              "model.sliding_window": 8, "model.rope_local_theta": 1000.0, "model.qk_norm": True,
              "model.norm_unit_offset": True, "model.post_norms": True, "model.scale_embeddings": True,
              "model.mlp_activation": "gelu_tanh", "model.query_pre_attn_scalar": 24.0}


@pytest.mark.parametrize("overrides", [{"precision.policy": "fp8", "precision.amax_history_len": 8},
                                       {"lora.rank": 2, "lora.targets": ("q", "v", "down")}], ids=["fp8", "lora"])
def test_a_stack_of_units_trains_under_fp8_and_lora(overrides, devices, tmp_path):
    """Two (sliding, full) pairs and one layer left over, as one stack of five layers: fp8's
    per-layer scaling state and LoRA's adapters stack by layer like the weights, and both train."""
    import jax

    from conftest import small_config
    from maxtext_rocm.train import Trainer

    cfg = small_config(**GEMMA_LIKE, **overrides, **{"output_dir": str(tmp_path), "optimizer.warmup_steps": 0,
                                                      "optimizer.lr": 1e-2})
    trainer = Trainer(cfg, devices=devices[:2], log=lambda *_: None)
    stacked = jax.tree_util.tree_leaves(trainer.state.params["layers"])
    assert stacked and all(leaf.shape[0] == 5 for leaf in stacked)  # every layer, the one left over too
    before = jax.tree_util.tree_map(np.asarray, trainer.state.params)
    for _ in range(2):
        metrics = trainer.step()
    assert np.isfinite(float(metrics["loss"])) and int(metrics["nonfinite_steps"]) == 0
    moved = jax.tree_util.tree_map(lambda a, b: float(np.abs(np.asarray(a) - b).max()), trainer.state.params, before)
    assert min(jax.tree_util.tree_leaves(moved)) > 0  # every trained leaf
