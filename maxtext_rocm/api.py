"""The notebook-facing functions that `maxtext_rocm/__init__.py` re-exports.

    import maxtext_rocm as mr
    cfg = mr.load_config("tiny_llama", {"precision.policy": "fp32"})
    params = mr.init_params(cfg, seed=0)            # sharded over the current devices
    mr.loss(cfg, params, batch)                     # the trainer's token-mean cross-entropy
    mr.forward(cfg, params, tokens)                 # logits
    mr.count_params(cfg)                            # from shapes alone
    params = mr.load_params("runs/tiny_llama")      # a run dir, a checkpoint, or an export
    cfg = mr.run_config("runs/tiny_llama")          # the config that run was made with

Each takes a config as loaded (or as a run recorded it) and resolves its "auto"s for this
process's devices (maxtext_rocm/resolve.py) before it builds a model.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import ml_collections
from flax import linen as nn

from maxtext_rocm.trainer import compilation
from maxtext_rocm import config as config_lib
from maxtext_rocm.parallel import sharding
from maxtext_rocm import models
from maxtext_rocm.models import build_model
from maxtext_rocm.numerics.precision import policy_from_config
from maxtext_rocm.resolve import resolve_here
from maxtext_rocm.trainer.step import summed_loss


def _param_mesh(cfg) -> jax.sharding.Mesh:
    """The run's mesh over the current devices; all-FSDP where that mesh does not fit them (a run
    trained with tensor=8, loaded on one device) or does not divide the model's dimensions."""
    try:
        mesh = sharding.make_mesh(cfg.mesh)
        if sharding.check_param_divisibility(cfg.model, dict(mesh.shape)) is None:
            return mesh
    except config_lib.ConfigError:
        pass
    mesh = sharding.make_mesh(config_lib.defaults().mesh)
    if sharding.check_param_divisibility(cfg.model, dict(mesh.shape)) is None:
        return mesh
    return sharding.make_mesh(config_lib.defaults().mesh, jax.devices()[:1])


def _abstract_params(cfg):
    """(boxed abstract params, their shardings on the current devices)."""
    cfg = resolve_here(cfg)
    model = build_model(cfg.model, policy_from_config(cfg.precision))
    boxed = jax.eval_shape(lambda k: model.init(k, jnp.zeros((1, 8), jnp.int32))["params"], jax.random.key(0))
    shardings = sharding.logical_to_sharding(nn.get_partition_spec(boxed), _param_mesh(cfg))
    return model, boxed, shardings


def init_params(cfg, seed: int = 0):
    """Fresh parameters of `cfg`'s model, each array created directly in its sharding over the
    current devices (the mesh of cfg.mesh). The same values as a Trainer with train.seed=seed."""
    model, boxed, shardings = _abstract_params(cfg)
    init = jax.jit(lambda k: nn.meta.unbox(model.init(k, jnp.zeros((1, 8), jnp.int32))["params"]),
                   out_shardings=shardings)
    n_values = sum(x.size for x in jax.tree_util.tree_leaves(nn.meta.unbox(boxed)))
    key = jax.random.key(seed)
    return compilation.run_init(compilation.lower_init(init, key), key, n_values)


def run_config(path) -> ml_collections.ConfigDict:
    """The config a run was made with, from the config.json of a run directory, of the run above a
    checkpoints/ or checkpoints/<step> directory, or of a params export."""
    from maxtext_rocm.checkpoint.params import run_config as read  # orbax, imported when needed

    return read(path)


def load_params(path, cfg=None):
    """The parameters saved in a run directory (its newest intact checkpoint), a checkpoints/<step>
    directory or a params export, sharded like `init_params` would shard them, verified against
    the checksums saved with them (CheckpointError if a named step or export is damaged). `cfg`
    defaults to the run's own config (`run_config(path)`).

    A LoRA run's parameters are its merged model, W + (alpha / r) A B in each adapted kernel, on
    the base the run trained on (verified against the run's record: finetune/lora_base.py)."""
    cfg = run_config(path) if cfg is None else cfg  # each reader below resolves it for this device
    _, boxed, shardings = _abstract_params(cfg)
    abstract = jax.tree_util.tree_map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                                      nn.meta.unbox(boxed), shardings)
    from maxtext_rocm.finetune import lora_base

    if lora_base.is_lora_run(cfg):  # its checkpoints hold adapters; the model is base + adapters
        from maxtext_rocm.checkpoint import lora_run

        run = lora_run.load_run(path, cfg)
        merged = lora_run.merged_params(run, cfg)
        return jax.tree_util.tree_map(lambda x, a: jax.device_put(x.astype(a.dtype), a.sharding), merged, abstract)
    from maxtext_rocm.checkpoint import restore_params  # orbax, imported when needed

    return restore_params(path, abstract)


@functools.lru_cache(maxsize=8)
def _jitted_loss(model_cfg: ml_collections.FrozenConfigDict, policy):
    model = build_model(model_cfg, policy)

    def mean_loss(params, batch):
        _, sums = summed_loss(params, model, batch, 0.0)
        return sums["ce"] / jnp.maximum(sums["tokens"], 1.0)
    return jax.jit(mean_loss)


def loss(cfg, params, batch) -> jax.Array:
    """Token-mean cross-entropy of `batch` ({"inputs", "targets"} [batch, seq], optional
    "weights", "positions", "segment_ids"), the trainer's "loss" metric. Not for fp8 delayed
    scaling, whose state lives in the Trainer (use `trainer.state`)."""
    params = nn.meta.unbox(params)
    if set(params) == {"params"}:
        params = params["params"]
    batch = {k: jnp.asarray(v) for k, v in batch.items()}
    batch.setdefault("weights", jnp.ones(batch["targets"].shape, jnp.float32))
    cfg = resolve_here(cfg, seq_len=batch["targets"].shape[1])
    policy = policy_from_config(cfg.precision)
    return _jitted_loss(ml_collections.FrozenConfigDict(cfg.model), policy)(params, batch)


def forward(cfg, params, tokens) -> jax.Array:
    """Logits [batch, seq, vocab] of `tokens` [batch, seq] (models.forward), with `cfg` resolved
    for this device and the tokens' length."""
    return models.forward(resolve_here(cfg, seq_len=jnp.shape(tokens)[1]), params, tokens)


def abstract_params(cfg):
    """Parameter shapes (boxed with their logical axes) without allocating anything."""
    return models.abstract_params(resolve_here(cfg))


def count_params(cfg) -> int:
    """The number of parameters of `cfg`'s model, computed from shapes only."""
    return models.count_params(resolve_here(cfg))


def count_active_params(cfg) -> int:
    """The parameters one token passes through (models.count_active_params), from shapes only."""
    return models.count_active_params(resolve_here(cfg))
