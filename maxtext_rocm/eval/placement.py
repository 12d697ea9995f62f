"""Where a saved run is evaluated: on the mesh it trained on, or on one given as `mesh.*` overrides,
its parameters read from the checkpoint straight into their shardings there (each device reads its
own shards; no whole copy on the host), in the run's precision policy, a LoRA run's frozen base and
adapters kept apart and the adapters applied inside the dots, as its train step applies them.

    python -m maxtext_rocm.eval RUN --tasks T                                  # the run's own mesh
    python -m maxtext_rocm.eval RUN --tasks T --config.mesh.ici.fsdp=4 --config.mesh.ici.tensor=2
    lm_eval ... --model_args run=RUN,mesh.ici.fsdp=4,mesh.ici.tensor=2         # the same, as model args

The run's own mesh is the one its config.json records (`environment.mesh`, written by the Trainer
and kept by `checkpoint export`), used where this process sees as many devices and processes as
the run had. Elsewhere, and for an import that records none (`convert from-hf`), the parameters
are placed as `load_params` places them (all-FSDP where the run's mesh does not fit; a LoRA run
merged) and batches are not split over a data axis, as before meshes were chosen here: a line says
so where more than one device could have shared the work. A given mesh is checked as training
checks it (one sentence, exit status 2, where it does not fill the devices or divide the model).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Mapping

import jax
import jax.numpy as jnp
import ml_collections
from flax import linen as nn

from maxtext_rocm import config as config_lib
from maxtext_rocm.errors import ConfigError

MESH_GROUP = "mesh."  # the only config keys an evaluation takes: the model and its window are the run's


@dataclasses.dataclass(frozen=True)
class Placed:
    """A saved run ready to evaluate: `cfg` (resolved for `mesh`), the model's `variables`
    ({"params": ...}; a LoRA run's also "adapters"), the `policy` that applies them (None: the
    config's own), the `mesh` they lie on (None: as load_params placed them, rows not split) and
    `note`, the line to say about that choice ("" for nothing)."""
    cfg: Any
    variables: Any
    policy: Any
    mesh: Any
    note: str = ""


def mesh_overrides(args: Mapping[str, Any]) -> dict[str, str]:
    """The `mesh.*` entries of model arguments (or of `--config.mesh.*` flags, as key -> text)."""
    return {key: str(value) for key, value in args.items() if key.startswith(MESH_GROUP)}


def overrides_from_flags(flags: list[str]) -> dict[str, str]:
    """`--config.mesh.ici.fsdp=4` (or `--config.mesh.ici.fsdp 4`) flags as {"mesh.ici.fsdp": "4"};
    any other flag is one sentence."""
    out, i = {}, 0
    while i < len(flags):
        flag = flags[i]
        if not flag.startswith("--config."):
            raise ConfigError(f"unexpected argument {flag!r}; a mesh to evaluate on is given as "
                              "--config.mesh.ici.fsdp=4")
        key, has_value, text = flag[len("--config."):].partition("=")
        if not has_value:
            if i + 1 == len(flags):
                raise ConfigError(f"override {flag!r} has no value; write it as {flag}=VALUE")
            text, i = flags[i + 1], i + 1
        out[key] = text
        i += 1
    return out


def mesh_config(cfg, overrides: Mapping[str, str]) -> ml_collections.ConfigDict:
    """`cfg` with the `mesh.*` overrides applied, checked as training checks it for this process's
    devices: the axes fill them, the model's dimensions divide over them (ConfigError otherwise)."""
    from maxtext_rocm.parallel import sharding

    for key in overrides:
        if not key.startswith(MESH_GROUP):
            raise ConfigError(f"--config.{key}: an evaluation takes only mesh.* keys (the model and its window are the "
                              "run's; --model_args precision=... and max_length=... change how it is evaluated)")
    out = ml_collections.ConfigDict(cfg.to_dict())
    config_lib.apply_cli_overrides(out, [f"--config.{key}={text}" for key, text in overrides.items()])
    config_lib.validate(out, jax.device_count(), jax.process_count())
    sizes = config_lib.axis_sizes(config_lib.mesh_shape(out.mesh, jax.device_count(), jax.process_count()))
    problem = sharding.check_param_divisibility(out.model, sizes)
    if problem:
        raise ConfigError(problem)
    return out


def _trained_mesh(run) -> dict | None:
    """The mesh's axis sizes and the device and process counts the run trained with, from its
    config.json; None for an import, which records none."""
    from maxtext_rocm.convert.origin import find_record

    environment = find_record(Path(run).absolute())[0].get("environment") or {}
    return environment if environment.get("mesh") else None


def _shown(sizes: Mapping[str, int]) -> str:
    return " x ".join(f"{axis}={size}" for axis, size in sizes.items() if size > 1) or "one device"


def _counted(devices: int, processes: int) -> str:
    return (f"{devices} device{'s' * (devices != 1)} ({processes} process{'es' * (processes != 1)})")


def own_mesh_config(run, cfg) -> tuple[ml_collections.ConfigDict | None, str]:
    """(the run's config on its own mesh, "") where this process sees the devices it trained on;
    else (None, the line that says why the parameters are placed as load_params places them)."""
    devices = jax.device_count()
    trained = _trained_mesh(run)
    if trained is None:
        said = (f"{run} records no mesh of its own (an import); its parameters are placed as load_params places "
                "them and batches are not split over a data axis; --config.mesh.ici.fsdp=N (mesh.ici.fsdp=N in "
                "--model_args) shards it like training")
        return None, "" if devices == 1 else said
    count, processes = int(trained.get("device_count", 0)), int(trained.get("process_count", 1))
    why = f"this evaluation has {_counted(devices, jax.process_count())}"
    if (count, processes) == (devices, jax.process_count()):
        try:
            return mesh_config(cfg, {}), ""
        except ConfigError as error:  # a config.json edited, or checks that grew since it was written
            why = f"it cannot be built again here ({str(error).rstrip('.')})"
    return None, (f"{run} trained on {_shown(trained['mesh'])} over {_counted(count, processes)} and {why}; its "
                  "parameters are placed as load_params places them and batches are not split over a data axis; "
                  "give --config.mesh.* (mesh.* in --model_args) for a mesh of these devices")


def place(run, cfg, overrides: Mapping[str, str], precision: str | None) -> Placed:
    """The run at `run` (config `cfg`, as recorded) ready to evaluate: on the mesh `overrides`
    give, else on its own (see the module's docstring). `precision`: a precision.policy to
    evaluate in instead of the run's."""
    from maxtext_rocm.api import load_params
    from maxtext_rocm.parallel import sharding
    from maxtext_rocm.resolve import Target, resolve

    on_mesh, note = (mesh_config(cfg, overrides), "") if overrides else own_mesh_config(run, cfg)
    if on_mesh is None:  # as before: load_params' placement, a LoRA run merged
        params = load_params(run, cfg)
        if precision is not None:  # after loading: the parameters are stored in fp32 whatever the policy
            cfg = ml_collections.ConfigDict(cfg.to_dict())
            cfg.precision.policy = str(precision)
        return Placed(cfg, params, None, None, note)
    if precision is not None:
        on_mesh.precision.policy = str(precision)
    mesh = sharding.make_mesh(on_mesh.mesh)
    resolved = resolve(on_mesh, mesh, Target.of_device(jax.devices()[0]))
    variables, policy = read_on_mesh(run, resolved, mesh)
    return Placed(resolved, variables, policy, mesh)


def read_on_mesh(run, cfg, mesh):
    """(variables, policy): the parameters of `run` (resolved config `cfg`) read into their
    shardings on `mesh`, verified as every reader verifies them; a LoRA run's base in the compute
    dtype beside its adapters, as the Trainer holds them, and the policy that applies both."""
    from maxtext_rocm.checkpoint import lora_run, restore_params
    from maxtext_rocm.finetune import lora, lora_base
    from maxtext_rocm.models import build_model
    from maxtext_rocm.parallel import sharding
    from maxtext_rocm.trainer.launch import run_policy

    policy = run_policy(cfg, jax.devices()[0])
    model = build_model(cfg.model, policy)
    boxed = jax.eval_shape(lambda k: model.init(k, jnp.zeros((1, 8), jnp.int32)), jax.random.key(0))
    shardings = sharding.logical_to_sharding(nn.get_partition_spec(boxed), mesh)
    abstract = jax.tree_util.tree_map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                                      nn.meta.unbox(boxed), shardings)
    if lora_base.is_lora_run(cfg):
        parts = lora_run.load_run(run, cfg, placed=(abstract["params"], abstract[lora.ADAPTERS]))
        return lora.model_variables(parts.adapters, lora.to_compute_dtype(parts.base, policy.compute_dtype)), policy
    return {"params": restore_params(run, abstract["params"])}, policy
