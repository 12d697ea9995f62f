"""A LoRA run is bound to its base: what it records about it, and the checks a resume and every
reader make against that record (the one loader of a run's base and adapters, which reads
checkpoints, is checkpoint/lora_run.py).

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

import jax

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


def made_on(tree, program: str) -> str:
    """`program` ("train": the trainer's init; "reader": a reader's) and the platform and mesh
    `tree`'s arrays lie on: "train on cpu fsdp=8", "reader on cpu 1 device"."""
    leaf = jax.tree_util.tree_leaves(tree)[0]
    mesh = getattr(leaf.sharding, "mesh", None)
    platform = next(iter(leaf.devices())).platform
    if mesh is None or mesh.size == 1:
        return f"{program} on {platform} 1 device"
    return f"{program} on {platform} " + ",".join(f"{axis}={size}" for axis, size in mesh.shape.items() if size > 1)


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
        if (sorted(now) != sorted(was)) if key == "targets" else (now != was):  # adapters are keyed by name
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


def check_base(record: dict | None, identity: BaseIdentity, lora_cfg, where, resuming: bool) -> str | None:
    """Compares the base found now (`identity`) with the one `record` (a checkpoint's "lora"
    record) says the adapters in `where` were trained on. The same base: None. Another one:
    BaseChanged in one sentence naming what changed and how to proceed, or, when `resuming` under
    lora.allow_base_change=True, that sentence as a warning to print. A reader (verify, export,
    generate, to-hf) never lets another base through: the checkpoint's record is what the adapters
    were trained on, whatever a run's config.json says it allowed once; a resume with the new base
    trains on and records it. A record saved before records existed: a warning that the base is
    used unverified."""
    was = BaseIdentity.from_record((record or {}).get("base"))
    if was is None:
        return (f"the checkpoint in {where} records no identity of its LoRA base (saved before records existed); "
                f"{identity.describe()} is used unverified")
    change = _what_changed(was, identity)
    if change is None:
        return None
    if resuming and allows_base_change(lora_cfg):
        return f"LoRA base changed ({change}); going on with it as lora.{ALLOW_KEY}=True asks"
    remedy = (f"set lora.{ALLOW_KEY}=True to use the new base on purpose" if resuming else
              f"train the run on with the new base on purpose (--config.lora.{ALLOW_KEY}=true and a higher "
              "train.steps), whose next checkpoint records it")
    raise BaseChanged(f"the LoRA adapters in {where} do not go with this base: {change}, or {remedy}")


def is_lora_run(cfg) -> bool:
    return "lora" in cfg and lora.enabled(cfg.lora)
