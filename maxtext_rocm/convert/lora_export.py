"""`to-hf` of a LoRA run: the merged model (W + (alpha / r) A B in every adapted kernel), or with
`--adapter` a PEFT adapter folder (adapter_config.json + adapter_model.safetensors) for the base
model the run started from, which `peft.PeftModel.from_pretrained(base, OUT)` loads.

A run's checkpoints hold its adapters; the base is found where the run found it (its config.json's
checkpoint.load_params_from, or without one train.seed's initialisation, made again) by
checkpoint/lora_run.py, which every reader shares: verified, and compared with the base identity
the run recorded. The merge reads the base in the precision it was stored (the export's fp32, not
the compute-dtype copy the run trained against) and the output dtype is applied once, when the
tensors are written.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from maxtext_rocm.convert.mapping import ATTENTION, DENSE_MLP, layer_path, leaf

# Our (block module, layer) -> the Hugging Face module inside a decoder layer, from the weight
# mapping ("self_attn.q_proj.weight" <- ("attention", "q", "kernel")).
HF_MODULES = {path[:2]: name.removesuffix(".weight") for name, (path, _) in {**ATTENTION, **DENSE_MLP}.items()
              if path[-1] == "kernel"}


def _loaded_run(checkpoint_dir: Path, cfg):
    """The run's base and adapters through the one loader every reader uses (checkpoint/lora_run.py):
    verified, and refused in one sentence where the base or the adapters' settings are not the ones
    the run trained with."""
    from maxtext_rocm.checkpoint import lora_run

    return lora_run.load_run(checkpoint_dir, cfg)


def merged_params(checkpoint_dir: Path, cfg):
    """The merged model of a LoRA run: W + (alpha / r) A B in each adapted kernel, computed in fp32
    from the base as stored (never from a rounded copy), in fp32."""
    from maxtext_rocm.checkpoint import lora_run

    return lora_run.merged_params(_loaded_run(checkpoint_dir, cfg), cfg)


def _per_layer(tree, m):
    """[(layer index, the layer's subtree)] of a tree laid out as model group `m`'s layers are
    (mapping.layer_path: stacked, stacked by unit, or unrolled)."""
    import jax

    layers = []
    for i in range(m.n_layers):
        path, index = layer_path(m, i)
        layers.append((i, jax.tree_util.tree_map(lambda x, index=index: x[index] if index else x, leaf(tree, path))))
    return layers


def peft_tensors(adapters, cfg, dtype) -> dict[str, np.ndarray]:
    """PEFT's tensors for our adapters: lora_A.weight [r, in] = A flattened and transposed,
    lora_B.weight [out, r] likewise, named as PeftModel saves a LlamaForCausalLM's adapters."""
    tensors = {}
    rank = cfg.lora.rank
    for i, layer in _per_layer(adapters, cfg.model):
        for block, modules in layer.items():
            for name, dot in modules.items():
                module = HF_MODULES[(block, name)]
                prefix = f"base_model.model.model.layers.{i}.{module}"
                a, b = dot["dot"]["a"], dot["dot"]["b"]
                tensors[f"{prefix}.lora_A.weight"] = np.ascontiguousarray(a.reshape(-1, rank).T.astype(dtype))
                tensors[f"{prefix}.lora_B.weight"] = np.ascontiguousarray(b.reshape(rank, -1).T.astype(dtype))
    return tensors


def adapter_config(cfg, base_name: str) -> dict:
    """PEFT's adapter_config.json for cfg.lora (its LoraConfig fields, defaults spelled out)."""
    modules = sorted({HF_MODULES[key].split(".")[-1] for key in HF_MODULES if key[1] in cfg.lora.targets})
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_name,
            "r": int(cfg.lora.rank), "lora_alpha": float(cfg.lora.alpha), "lora_dropout": float(cfg.lora.dropout),
            "target_modules": modules, "bias": "none", "fan_in_fan_out": False, "use_rslora": False,
            "use_dora": False, "init_lora_weights": True, "modules_to_save": None, "inference_mode": True}


def write_adapter(checkpoint_dir: Path, cfg, out_dir: Path, dtype: str, base_name: str) -> Path:
    """`to-hf RUN OUT --adapter`: PEFT's two files in out_dir (written whole or not at all), for the
    base model `base_name` names (the original Hugging Face folder, which PEFT loads by that name)."""
    from safetensors.numpy import save_file

    from maxtext_rocm.convert import files as files_lib
    from maxtext_rocm.convert.output import written_atomically

    # The base is read too: an adapter exported for another base than the one it trained on is refused.
    tensors = peft_tensors(_loaded_run(checkpoint_dir, cfg).adapters, cfg, files_lib.numpy_dtype(dtype))
    with written_atomically(out_dir) as tmp:
        save_file(tensors, str(tmp / "adapter_model.safetensors"), metadata={"format": "pt"})
        config = adapter_config(cfg, base_name)
        (tmp / "adapter_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out_dir
