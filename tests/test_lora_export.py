"""A LoRA run back to Hugging Face: `to-hf RUN OUT` (merged) and `to-hf RUN OUT --adapter` (PEFT),
checked through transformers and peft on a tiny Llama and a tiny Qwen2.5. Skipped without peft (the test extra has it)."""

import copy
import json

import jax
import numpy as np
import pytest

pytest.importorskip("peft")
from test_convert import make_hf, hf_logits, max_err, tokens_for, TOL  # noqa: E402
from test_families import make_family  # noqa: E402

import maxtext_rocm as mr  # noqa: E402
from maxtext_rocm import config as config_lib  # noqa: E402
from maxtext_rocm.convert.__main__ import main as convert_main  # noqa: E402
from maxtext_rocm.train import Trainer  # noqa: E402

TARGETS = ("q", "v", "o", "down")  # some of each block, so untouched matrices are checked too
RANK = 4


# A Llama, and a Qwen2.5 (q/k/v biases beside the adapted kernels; tied embeddings).
MAKERS = {"llama": make_hf, "qwen2": lambda path: make_family(path, "qwen2")}


@pytest.mark.slow  # a run, two exports, transformers and peft: ~3 minutes under this CPU's shared load
@pytest.mark.parametrize("family", list(MAKERS))
def test_merged_and_peft_exports_give_the_same_logits(family, tmp_path, devices):
    """A LoRA run from an imported model: the merged export in transformers, the PEFT adapter on
    the original model through peft, and our forward pass with the adapters agree; only targeted
    matrices differ from the original, each by a matrix of rank <= lora.rank."""
    import peft
    import torch
    import transformers

    original = MAKERS[family](tmp_path / "hf")
    assert convert_main(["from-hf", str(tmp_path / "hf"), str(tmp_path / "export"),
                         "--config.model.scan_layers=true"]) == 0
    cfg = config_lib.load(str(tmp_path / "export" / "preset.py"), overrides={
        "precision.policy": "fp32", "data.source": "synthetic", "train.seq_len": 32,
        "train.per_device_batch_size": 1, "train.steps": 3, "log.every": 1, "log.tensorboard": False,
        "checkpoint.async_save": False, "optimizer.lr": 3e-2, "optimizer.warmup_steps": 0,
        "lora.rank": RANK, "lora.alpha": 8.0, "lora.targets": TARGETS, "output_dir": str(tmp_path / "run")})
    trainer = Trainer(cfg, devices=devices[:2], log=lambda *_: None)
    trainer.run()
    trainer.close()
    adapters = jax.tree_util.tree_map(np.asarray, trainer.state.params)
    frozen = jax.tree_util.tree_map(np.asarray, trainer.state.frozen)

    assert convert_main(["to-hf", str(tmp_path / "run"), str(tmp_path / "merged")]) == 0
    assert convert_main(["to-hf", str(tmp_path / "run"), str(tmp_path / "adapter"), "--adapter"]) == 0
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert config["r"] == RANK and sorted(config["target_modules"]) == ["down_proj", "o_proj", "q_proj", "v_proj"]

    tokens = tokens_for(cfg.model.vocab_size)
    merged_logits = hf_logits(tmp_path / "merged", tokens)
    base = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    peft_model = peft.PeftModel.from_pretrained(base, tmp_path / "adapter").eval()
    peft_logits = hf_logits(peft_model, tokens)
    plain = copy.deepcopy(cfg)
    plain.lora.rank = 0
    ours = np.asarray(mr.forward(plain, merge_by_hand(frozen, adapters, 8.0 / RANK), tokens))
    errors = {"peft vs merged": max_err(peft_logits, merged_logits), "ours vs merged": max_err(ours, merged_logits),
              "merged vs original": max_err(merged_logits, hf_logits(original, tokens))}
    print(errors)
    assert errors["peft vs merged"] <= TOL and errors["ours vs merged"] <= TOL
    assert errors["merged vs original"] > 100 * TOL, "training moved the adapters"

    from safetensors.numpy import load_file

    before = {**load_file(tmp_path / "hf" / "model.safetensors")}
    after = {**load_file(tmp_path / "merged" / "model.safetensors")}
    adapted = {"self_attn.q_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.down_proj"}
    for name, value in before.items():
        change = after[name] - value
        if name.endswith(".weight") and any(f".{module}." in name for module in adapted):
            assert 0 < np.linalg.matrix_rank(change, tol=1e-5) <= RANK, name
        else:
            np.testing.assert_array_equal(after[name], value, err_msg=name)


def merge_by_hand(frozen, adapters, scale):
    """W + scale A B for every adapted kernel, written out on the host."""
    merged = jax.tree_util.tree_map(np.array, frozen)
    for block, modules in adapters["layers"].items():
        for name, dot in modules.items():
            a, b = dot["dot"]["a"], dot["dot"]["b"]
            kernel = merged["layers"][block][name]["kernel"]
            for layer in range(kernel.shape[0]):
                product = a[layer].reshape(-1, RANK) @ b[layer].reshape(RANK, -1)
                kernel[layer] += scale * product.reshape(kernel.shape[1:])
    return merged


@pytest.mark.slow  # a run of its own
def test_adapter_export_of_a_run_without_lora_is_refused(tmp_path, capsys, devices):
    from conftest import small_config

    cfg = small_config(**{"output_dir": str(tmp_path / "run"), "train.steps": 1, "checkpoint.async_save": False})
    Trainer(cfg, devices=devices[:1], log=lambda *_: None).run()
    assert convert_main(["to-hf", str(tmp_path / "run"), str(tmp_path / "out"), "--adapter"]) == 2
    assert "not from a LoRA run" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
