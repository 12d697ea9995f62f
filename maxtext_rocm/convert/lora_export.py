"""`to-hf` of a LoRA run: the merged model (W + (alpha / r) A B in every adapted kernel), or with
`--adapter` a PEFT adapter folder (adapter_config.json + adapter_model.safetensors) for the base
model the run started from, which `peft.PeftModel.from_pretrained(base, OUT)` loads.

A run's checkpoints hold its adapters; the base is found where the run found it (its config.json's
checkpoint.load_params_from, or without one train.seed's initialisation, made again), verified as
every reader verifies it, in `load_base` alone. The merge reads the base in the precision it was
stored (the export's fp32, not the compute-dtype copy the run trained against) and the output
dtype is applied once, when the tensors are written.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from maxtext_rocm.convert.hf_config import ConvertError
from maxtext_rocm.convert.mapping import ATTENTION, DENSE_MLP
from maxtext_rocm.finetune import lora

# Our (block module, layer) -> the Hugging Face module inside a decoder layer, from the weight
# mapping ("self_attn.q_proj.weight" <- ("attention", "q", "kernel")).
HF_MODULES = {path[:2]: name.removesuffix(".weight") for name, (path, _) in {**ATTENTION, **DENSE_MLP}.items()
              if path[-1] == "kernel"}


def _host_tree(abstract):
    import jax

    host = jax.sharding.SingleDeviceSharding(jax.local_devices(backend="cpu")[0])
    return jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=host), abstract)


def _lora_model(cfg):
    import jax
    from maxtext_rocm.models import build_model
    from maxtext_rocm.numerics.precision import policy_from_config

    cpu = jax.local_devices(backend="cpu")[0]
    return build_model(cfg.model, lora.policy_with_lora(policy_from_config(cfg.precision, cpu), cfg.lora))


def _initialised(cfg, collection: str, abstract_only: bool):
    """`collection` of the LoRA model's initialisation from train.seed, as the trainer made it
    (launch.stored_state), on the host; or only its shapes."""
    import jax
    import jax.numpy as jnp
    from flax import linen as nn

    model = _lora_model(cfg)
    tokens = jnp.zeros((1, min(cfg.train.seq_len, 8)), jnp.int32)
    init = lambda key: nn.meta.unbox(model.init(key, tokens)[collection])  # noqa: E731
    if abstract_only:
        return _host_tree(jax.eval_shape(init, jax.random.key(cfg.train.seed)))
    with jax.default_device(jax.local_devices(backend="cpu")[0]):
        return jax.tree_util.tree_map(np.asarray, jax.jit(init)(jax.random.key(cfg.train.seed)))


def base_pointer(cfg) -> str:
    return cfg.checkpoint.get("load_params_from", "") or ""


def load_base(cfg):
    """The LoRA run's base parameters on the host, verified, as stored (the parameter dtype: fp32):
    the one place a LoRA export reads its base. (A check of the base's identity against the one the
    run recorded belongs here, beside the verification of its checksums.)"""
    from maxtext_rocm.checkpoint import restore_params_to_host

    pointer = base_pointer(cfg)
    if not pointer:
        return _initialised(cfg, "params", abstract_only=False)
    if not Path(pointer).is_dir():
        raise ConvertError(f"the LoRA run's base, checkpoint.load_params_from={pointer!r} in its config.json, "
                           "is not a directory; put the base back there to export the run")
    return restore_params_to_host(pointer, cfg)


def load_adapters(checkpoint_dir: Path, cfg):
    """The run's adapters from `checkpoint_dir` on the host, verified."""
    import jax

    from maxtext_rocm.checkpoint import restore_params

    adapters = restore_params(checkpoint_dir, _initialised(cfg, lora.ADAPTERS, abstract_only=True))
    return jax.tree_util.tree_map(np.asarray, adapters)


def lora_run_params(checkpoint_dir: Path, cfg):
    """(base params, adapters) of a LoRA run on the host as numpy arrays, both verified, each in
    the precision it was stored in."""
    import jax

    base = jax.tree_util.tree_map(np.asarray, load_base(cfg))
    return base, load_adapters(checkpoint_dir, cfg)


def merged_params(checkpoint_dir: Path, cfg):
    """The merged model of a LoRA run: W + (alpha / r) A B in each adapted kernel, computed in fp32
    from the base as stored (never from a rounded copy), in fp32."""
    import jax

    base, adapters = lora_run_params(checkpoint_dir, cfg)
    base = jax.tree_util.tree_map(lambda x: np.asarray(x, np.float32), base)
    return lora.merge(base, adapters, cfg.lora, xp=np)


def _per_layer(tree, n_layers: int, scanned: bool):
    """[(layer index, the layer's subtree)] of a stacked (scanned) or unrolled tree."""
    import jax

    if scanned:
        return [(i, jax.tree_util.tree_map(lambda x, i=i: x[i], tree["layers"])) for i in range(n_layers)]
    return [(i, tree[f"layers_{i}"]) for i in range(n_layers)]


def peft_tensors(adapters, cfg, dtype) -> dict[str, np.ndarray]:
    """PEFT's tensors for our adapters: lora_A.weight [r, in] = A flattened and transposed,
    lora_B.weight [out, r] likewise, named as PeftModel saves a LlamaForCausalLM's adapters."""
    tensors = {}
    rank = cfg.lora.rank
    for i, layer in _per_layer(adapters, cfg.model.n_layers, cfg.model.scan_layers):
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

    tensors = peft_tensors(load_adapters(checkpoint_dir, cfg), cfg, files_lib.numpy_dtype(dtype))
    with written_atomically(out_dir) as tmp:
        save_file(tensors, str(tmp / "adapter_model.safetensors"), metadata={"format": "pt"})
        config = adapter_config(cfg, base_name)
        (tmp / "adapter_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out_dir
