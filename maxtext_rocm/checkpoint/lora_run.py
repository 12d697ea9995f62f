"""The one loader of a LoRA run's base and adapters, for every reader (`checkpoint verify|export`,
`generate`, `load_params`, `convert to-hf`), and the base identities the trainer records.

A LoRA checkpoint holds the adapters alone; the base is found where the run found it
(checkpoint.load_params_from, or train.seed's initialisation, made again), verified as every
reader verifies, and compared with the identity the checkpoint recorded (finetune/lora_base.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from maxtext_rocm.checkpoint.checksums import json_digest, summarise
from maxtext_rocm.checkpoint.reading import (checkpoint_meta, host_abstract_params, read_params, restore_params_checked,
                                             say_warning)
from maxtext_rocm.finetune import lora, lora_base
from maxtext_rocm.finetune.lora_base import BaseChanged, BaseIdentity


def loaded_identity(pointer: str, sums: dict[str, str]) -> BaseIdentity:
    """The identity of a base read from `pointer`, verified against its stored checksums `sums`."""
    return BaseIdentity(str(pointer), None, json_digest(sums), jax.default_backend())


def seed_identity(seed: int, base, program: str) -> BaseIdentity:
    """The identity of a base made from `seed`: `base` in the compute dtype, as the run holds it,
    made by `program` ("train": the trainer's init; "reader": a reader's, on the host)."""
    sums, _ = summarise({"params": base})
    return BaseIdentity("", int(seed), json_digest(sums), lora_base.made_on(base, program))


def _host_tree(abstract):
    host = jax.sharding.SingleDeviceSharding(jax.local_devices(backend="cpu")[0])
    return jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=host), abstract)


def _lora_model(cfg):
    from maxtext_rocm.models import build_model
    from maxtext_rocm.numerics.precision import policy_from_config
    from maxtext_rocm.resolve import resolve_here

    cpu = jax.local_devices(backend="cpu")[0]
    cfg = resolve_here(cfg)
    return build_model(cfg.model, lora.policy_with_lora(policy_from_config(cfg.precision, cpu), cfg.lora))


def initialised(cfg, collection: str, abstract_only: bool = False):
    """`collection` ("params": the base in fp32; lora.ADAPTERS) of the LoRA model's initialisation
    from train.seed, as the trainer made it (launch.stored_state), as numpy arrays on the host; or
    only its shapes, placed on the host."""
    from flax import linen as nn

    model = _lora_model(cfg)
    tokens = jnp.zeros((1, min(cfg.train.seq_len, 8)), jnp.int32)
    init = lambda key: nn.meta.unbox(model.init(key, tokens)[collection])  # noqa: E731
    if abstract_only:
        return _host_tree(jax.eval_shape(init, jax.random.key(cfg.train.seed)))
    with jax.default_device(jax.local_devices(backend="cpu")[0]):
        return jax.tree_util.tree_map(np.asarray, jax.jit(init)(jax.random.key(cfg.train.seed)))


def _compute_dtype(cfg):
    from maxtext_rocm.numerics.precision import policy_from_config

    return policy_from_config(cfg.precision, jax.local_devices(backend="cpu")[0]).compute_dtype


class LoraRun(NamedTuple):
    """A LoRA run's parts on the host, each verified: `base` as it is stored (fp32: an export's
    values, or the seed's initialisation before the cast to the compute dtype), `adapters`, the
    checkpoint step they came from, the base's identity (checked against the run's record), and
    check_base's warning where it let the base through."""
    base: Any
    adapters: Any
    checkpoint: Path
    identity: BaseIdentity
    warning: str | None


def load_run(path, cfg, warn: bool = True, placed=None) -> LoraRun:
    """The base and adapters of the LoRA run at `path` (a run directory: its newest intact step;
    or a checkpoints/<step>), verified against their checksums and against the run's record
    (BaseChanged if the base or the adapters' settings are not the run's). `cfg`: its config.
    A warning (a checkpoint older than the records, whose base is used unverified) is printed by
    process 0 unless `warn` is False (the caller says it itself). `placed`: (base, adapters) as
    ShapeDtypeStructs with shardings, to read them into (an evaluation on the run's mesh); by
    default both come to the host (a seed-made base is made on the host either way)."""
    placed_base, placed_adapters = placed if placed is not None else (None, None)
    read = read_params(path, placed_adapters or initialised(cfg, lora.ADAPTERS, abstract_only=True))
    record = lora_base.recorded(checkpoint_meta(read.directory))
    lora_base.check_hyperparameters(record, cfg.lora, read.directory)
    pointer = lora_base.base_pointer(cfg)
    if pointer:
        if not Path(pointer).is_dir():
            raise BaseChanged(f"the LoRA run's base, checkpoint.load_params_from={pointer!r} in its config.json, is "
                              f"not a directory; put the base the run trained on back there to read {read.directory}")
        base, sums = restore_params_checked(pointer, placed_base or host_abstract_params(cfg))
        identity = loaded_identity(pointer, sums)
    else:
        base = initialised(cfg, "params")
        cpu = jax.local_devices(backend="cpu")[0]
        with jax.default_device(cpu):
            held = lora.to_compute_dtype(jax.tree_util.tree_map(lambda x: jax.device_put(x, cpu), base),
                                         _compute_dtype(cfg))
            identity = seed_identity(cfg.train.seed, held, "reader")
        if placed_base is not None:
            base = jax.tree_util.tree_map(lambda x, a: jax.device_put(x, a.sharding), base, placed_base)
    warning = lora_base.check_base(record, identity, cfg.lora, read.directory, resuming=False)
    if warning and warn:
        say_warning(warning)
    adapters = read.params if placed is not None else jax.tree_util.tree_map(np.asarray, read.params)
    return LoraRun(base, adapters, read.directory, identity, warning)


def merged_params(run: LoraRun, cfg):
    """The merged model of a LoRA run on the host, in fp32: W + (alpha / r) A B in each adapted
    kernel, on the base as it is stored (not rounded to the compute dtype the run trained in)."""
    base = jax.tree_util.tree_map(lambda x: np.asarray(x, np.float32), run.base)
    return lora.merge(base, run.adapters, cfg.lora, xp=np)


def verify_run(path, cfg) -> str:
    """`checkpoint verify` of a LoRA run: its adapters against their checksums, its base against
    its own and against the identity the run recorded; a sentence saying what was verified."""
    run = load_run(path, cfg, warn=False)  # its sentence carries the warning
    n = len(jax.tree_util.tree_leaves(run.adapters))
    said = (f"the LoRA adapters in {run.checkpoint} are intact ({n} arrays match their checksums, none holds "
            f"inf/NaN) and {run.identity.describe()} is ")
    if run.warning:
        return said + f"intact, but: {run.warning}"
    return said + "the one they were trained on"
