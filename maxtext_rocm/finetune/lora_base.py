"""A LoRA run is bound to its base: what it records about it, the checks a resume and every reader
make against that record, and the one loader of a run's base and adapters.

A LoRA checkpoint holds the adapters alone; the base is found again where the run found it
(checkpoint.load_params_from, or train.seed's initialisation, made again). What it was is recorded
in every checkpoint's meta (`Checkpointer.built_from`), under "lora":

    {"rank": 4, "alpha": 8.0, "targets": ["q", "v"],
     "base": {"load_params_from": "base/", "seed": null, "checksum": "<sha256>", "made_on": "cpu"}}

The base's checksum is the sha256 of its per-array checksums (checkpoint/checksums.py): those an
export was verified against, for a loaded base; those of the initialised base in the compute
dtype, for a seed-made one. A resume (trainer/launch.py), `checkpoint verify`/`export`,
`generate`, `load_params` and `convert to-hf` compare the base they found with the record: a
changed base or seed, or changed adapters' settings, is one sentence, not a silent change, unless
lora.allow_base_change says the new base is meant.

A seed-made base's values come out of the compiled initialisation, which agrees with itself but
not to the last bit with another program or layout making the same numbers (the trainer's sharded
init and a reader's one-device init of the same seed differ by up to 6e-8 on the CPU). Its
checksum is therefore compared only where the same program makes the base on the same platform and
mesh as when it was recorded (a resume, where it catches an initialiser that changed between
versions); elsewhere, as in the readers, the seed alone is compared.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from maxtext_rocm.errors import UserError
from maxtext_rocm.finetune import lora

RECORD_KEY = "lora"  # in a checkpoint's meta
ALLOW_KEY = "allow_base_change"  # in cfg.lora
HYPERPARAMETERS = ("rank", "alpha", "targets")  # fixed for the life of a run: the adapters' shapes and scale


class BaseChanged(UserError):
    """The base (or the adapters' settings) a LoRA run is resumed or read with is not the one it
    was trained with."""


@dataclasses.dataclass(frozen=True)
class BaseIdentity:
    """Which base a LoRA run trains on: an export's (load_params_from) or train.seed's."""
    load_params_from: str  # "" for a seed-made base
    seed: int | None  # None for a loaded base
    checksum: str
    made_on: str  # the program, platform and mesh that made a seed-made base: "train on cpu fsdp=8"

    def describe(self) -> str:
        if self.load_params_from:
            return f"the base from checkpoint.load_params_from={self.load_params_from!r}"
        return f"the base made from train.seed={self.seed}"

    def to_record(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_record(cls, record: dict | None) -> BaseIdentity | None:
        if not record:
            return None
        return cls(record.get("load_params_from") or "", record.get("seed"), record["checksum"],
                   record.get("made_on", ""))


def base_pointer(cfg) -> str:
    """Where a run's base is loaded from (checkpoint.load_params_from), "" for a seed-made one."""
    return cfg.checkpoint.get("load_params_from", "") or ""


def allows_base_change(lora_cfg) -> bool:
    return bool(lora_cfg.get(ALLOW_KEY, False))


def _digest(sums: dict[str, str]) -> str:
    from maxtext_rocm.checkpoint.checksums import json_digest

    return json_digest(sums)


def loaded_identity(pointer: str, sums: dict[str, str]) -> BaseIdentity:
    """The identity of a base read from `pointer`, verified against its stored checksums `sums`."""
    return BaseIdentity(str(pointer), None, _digest(sums), jax.default_backend())


def _made_on(tree) -> str:
    """The platform and mesh `tree`'s arrays lie on: "cpu fsdp=8", "gpu 1 device"."""
    leaf = jax.tree_util.tree_leaves(tree)[0]
    mesh = getattr(leaf.sharding, "mesh", None)
    platform = next(iter(leaf.devices())).platform
    if mesh is None or mesh.size == 1:
        return f"{platform} 1 device"
    return platform + " " + ",".join(f"{axis}={size}" for axis, size in mesh.shape.items() if size > 1)


def seed_identity(seed: int, base, program: str) -> BaseIdentity:
    """The identity of a base made from `seed`: `base` in the compute dtype, as the run holds it,
    made by `program` ("train": the trainer's init; "reader": a reader's, on the host)."""
    from maxtext_rocm.checkpoint.checksums import summarise

    sums, _ = summarise({"params": base})
    return BaseIdentity("", int(seed), _digest(sums), f"{program} on {_made_on(base)}")


def run_record(lora_cfg, identity: BaseIdentity) -> dict:
    """What `Checkpointer.built_from` saves in every checkpoint's meta of a LoRA run."""
    return {RECORD_KEY: {"rank": int(lora_cfg.rank), "alpha": float(lora_cfg.alpha),
                         "targets": list(lora_cfg.targets), "base": identity.to_record()}}


def recorded(meta: dict | None) -> dict | None:
    """The "lora" record of a checkpoint's meta; None for one saved before records existed."""
    return (meta or {}).get(RECORD_KEY)


def check_hyperparameters(record: dict | None, lora_cfg, where) -> None:
    """Refuses (BaseChanged) a lora.rank, alpha or targets other than the run's in `record`: its
    adapters were trained for those (rank and targets are their shapes, alpha/rank their scale)."""
    if not record:
        return
    for key in HYPERPARAMETERS:
        was = record[key]
        now = list(lora_cfg[key]) if key == "targets" else type(was)(lora_cfg[key])
        if now != was:
            shown = tuple(was) if key == "targets" else was
            raise BaseChanged(
                f"lora.{key}={tuple(now) if key == 'targets' else now!r} differs from the lora.{key}={shown!r} that "
                f"the adapters in {where} were trained with; keep lora.{key}={shown!r} to continue them, or start a "
                "new run in another output_dir")


def _what_changed(was: BaseIdentity, now: BaseIdentity) -> str | None:
    """The change from the recorded base to the found one, as a clause with its remedy; None if
    they are the same base."""
    if was.load_params_from and now.load_params_from:
        if was.checksum == now.checksum:
            return None  # the same parameters, wherever they lie now
        if Path(was.load_params_from).absolute() == Path(now.load_params_from).absolute():
            return (f"the base at checkpoint.load_params_from={now.load_params_from!r} holds other parameters than "
                    "when the run trained on it (its checksums differ); put the original base back there")
        return (f"the run trained on {was.describe()}, but {now.describe()} holds other parameters; "
                f"give checkpoint.load_params_from={was.load_params_from!r} (the original base)")
    if was.load_params_from or now.load_params_from:
        fix = (f"checkpoint.load_params_from={was.load_params_from!r}" if was.load_params_from
               else f"train.seed={was.seed} and no checkpoint.load_params_from")
        return f"the run trained on {was.describe()}, but this one is {now.describe()}; give {fix}"
    if was.seed != now.seed:
        return (f"the run's base was made from train.seed={was.seed}, but train.seed={now.seed} makes another; "
                f"give train.seed={was.seed}")
    if was.made_on == now.made_on and was.checksum != now.checksum:
        return (f"{now.describe()} holds other parameters than when the run trained on it (its checksums differ: "
                "the initialisation changed, with the jax version or the model or precision settings); make the "
                "base with what the run was trained with")
    return None


def check_base(record: dict | None, identity: BaseIdentity, lora_cfg, where) -> str | None:
    """Compares the base found now (`identity`) with the one `record` (a checkpoint's "lora"
    record) says the adapters in `where` were trained on. The same base: None. Another one:
    BaseChanged in one sentence naming what changed and how to proceed, or, under
    lora.allow_base_change=True, that sentence as a warning to print. A record saved before
    records existed: a warning that the base is used unverified."""
    was = BaseIdentity.from_record((record or {}).get("base"))
    if was is None:
        return (f"the checkpoint in {where} records no identity of its LoRA base (saved before records existed); "
                f"{identity.describe()} is used unverified")
    change = _what_changed(was, identity)
    if change is None:
        return None
    if allows_base_change(lora_cfg):
        return f"LoRA base changed ({change}); going on with it as lora.{ALLOW_KEY}=True asks"
    raise BaseChanged(f"the LoRA adapters in {where} do not go with this base: {change}, or set "
                      f"lora.{ALLOW_KEY}=True to use the new base on purpose")


# ----------------------------------------------------------------------------------------------
# Readers: a run's base and adapters on the host


def _host_tree(abstract):
    host = jax.sharding.SingleDeviceSharding(jax.local_devices(backend="cpu")[0])
    return jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=host), abstract)


def _lora_model(cfg):
    from maxtext_rocm.models import build_model
    from maxtext_rocm.numerics.precision import policy_from_config

    cpu = jax.local_devices(backend="cpu")[0]
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


def compute_dtype(cfg):
    from maxtext_rocm.numerics.precision import policy_from_config

    return policy_from_config(cfg.precision, jax.local_devices(backend="cpu")[0]).compute_dtype


class LoraRun(NamedTuple):
    """A LoRA run's parts on the host, each verified: `base` as it is stored (fp32: an export's
    values, or the seed's initialisation before the cast to the compute dtype), `adapters`, the
    checkpoint step they came from, and the base's identity (checked against the run's record)."""
    base: Any
    adapters: Any
    checkpoint: Path
    identity: BaseIdentity
    warning: str | None  # check_base's, where it let the base through


def load_run(path, cfg) -> LoraRun:
    """The base and adapters of the LoRA run at `path` (a run directory: its newest intact step;
    a checkpoints/<step>), verified against their checksums and the run's record
    (BaseChanged if the base or the adapters' settings are not the run's). `cfg`: its config."""
    from maxtext_rocm.checkpoint.params import (checkpoint_meta, host_abstract_params, read_params,
                                                restore_params_checked)

    read = read_params(path, initialised(cfg, lora.ADAPTERS, abstract_only=True))
    record = recorded(checkpoint_meta(read.directory))
    check_hyperparameters(record, cfg.lora, read.directory)
    pointer = base_pointer(cfg)
    if pointer:
        if not Path(pointer).is_dir():
            raise BaseChanged(f"the LoRA run's base, checkpoint.load_params_from={pointer!r} in its config.json, is "
                              f"not a directory; put the base the run trained on back there to read {read.directory}")
        base, sums = restore_params_checked(pointer, host_abstract_params(cfg))
        identity = loaded_identity(pointer, sums)
    else:
        base = initialised(cfg, "params")
        cpu = jax.local_devices(backend="cpu")[0]
        with jax.default_device(cpu):
            identity = seed_identity(cfg.train.seed, lora.to_compute_dtype(
                jax.tree_util.tree_map(lambda x: jax.device_put(x, cpu), base), compute_dtype(cfg)), "reader")
    warning = check_base(record, identity, cfg.lora, read.directory)
    return LoraRun(base, jax.tree_util.tree_map(np.asarray, read.params), read.directory, identity, warning)


def merged_params(run: LoraRun, cfg):
    """The merged model of a LoRA run on the host, in fp32: W + (alpha / r) A B in each adapted
    kernel, on the base as it is stored (not rounded to the compute dtype the run trained in)."""
    base = jax.tree_util.tree_map(lambda x: np.asarray(x, np.float32), run.base)
    return lora.merge(base, run.adapters, cfg.lora, xp=np)


def is_lora_run(cfg) -> bool:
    return "lora" in cfg and lora.enabled(cfg.lora)


def verify_run(path, cfg) -> str:
    """`checkpoint verify` of a LoRA run: its adapters against their checksums, its base against
    its own and against the identity the run recorded; a sentence saying what was verified."""
    run = load_run(path, cfg)
    n = len(jax.tree_util.tree_leaves(run.adapters))
    said = (f"the LoRA adapters in {run.checkpoint} are intact ({n} arrays match their checksums, none holds "
            f"inf/NaN) and {run.identity.describe()} is ")
    if run.warning:
        return said + f"intact, but: {run.warning}"
    return said + "the one they were trained on"
