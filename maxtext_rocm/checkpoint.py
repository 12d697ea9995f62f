"""Checkpoints through orbax: periodic asynchronous saves, automatic resume, keep-N, params exports.

A checkpoint is `output_dir/checkpoints/<step>/` with three items:
- `state`: the TrainState (step, params, optimizer state, non-finite counter), sharded arrays;
- `data`:  the data iterator's position, so the batch after a resume is the one that would have come;
- `meta`:  the step and the model config it was written with, for people and for checks.

Orbax writes each step into a temporary directory and renames it when complete, so a process
killed mid-save leaves no directory that `latest_step` would pick.

    python -m maxtext_rocm.checkpoint export RUN_DIR OUT_DIR [--step N]

writes a params-only export (`OUT_DIR/params` + `OUT_DIR/config.json`) that
`checkpoint.load_params_from` (or a notebook) starts from.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import jax
import orbax.checkpoint as ocp
from orbax.checkpoint.checkpoint_managers import preservation_policy as policies

from maxtext_rocm.config import CheckpointError, UserError

STATE, DATA, META = "state", "data", "meta"


def _handlers():
    # Named up front so that a manager that has not saved yet can read metadata and restore.
    return {STATE: ocp.StandardCheckpointHandler(), DATA: ocp.JsonCheckpointHandler(),
            META: ocp.JsonCheckpointHandler()}


def _flat_shapes(tree) -> dict[str, tuple]:
    """{"params.layers.mlp.up.kernel": shape}: the same names for live pytrees (attributes,
    tuples) and orbax's metadata (dicts, lists), so the two can be compared."""
    def name(key):
        for attr in ("key", "name", "idx"):
            if hasattr(key, attr):
                return str(getattr(key, attr))
        return str(key)
    return {".".join(name(k) for k in path): tuple(leaf.shape)
            for path, leaf in jax.tree_util.tree_leaves_with_path(tree)}


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


def _quiet_closed_loop_callbacks() -> None:
    """When one read of a restore fails, orbax closes its event loop while tensorstore still has
    reads in flight; each of their callbacks then reports "Event loop is closed" through
    sys.unraisablehook, a traceback apiece. They say nothing the one-sentence error does not,
    so drop exactly those (installed once, before the first restore)."""
    previous = sys.unraisablehook
    if getattr(previous, "_drops_closed_loop", False):
        return

    def hook(unraisable):
        value = unraisable.exc_value
        if not (isinstance(value, RuntimeError) and str(value) == "Event loop is closed"):
            previous(unraisable)
    hook._drops_closed_loop = True
    sys.unraisablehook = hook


def _unreadable(path, error: Exception) -> CheckpointError:
    first_line = (str(error).strip().splitlines() or [type(error).__name__])[0][:300]
    return CheckpointError(f"checkpoint {path} cannot be read ({type(error).__name__}: {first_line}); "
                           "delete that step directory or choose another with checkpoint.resume")


class Checkpointer:
    """Saves and restores one run's checkpoints. Every process calls every method (orbax
    coordinates multi-host writes itself)."""

    def __init__(self, ckpt_cfg, output_dir: str):
        self.cfg = ckpt_cfg
        self.directory = Path(output_dir).absolute() / "checkpoints"
        keep = [policies.LatestN(ckpt_cfg.keep)]
        if ckpt_cfg.keep_period:
            keep.append(policies.EveryNSteps(ckpt_cfg.keep_period))
        options = ocp.CheckpointManagerOptions(
            enable_async_checkpointing=ckpt_cfg.async_save,
            preservation_policy=policies.AnyPreservationPolicy(keep),
            create=False)  # made on the first save: a failed start leaves the run directory alone
        self.manager = ocp.CheckpointManager(self.directory, options=options, item_handlers=_handlers())
        self._last_saved = None

    def should_save(self, step: int, last_step: int) -> bool:
        return step == last_step or (self.cfg.every > 0 and step % self.cfg.every == 0)

    def save(self, step: int, state, data_state: dict, model_cfg) -> None:
        """Starts writing `step`; returns once the arrays are copied off the devices."""
        if step == self._last_saved:
            return
        self._last_saved = step
        self.directory.mkdir(parents=True, exist_ok=True)
        self.manager.save(step, force=True, args=ocp.args.Composite(**{
            STATE: ocp.args.StandardSave(state),
            DATA: ocp.args.JsonSave(data_state),
            META: ocp.args.JsonSave({"step": step, "model": model_cfg.to_dict()}),
        }))

    def wait(self) -> None:
        """Blocks until every started save is committed to disk."""
        self.manager.wait_until_finished()

    def close(self) -> None:
        self.manager.close()

    def find_resume(self):
        """(manager, step) of what `checkpoint.resume` asks for, or None for a fresh start:
        "auto" = the newest complete checkpoint here, "never", a step here, or a checkpoint path."""
        choice = str(self.cfg.resume)
        if choice == "never":
            steps = self.manager.all_steps() if self.directory.exists() else []
            if steps:  # a fresh run would collide with (and then delete) them
                raise CheckpointError(
                    f"checkpoint.resume=never but {self.directory} already holds checkpoints "
                    f"(steps {', '.join(map(str, sorted(steps)))}); use a new output_dir or remove them")
            return None
        if choice == "auto" or choice.isdigit():
            steps = self.manager.all_steps() if self.directory.exists() else []
            if choice == "auto":
                return (self.manager, max(steps)) if steps else None
            if int(choice) not in steps:
                raise CheckpointError(
                    f"checkpoint.resume={choice} is not a saved step in {self.directory}; use 'auto', 'never' "
                    f"or one of: {', '.join(map(str, sorted(steps))) or 'none (no checkpoints yet)'}")
            return self.manager, int(choice)
        path = Path(choice).absolute()  # another run's checkpoints/<step>, checkpoints/ or run directory
        if path.name.isdigit() and (path / STATE).is_dir():
            return _reader(path.parent), int(path.name)
        folder = path / "checkpoints" if (path / "checkpoints").is_dir() else path
        steps = _reader(folder).all_steps()
        if not steps:
            raise CheckpointError(f"checkpoint.resume={choice} holds no complete checkpoint")
        return _reader(folder), max(steps)

    def restore(self, manager, step: int, abstract_state):
        """(state, data_state) of `step`, each array placed straight into `abstract_state`'s sharding."""
        path = Path(manager.directory) / str(step)
        _quiet_closed_loop_callbacks()
        try:
            on_disk = manager.item_metadata(step)[STATE].tree
        except Exception as error:  # noqa: BLE001 - orbax and tensorstore raise many types
            raise _unreadable(path, error) from None
        mismatch = _shape_mismatch(abstract_state, on_disk)
        if mismatch:
            raise CheckpointError(f"checkpoint {path} does not fit this model: {mismatch}; "
                                  "use a new output_dir or set checkpoint.resume=never")
        try:
            restored = manager.restore(step, args=ocp.args.Composite(**{
                STATE: ocp.args.StandardRestore(abstract_state), DATA: ocp.args.JsonRestore()}))
        except Exception as error:  # noqa: BLE001
            raise _unreadable(path, error) from None
        return restored[STATE], restored[DATA]


def _reader(directory) -> ocp.CheckpointManager:
    options = ocp.CheckpointManagerOptions(read_only=True, create=False)
    return ocp.CheckpointManager(directory, options=options, item_handlers=_handlers())


def _params_location(path: Path) -> tuple[Path, bool]:
    """(pytree directory, whether it holds a whole TrainState) for an export, a checkpoint step,
    a checkpoints directory or a run directory (the newest step of the last two)."""
    if (path / "params").is_dir():
        return path / "params", False
    if (path / STATE).is_dir():
        return path / STATE, True
    folder = path / "checkpoints" if (path / "checkpoints").is_dir() else path
    steps = sorted(int(p.name) for p in folder.glob("*") if p.name.isdigit() and (p / STATE).is_dir())
    if not steps:
        raise CheckpointError(f"{path} holds no params export or checkpoint; give a directory written by "
                              "a run (output_dir), one of its checkpoints/<step>, or an export")
    return folder / str(steps[-1]) / STATE, True


def restore_params(path, abstract_params):
    """Only the parameters, from any of the places `_params_location` understands."""
    tree_dir, whole_state = _params_location(Path(path))
    item = {"params": abstract_params} if whole_state else abstract_params
    _quiet_closed_loop_callbacks()
    try:
        on_disk = ocp.PyTreeCheckpointer().metadata(tree_dir).item_metadata.tree
        on_disk = on_disk["params"] if whole_state else on_disk
    except Exception as error:  # noqa: BLE001
        raise _unreadable(tree_dir, error) from None
    mismatch = _shape_mismatch(abstract_params, on_disk)
    if mismatch:
        raise CheckpointError(f"parameters in {tree_dir} do not fit this model: {mismatch}")
    try:
        restored = ocp.PyTreeCheckpointer().restore(tree_dir, args=ocp.args.PyTreeRestore(
            item=item, restore_args=ocp.checkpoint_utils.construct_restore_args(item), partial_restore=True))
    except Exception as error:  # noqa: BLE001
        raise _unreadable(tree_dir, error) from None
    return restored["params"] if whole_state else restored


def restore_params_to_host(path, cfg):
    """`cfg`'s parameters from `path` into host memory: for exports and conversions, which go to
    disk next and whose model need not fit one accelerator."""
    from flax import linen as nn

    from maxtext_rocm.models import abstract_params

    host = jax.sharding.SingleDeviceSharding(jax.local_devices(backend="cpu")[0])
    abstract = jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=host),
                                      nn.meta.unbox(abstract_params(cfg)))
    return restore_params(path, abstract)


def export_params(run_dir, out_dir, step: int | None = None) -> Path:
    """Writes `out_dir/params` and `out_dir/config.json` from a run's checkpoint."""
    import ml_collections

    run_dir, out_dir = Path(run_dir), Path(out_dir)
    if out_dir.exists():
        raise CheckpointError(f"{out_dir} already exists; choose a new directory for the export")
    config_path = run_dir / "config.json"
    if not config_path.is_file():
        raise CheckpointError(f"{config_path} does not exist; give the output_dir of a run")
    record = json.loads(config_path.read_text())
    cfg = ml_collections.ConfigDict(record["config"])
    source = run_dir / "checkpoints" / str(step) if step is not None else run_dir
    params = restore_params_to_host(source, cfg)
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    ocp.PyTreeCheckpointer().save(tmp / "params", params)
    (tmp / "config.json").write_text(json.dumps(record, indent=2) + "\n")
    tmp.rename(out_dir)
    return out_dir


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    usage = "usage: python -m maxtext_rocm.checkpoint export RUN_DIR OUT_DIR [--step N]"
    if len(argv) not in (3, 5) or argv[0] != "export" or (len(argv) == 5 and argv[3] != "--step"):
        print(usage, file=sys.stderr)
        return 2
    try:
        step = int(argv[4]) if len(argv) == 5 else None
        print(f"wrote {export_params(argv[1], argv[2], step)}")
    except (UserError, ValueError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
