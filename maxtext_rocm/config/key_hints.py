"""The hint an unknown config key gets: the key a user most likely meant.

Users bring names from other trainers (Hugging Face's Trainer and PEFT, MaxText, nanoGPT); those
with a real counterpart here are in SYNONYMS, written out so that each one is a decision, not a
guess. Otherwise: the same name in another group (`train.lr` -> `optimizer.lr`), then a close
spelling (difflib), of the group or of the whole key.
"""

from __future__ import annotations

import difflib

import ml_collections

# Another trainer's name -> the key that does the same here. Only exact counterparts: HF's
# `eval_steps` (an interval) is not train.eval_steps (batches per evaluation), and `num_train_epochs`
# is not data.epochs (a limit that stops the run with an error), so neither is here.
SYNONYMS = {
    # optimizer
    "learning_rate": "optimizer.lr",
    "lr_warmup_steps": "optimizer.warmup_steps",
    "warmup_iters": "optimizer.warmup_steps",
    "lr_scheduler_type": "optimizer.schedule",
    "max_grad_norm": "optimizer.clip_norm",
    "grad_clip": "optimizer.clip_norm",
    "gradient_clipping_threshold": "optimizer.clip_norm",
    "adam_beta1": "optimizer.b1",
    "adam_beta2": "optimizer.b2",
    "adam_epsilon": "optimizer.eps",
    # train
    "max_steps": "train.steps",
    "num_train_steps": "train.steps",
    "max_iters": "train.steps",
    "batch_size": "train.per_device_batch_size",
    "per_device_train_batch_size": "train.per_device_batch_size",
    "gradient_accumulation_steps": "train.grad_accum",
    "max_seq_length": "train.seq_len",
    "max_target_length": "train.seq_len",
    "seq_length": "train.seq_len",
    "block_size": "train.seq_len",
    "eval_interval": "train.eval_every",
    # checkpoint and log
    "save_steps": "checkpoint.every",
    "checkpoint_period": "checkpoint.every",
    "save_total_limit": "checkpoint.keep",
    "logging_steps": "log.every",
    "log_interval": "log.every",
    # model
    "num_hidden_layers": "model.n_layers",
    "num_layers": "model.n_layers",
    "n_layer": "model.n_layers",
    "base_num_decoder_layers": "model.n_layers",
    "hidden_size": "model.d_model",
    "emb_dim": "model.d_model",
    "n_embd": "model.d_model",
    "num_attention_heads": "model.n_heads",
    "n_head": "model.n_heads",
    "num_key_value_heads": "model.n_kv_heads",
    "intermediate_size": "model.mlp_dim",
    "moe_intermediate_size": "model.moe_mlp_dim",
    "rms_norm_eps": "model.norm_eps",
    "remat_policy": "model.remat",
    # lora (PEFT's LoraConfig)
    "r": "lora.rank",
    "lora_r": "lora.rank",
    "lora_alpha": "lora.alpha",
    "lora_dropout": "lora.dropout",
    "target_modules": "lora.targets",
}


def dotted_keys(cfg: ml_collections.ConfigDict, prefix: str = "") -> list[str]:
    """Every leaf key of `cfg`, dotted (`mesh.ici.fsdp`)."""
    keys = []
    for name, value in cfg.items():
        if isinstance(value, ml_collections.ConfigDict):
            keys += dotted_keys(value, f"{prefix}{name}.")
        else:
            keys.append(f"{prefix}{name}")
    return keys


def _exists(cfg: ml_collections.ConfigDict, key: str) -> bool:
    node = cfg
    for part in key.split("."):
        if not isinstance(node, ml_collections.ConfigDict) or part not in node:
            return False
        node = node[part]
    return True


def suggestion(cfg: ml_collections.ConfigDict, key: str, depth: int) -> str | None:
    """The key most likely meant by `key`, whose part at `depth` does not exist; None if nothing is near."""
    parts = key.split(".")
    unknown, leaf = parts[depth], parts[-1]
    for name in (unknown, leaf):  # another trainer's name, for the key or for the group it names
        if name in SYNONYMS and _exists(cfg, SYNONYMS[name]):
            return SYNONYMS[name]
    every = dotted_keys(cfg)
    if depth == len(parts) - 1:  # the right name in another group: train.lr -> optimizer.lr
        elsewhere = [k for k in every if k.split(".")[-1] == leaf]
        if len(elsewhere) == 1:
            return elsewhere[0]
    node = cfg
    for part in parts[:depth]:
        node = node[part]
    close = difflib.get_close_matches(unknown, list(node.keys()), n=1)
    if close:  # a misspelt group or key: the whole key where the rest of it exists
        fixed = ".".join(parts[:depth] + close + parts[depth + 1:])
        return fixed if _exists(cfg, fixed) else ".".join(parts[:depth] + close)
    close = difflib.get_close_matches(key, every, n=1) or difflib.get_close_matches(leaf, list(SYNONYMS), n=1,
                                                                                    cutoff=0.85)
    if close:
        return SYNONYMS.get(close[0], close[0])
    return None
