"""What docs/models.md says is not supported yet, and how each is refused: `convert from-hf` on a
Hugging Face folder whose config.json holds it prints one sentence naming the file and the key,
exits 2 and writes nothing; `to_hf` refuses a model its family's class cannot hold. Each quoted
sentence must stand on the page as the command prints it."""

import json
import shutil
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from maxtext_rocm.convert.__main__ import main as convert_main  # noqa: E402

PAGE = (Path(__file__).resolve().parent.parent / "docs" / "models.md").read_text()
SUPPORTED = ("LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM, Gemma3ForCausalLM, "
             "MixtralForCausalLM, Qwen3MoeForCausalLM, GptOssForCausalLM, Gemma3ForConditionalGeneration")
# (the folder it starts from, what config.json gets, what from-hf says; the page quotes it, or for
# another class or the second key of a row, names it as `shown`)
ARCHITECTURES = {
    "Gemma2ForCausalLM": "gemma2",
    "Llama4ForCausalLM": "llama4_text", "DeepseekV3ForCausalLM": "deepseek_v3", "Qwen2MoeForCausalLM": "qwen2_moe",
}
CASES = {
    **{name: ("qwen3", dict(architectures=[name], model_type=kind), f"describes a {name}, which cannot be converted")
       for name, kind in ARCHITECTURES.items()},
    "layer_types": ("qwen3", dict(layer_types=["sliding_attention", "full_attention"], sliding_window=8),
                    "layers of different attention kinds are not supported yet"),
    "use_sliding_window": ("qwen3", dict(use_sliding_window=True, sliding_window=8),
                           "sets use_sliding_window=true (a window on the layers from max_window_layers on), which is not supported yet"),
    "attention_bias": ("qwen3", dict(attention_bias=True),
                       "sets attention_bias=true; this code base's layers have biases only on q, k and v (Qwen2's) "
                       "and, in gpt-oss alone, on the attention output and the experts, never on a dense MLP"),
    "mlp_bias": ("qwen3", dict(mlp_bias=True), "sets mlp_bias=true; this code base's layers have biases only"),
    "mlp_only_layers": ("qwen3_moe", dict(mlp_only_layers=[1]),
                        "sets mlp_only_layers or decoder_sparse_step, so some layers are dense; a mixture of experts "
                        "on every layer is supported, not a mix"),
    "decoder_sparse_step": ("qwen3_moe", dict(decoder_sparse_step=2),
                            "sets mlp_only_layers or decoder_sparse_step, so some layers are dense"),
    "hidden_act": ("qwen3", dict(hidden_act="relu"),
                   "sets hidden_act='relu'; only SwiGLU ('silu') and GeGLU ('gelu_pytorch_tanh') MLPs are supported"),
    "final_logit_softcapping": ("qwen3", dict(final_logit_softcapping=30.0),
                                "sets final_logit_softcapping=30.0: a tanh cap on the logits, which this code base "
                                "does not have"),
    "rope_type": ("qwen3", dict(rope_parameters={"rope_type": "dynamic", "factor": 4.0, "rope_theta": 1e6}),
                  "asks for rope_type 'dynamic'; only 'default', 'linear', Llama 3.1's 'llama3' and 'yarn' frequency "
                  "scaling are supported"),
}
SHOWN = {**{name: f"`{name}`" for name in ARCHITECTURES}, "mlp_bias": "`mlp_bias: true`",
         "decoder_sparse_step": "`decoder_sparse_step` other than 1"}


@pytest.fixture(scope="module")
def published(tmp_path_factory) -> dict[str, Path]:
    """Tiny random Qwen3 and Qwen3-MoE folders saved by transformers: what the cases edit."""
    base = tmp_path_factory.mktemp("published")
    shapes = dict(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=8)
    models = {"qwen3": transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**shapes, intermediate_size=64)),
              "qwen3_moe": transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
                  **shapes, moe_intermediate_size=16, num_experts=4, num_experts_per_tok=2))}
    for name, model in models.items():
        model.save_pretrained(base / name)
    return {name: base / name for name in models}


def test_the_folders_convert_as_they_are(published, tmp_path):
    """Without the edits, both folders convert: each refusal below is the edit's doing."""
    for name, folder in published.items():
        assert convert_main(["from-hf", str(folder), str(tmp_path / name)]) == 0


@pytest.mark.parametrize("case", list(CASES))
def test_from_hf_refuses_in_the_sentence_the_page_quotes(case, published, tmp_path, capsys):
    base, edits, sentence = CASES[case]
    folder = tmp_path / "hf"
    shutil.copytree(published[base], folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, **edits}))
    capsys.readouterr()
    assert convert_main(["from-hf", str(folder), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err == f"error: {folder / 'config.json'} {err.split('config.json ', 1)[1]}" and err.count("\n") == 1, err
    assert sentence in err, err
    shown = SHOWN.get(case, sentence)
    assert shown in PAGE, f"docs/models.md does not show {shown!r}"
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out.tmp-*"))
    if case in ARCHITECTURES:
        assert f"supported architectures are {SUPPORTED}" in err and SUPPORTED in PAGE


def test_to_hf_refuses_options_the_family_class_cannot_hold(tmp_path):
    """Head norms under family llama: LlamaForCausalLM would load the model without them."""
    from conftest import small_config

    import maxtext_rocm as mr
    from maxtext_rocm.convert import ConvertError, to_hf

    cfg = small_config(**{"model.qk_norm": True})
    params = mr.init_params(cfg)
    sentence = "model.qk_norm=True cannot be written as a LlamaForCausalLM (model.family='llama')"
    with pytest.raises(ConvertError, match=sentence.replace("(", r"\(").replace(")", r"\)")):
        to_hf(cfg, params, tmp_path / "out")
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out.tmp-*"))
    assert "model.qk_norm=True" in PAGE and 'model.family="llama"' in PAGE
