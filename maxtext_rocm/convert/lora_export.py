"""`to-hf` of a LoRA run: the merged model (W + (alpha / r) A B in every adapted kernel), or with
`--adapter` a PEFT adapter folder (adapter_config.json + adapter_model.safetensors) for the base
model the run started from, which `peft.PeftModel.from_pretrained(base, OUT)` loads.

A run's checkpoints hold its adapters; the base is found where the run found it (its config.json's
checkpoint.load_params_from, or without one train.seed's initialisation, made again), verified as
every reader verifies it.
"""

from __future__ import annotations

import json
import shutil
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


def lora_run_params(checkpoint_dir: Path, cfg):
    """(base params, adapters) of a LoRA run on the host, both verified; the base in the compute
    dtype the run trained against (the frozen base is held so), as numpy arrays."""
    import jax
    import jax.numpy as jnp

    from maxtext_rocm.checkpoint import restore_params, restore_params_to_host
    from maxtext_rocm.numerics.precision import policy_from_config

    adapters = restore_params(checkpoint_dir, _initialised(cfg, lora.ADAPTERS, abstract_only=True))
    pointer = base_pointer(cfg)
    if pointer:
        if not Path(pointer).is_dir():
            raise ConvertError(f"the LoRA run's base, checkpoint.load_params_from={pointer!r} in its config.json, "
                               "is not a directory; put the base back there to export the run")
        base = restore_params_to_host(pointer, cfg)
    else:
        base = _initialised(cfg, "params", abstract_only=False)
    dtype = policy_from_config(cfg.precision, jax.local_devices(backend="cpu")[0]).compute_dtype
    base = jax.tree_util.tree_map(lambda x: np.asarray(jnp.asarray(x).astype(dtype)), base)
    return base, jax.tree_util.tree_map(np.asarray, adapters)


def merged_params(checkpoint_dir: Path, cfg):
    """The merged model of a LoRA run: base + (alpha / r) A B in each adapted kernel, in fp32."""
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


def write_adapter(checkpoint_dir: Path, cfg, out_dir: Path, dtype: str, staging) -> Path:
    """`to-hf RUN OUT --adapter`: PEFT's two files in out_dir, written into `staging(out_dir)` and
    renamed into place at the end."""
    from safetensors.numpy import save_file

    from maxtext_rocm.checkpoint import restore_params
    from maxtext_rocm.convert import files as files_lib

    adapters = restore_params(checkpoint_dir, _initialised(cfg, lora.ADAPTERS, abstract_only=True))
    import jax

    tensors = peft_tensors(jax.tree_util.tree_map(np.asarray, adapters), cfg, files_lib.numpy_dtype(dtype))
    tmp = staging(out_dir)
    try:
        save_file(tensors, str(tmp / "adapter_model.safetensors"), metadata={"format": "pt"})
        config = adapter_config(cfg, base_pointer(cfg))
        (tmp / "adapter_config.json").write_text(json.dumps(config, indent=2) + "\n")
        tmp.rename(out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir
