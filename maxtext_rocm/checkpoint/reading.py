"""Reading parameters out of a run's checkpoints or a params export, verified.

Every reader that is not a resume (`checkpoint export`, `convert to-hf`, `load_params`,
`generate`, `checkpoint.load_params_from`) comes through `read_params` (or `restore_params`), which
checks what it read against the checksums saved with it (maxtext_rocm/checkpoint/checksums.py):

- a checkpoint step: the `params.*` checksums in the step's `meta`;
- a params export (`OUT/params` + `OUT/config.json`): `OUT/checksums.json`, written with it.

Given a run directory (or its checkpoints/), it reads the newest step that is intact and warns
about each newer one that is not; a step or export the user named is read or refused in one
sentence. Paths are used as given, made absolute first (orbax's metadata read returns None for
a relative one).
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path
from typing import Any, NamedTuple

import jax
import numpy as np
import orbax.checkpoint as ocp

from maxtext_rocm.checkpoint import checksums
from maxtext_rocm.checkpoint.errors import cause, quiet_closed_loop_callbacks, quiet_orbax_error_logs
from maxtext_rocm.errors import CheckpointError

STATE, META = "state", "meta"  # the Checkpointer's item names (checkpoint.py)
CHECKSUMS_FILE = "checksums.json"  # beside an export's params/


class _Damaged(Exception):
    """What is wrong with one checkpoint or export as it is on disk, as a phrase."""


@dataclasses.dataclass
class _Source:
    """One place parameters can be read from: an orbax pytree directory, whether it holds a whole
    TrainState (a checkpoint step) or only the params (an export), and what to call it."""
    tree_dir: Path
    whole_state: bool
    label: str

    def stored_checksums(self) -> tuple[dict | None, str | None]:
        """(the params' saved checksums by leaf name "params.…", their algorithm); (None, None)
        for one written before checksums existed. Raises _Damaged if the record is unreadable."""
        record_path = (self.tree_dir.parent / META / "metadata" if self.whole_state
                       else self.tree_dir.parent / CHECKSUMS_FILE)
        if not record_path.exists():
            if self.whole_state:
                raise _Damaged(f"has no {META} record ({record_path} is missing)")
            return None, None
        try:
            record = json.loads(record_path.read_text())
        except (OSError, ValueError) as error:
            raise _Damaged(f"has an unreadable checksum record {record_path} ({error})") from None
        if "checksums" not in record:
            return None, None
        stored = {k: v for k, v in record["checksums"].items() if k.startswith("params.")}
        return stored, record.get("checksum_algorithm")


def _flat_shapes(tree) -> dict[str, tuple]:
    """{"params.layers.mlp.up.kernel": shape}: comparable between live pytrees and orbax's metadata."""
    return dict(zip(checksums.leaf_names(tree), (tuple(leaf.shape) for leaf in jax.tree_util.tree_leaves(tree))))


def _shape_mismatch(abstract, on_disk) -> str | None:
    """The first parameter whose presence or shape differs, as a phrase; None if all fit."""
    want, have = _flat_shapes(abstract), _flat_shapes(on_disk)
    for key in want:
        if key not in have:
            return f"{key} is missing from it"
        if want[key] != have[key]:
            return f"{key} has shape {have[key]} there but {want[key]} in this model"
    extra = sorted(set(have) - set(want))
    return f"it holds {extra[0]}, which this model does not have" if extra else None


def _on_every_process(ok: bool) -> bool:
    if jax.process_count() == 1:
        return ok
    from jax.experimental import multihost_utils

    return bool(multihost_utils.process_allgather(np.int32(ok)).min())


def _sources(path: Path) -> tuple[list[_Source], bool]:
    """(where to read from, newest first; whether the user named exactly one) for an export, a
    checkpoint step, a checkpoints directory or a run directory."""
    if not path.is_dir():
        raise CheckpointError(f"{path} is not a directory; give a run directory (output_dir), one of its "
                              "checkpoints/<step>, or a params export")
    if (path / "params").is_dir():
        return [_Source(path / "params", False, f"params export {path}")], True
    if (path / STATE).is_dir():
        return [_Source(path / STATE, True, f"checkpoint {path}")], True
    folder = path / "checkpoints" if (path / "checkpoints").is_dir() else path
    steps = sorted((int(p.name) for p in folder.glob("*") if p.name.isdigit() and (p / STATE).is_dir()),
                   reverse=True)
    if not steps:
        raise CheckpointError(f"{path} holds no params export or checkpoint; give a directory written by "
                              "a run (output_dir), one of its checkpoints/<step>, or an export")
    return [_Source(folder / str(s) / STATE, True, f"checkpoint {folder / str(s)}") for s in steps], False


def say_warning(message: str) -> None:
    if jax.process_index() == 0:  # process 0 speaks for every process
        print(f"warning: {message}", file=sys.stderr, flush=True)


def _read_verified(source: _Source, abstract_params):
    """(params, their checksums) of one source, checked. _Damaged if it is not intact;
    CheckpointError if it is intact but holds another model."""
    stored, algorithm = source.stored_checksums()
    if stored is not None and algorithm != checksums.ALGORITHM:
        raise _Damaged(f"has checksums of an unknown kind ({algorithm!r})")
    try:
        metadata = ocp.PyTreeCheckpointer().metadata(source.tree_dir)
        on_disk = None if metadata is None or metadata.item_metadata is None else metadata.item_metadata.tree
    except Exception as error:  # noqa: BLE001 - orbax and tensorstore raise many types
        raise _Damaged(f"cannot be read ({cause(error)})") from None
    if on_disk is None:
        raise _Damaged(f"cannot be read (orbax finds no array metadata in {source.tree_dir})")
    on_disk = on_disk["params"] if source.whole_state else on_disk
    mismatch = _shape_mismatch(abstract_params, on_disk)
    if mismatch:  # not damage: another model's parameters, which no older step would fix
        raise CheckpointError(f"parameters in {source.tree_dir} do not fit this model: {mismatch}")
    item = {"params": abstract_params} if source.whole_state else abstract_params
    why = ""
    try:
        restored = ocp.PyTreeCheckpointer().restore(source.tree_dir, args=ocp.args.PyTreeRestore(
            item=item, restore_args=ocp.checkpoint_utils.construct_restore_args(item), partial_restore=True))
    except Exception as error:  # noqa: BLE001
        why = f"cannot be read ({cause(error)})"
    if not _on_every_process(not why):  # each process read its own shards: all go on, or none
        raise _Damaged(why or "cannot be read by another process of this run")
    params = restored["params"] if source.whole_state else restored
    computed, nonfinite = checksums.summarise({"params": params})  # global: every process agrees
    if stored is not None:
        difference = checksums.first_difference(stored, computed)
        if difference is not None:
            raise _Damaged(f"failed verification ({difference})")
    if nonfinite:
        raise _Damaged(f"holds inf/NaN values (first in {nonfinite[0]})")
    if stored is None:
        say_warning(f"{source.label} was written without checksums; its parameters are read unverified")
    return params, computed


class ReadParams(NamedTuple):
    """Parameters read and verified, their checksums, and the directory they came from: the
    checkpoint step (`.../checkpoints/<step>`, whose `meta` describes it) or the export."""
    params: Any
    checksums: dict[str, str]
    directory: Path


def read_params(path, abstract_params) -> ReadParams:
    """The parameters from any place `_sources` understands, verified: the newest intact step of
    a run (warning about each damaged newer one), or exactly the step or export named, else one
    CheckpointError sentence."""
    quiet_closed_loop_callbacks()
    quiet_orbax_error_logs()
    sources, explicit = _sources(Path(path).absolute())
    skipped = []
    for source in sources:
        try:
            params, computed = _read_verified(source, abstract_params)
        except _Damaged as damage:
            if explicit:
                hint = ("write the export again from its run (python -m maxtext_rocm.checkpoint export)"
                        if not source.whole_state else
                        "give another step, or the run directory to read its newest intact checkpoint")
                raise CheckpointError(f"{source.label} {damage}, so it was not used; {hint}") from None
            skipped.append((source, str(damage)))
            continue
        for bad, why in skipped:
            say_warning(f"{bad.label} {why}; reading {source.label} instead, the newest intact one (the other is "
                  f"left where it is; python -m maxtext_rocm.checkpoint verify {bad.tree_dir.parent} checks it)")
        return ReadParams(params, computed, source.tree_dir.parent)
    raise CheckpointError(f"no checkpoint under {Path(path).absolute()} is intact ("
                          + "; ".join(f"{s.tree_dir.parent.name}: {why}" for s, why in skipped) + ")")


def restore_params_checked(path, abstract_params):
    """(params, their checksums): `read_params` without the directory."""
    read = read_params(path, abstract_params)
    return read.params, read.checksums


def restore_params(path, abstract_params):
    """Only the parameters, verified, from any of the places `_sources` understands."""
    return read_params(path, abstract_params).params


def checkpoint_meta(step_dir) -> dict | None:
    """The `meta` record a checkpoint step was saved with (its step, model, checksums and, for a
    LoRA run, its adapters' settings and base: finetune/lora_base.py); None where there is none
    (an export, a checkpoint written before the record existed)."""
    record = Path(step_dir) / META / "metadata"
    try:
        return json.loads(record.read_text())
    except (OSError, ValueError):
        return None


def host_abstract_params(cfg):
    """The shapes of `cfg`'s model parameters (no LoRA adapters), placed in host memory."""
    from flax import linen as nn

    from maxtext_rocm.models import abstract_params
    from maxtext_rocm.resolve import resolve_here

    host = jax.sharding.SingleDeviceSharding(jax.local_devices(backend="cpu")[0])
    return jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=host),
                                  nn.meta.unbox(abstract_params(resolve_here(cfg))))


def restore_params_to_host(path, cfg):
    """`cfg`'s parameters from `path` into host memory, verified: for exports and conversions,
    which go to disk next and whose model need not fit one accelerator."""
    return restore_params(path, host_abstract_params(cfg))
