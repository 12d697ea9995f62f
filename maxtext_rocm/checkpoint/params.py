"""Params exports: writing them (`write_params`; `checkpoint export`, also of a LoRA run's merged
model), `checkpoint verify`, and a run's config.json. Reading, verified, is checkpoint/reading.py
(re-exported here for the callers that import it from this module).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import jax
import ml_collections
import numpy as np
import orbax.checkpoint as ocp

from maxtext_rocm.checkpoint import checksums
from maxtext_rocm.checkpoint.destination import unwritable
from maxtext_rocm.checkpoint.errors import cause
from maxtext_rocm.checkpoint.reading import (  # noqa: F401  (re-exported)
    CHECKSUMS_FILE, META, STATE, ReadParams, checkpoint_meta, host_abstract_params, read_params, restore_params,
    restore_params_checked, restore_params_to_host)
from maxtext_rocm.errors import CheckpointError


def write_params(directory: Path, params, sums: dict[str, str] | None = None) -> None:
    """`directory/params` (orbax) and `directory/checksums.json`: the params half of an export."""
    if sums is None:  # host arrays (a conversion's) are summed on the host, not sent to an accelerator
        host = jax.local_devices(backend="cpu")[0]
        on_host = jax.tree_util.tree_map(lambda x: jax.device_put(x, host) if isinstance(x, np.ndarray) else x,
                                         params)
        sums, _ = checksums.summarise({"params": on_host})
    ocp.PyTreeCheckpointer().save(directory / "params", params)
    (directory / CHECKSUMS_FILE).write_text(json.dumps(
        {"checksum_algorithm": checksums.ALGORITHM, "checksums": sums}, indent=1, sort_keys=True) + "\n")


def _check_destination(out_dir: Path) -> None:
    """Refuses, in one sentence, an export directory that exists or cannot be made (missing
    parent directories are made, as they always were, when the export is written)."""
    if out_dir.exists() or out_dir.is_symlink():
        raise CheckpointError(f"{out_dir} already exists; choose a new directory for the export")
    fault = unwritable(out_dir, make_parents=True)
    if fault is not None:
        where = "in a directory" if fault.problem.startswith("is a file") else "in a directory you can write to"
        raise CheckpointError(f"cannot write the export to {out_dir}: {fault.path} {fault.problem}; choose an "
                              f"OUT_DIR {where}")


def _lora_export(source: Path, cfg, record: dict):
    """(merged params, the export's config.json record) of a LoRA run: its merged model, which is a
    plain model (lora.rank=0 in the record; what it was merged from under "merged_from_lora")."""
    from maxtext_rocm.checkpoint import lora_run

    run = lora_run.load_run(source, cfg)
    record = json.loads(json.dumps(record))  # a copy
    lora_settings = dict(record["config"]["lora"])
    record["config"]["lora"]["rank"] = 0
    record["merged_from_lora"] = {"checkpoint": str(run.checkpoint), **lora_settings,
                                  "base": run.identity.to_record()}
    return lora_run.merged_params(run, cfg), record


def export_params(run_dir, out_dir, step: int | None = None) -> Path:
    """Writes `out_dir/params`, `out_dir/checksums.json` and `out_dir/config.json` from a run's
    checkpoint (the newest intact one unless `step`), after verifying it. A LoRA run's export is
    its merged model (W + (alpha / r) A B on the base it trained on), a plain model's export."""
    from maxtext_rocm.finetune import lora_base

    run_dir, out_dir = Path(run_dir).absolute(), Path(out_dir).absolute()
    _check_destination(out_dir)
    config_path = run_dir / "config.json"
    if not config_path.is_file():
        raise CheckpointError(f"{config_path} does not exist; give the output_dir of a run")
    record = json.loads(config_path.read_text())
    cfg = ml_collections.ConfigDict(record["config"])
    source = run_dir / "checkpoints" / str(step) if step is not None else run_dir
    if step is not None and not (source / STATE).is_dir():
        raise CheckpointError(f"{source} is not a saved checkpoint of {run_dir}")
    if lora_base.is_lora_run(cfg):
        (params, record), sums = _lora_export(source, cfg, record), None
    else:
        params, sums = restore_params_checked(source, host_abstract_params(cfg))
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    try:
        shutil.rmtree(tmp, ignore_errors=True)
        out_dir.parent.mkdir(parents=True, exist_ok=True)
        write_params(tmp, params, sums)
        (tmp / "config.json").write_text(json.dumps(record, indent=2) + "\n")
        tmp.rename(out_dir)
    except Exception as error:  # noqa: BLE001 - a full disk, a read-only directory: orbax raises many types
        shutil.rmtree(tmp, ignore_errors=True)
        raise CheckpointError(f"cannot write the export to {out_dir} ({cause(error)}); "
                              "choose an OUT_DIR you can write to, with room for the model") from None
    return out_dir


def run_config(path):
    """The config a run was made with, from the config.json of a run directory, of the run above a
    checkpoints/ or checkpoints/<step> directory, or of a params export."""
    path = Path(path)
    for folder in (path, path.parent, path.parent.parent):
        if (folder / "config.json").is_file():
            try:
                return ml_collections.ConfigDict(json.loads((folder / "config.json").read_text())["config"])
            except (ValueError, KeyError) as error:
                raise CheckpointError(f"{folder / 'config.json'} is not a run's config.json ({error})") from None
    if not path.exists():
        raise CheckpointError(f"{path} does not exist; give a run directory (output_dir), one of its "
                              "checkpoints/<step>, or a params export")
    raise CheckpointError(f"no config.json in or above {path}; give a run directory (output_dir), one of "
                          "its checkpoints/<step>, or a params export")


def verify_params(path) -> str:
    """`checkpoint verify PATH`: reads the parameters of PATH (a run directory: its newest intact
    step) with its own config and checks them; a sentence saying what was verified, or
    CheckpointError saying what failed."""
    from maxtext_rocm.checkpoint import lora_run
    from maxtext_rocm.finetune import lora_base

    path = Path(path).absolute()
    cfg = run_config(path)
    if lora_base.is_lora_run(cfg):
        return lora_run.verify_run(path, cfg)
    params, sums = restore_params_checked(path, host_abstract_params(cfg))
    n = len(jax.tree_util.tree_leaves(params))
    return f"the parameters in {path} are intact ({n} arrays match their checksums, none holds inf/NaN)"
