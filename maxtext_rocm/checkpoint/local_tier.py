"""The node-local checkpoint tier: frequent saves of what resumes the run on the same nodes.

`checkpoint.local_dir` (node-local: NVMe, /dev/shm or /tmp) holds, per process,
`<local_dir>/<run>/process-<i>-of-<n>/<step>/`, an orbax checkpoint of three items:
- `state`: the arrays of the train state as far as this process's devices hold them (each process
  writes its own shards, into its own folder);
- `data`:  this process's data position;
- `meta`:  the step, the process layout and mesh it was saved on, the data position's checksum and
  (a LoRA run) its base, as a persistent checkpoint's `meta` records it;
and beside them `checksums.json`, the checksums of the whole state (checksums.py: global sums, the
same on every process).
Nothing else: a local step restores only onto the same mesh and process layout (a replaced node,
another mesh or another process count finds nothing it can use, and the run falls back to the
persistent tier, which restores onto any mesh). It is a cache of the persistent tier, never a
replacement.

Why not orbax's emergency CheckpointManager (orbax-checkpoint 0.12.8, installed in both venvs)?
It keeps a local copy per *replica slice* and restores by broadcasting from a slice that holds
a complete copy: it requires at least two data-parallel replicas along a replica axis of the mesh,
drops `local_directory` silently for one slice (one node, or a mesh with no pure data axis, which
is what most runs here are), saves only the state item (not each process's data position nor the
checksums every reader of a checkpoint verifies), and is marked "experimental; do not use without
specific approval". So the tier is this module, on orbax's own pieces, configured as that manager
configures its per-slice saves: orbax's ArrayHandler with no primary host and no replica choice
(every process writes the shards its devices hold), and MultiprocessingOptions whose only active
process is this one, so that each process saves and restores on its own, with no barrier between
processes (the step alone decides when every process saves; tiers.py agrees on what to read).
Item directories are created synchronously: orbax's asynchronous creation signals completion
through a key every process shares, which lets one process's signal release another's writes
into directories not yet made.

Saves are asynchronous: `save` dispatches the checksums (global sums of the state, computed on
the devices) without waiting for them and lets orbax copy this process's shards off the devices
(the stall), then returns. In the background orbax writes into `<step>.orbax-checkpoint-tmp` and
renames it to `<step>` once complete; then the checksums are written into it as
`checksums.json`, the save's last act, which makes it a step. So a process killed mid-write leaves
nothing a resume would pick. A failed local write is one warning and the run goes on (the
persistent tier still protects it): the tier is a cache.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import jax
import orbax.checkpoint as ocp
from orbax.checkpoint import type_handlers

from maxtext_rocm.checkpoint import checksums
from maxtext_rocm.checkpoint.errors import cause

STATE, DATA, META = "state", "data", "meta"
FORMAT = 2  # 1: raw shard files with a CRC-32 manifest (before the tier wrote through orbax)
UNFINISHED = ".orbax-checkpoint-tmp"  # orbax's suffix for a step still being written
CHECKSUMS = "checksums.json"  # written into a step once orbax has committed it: the save's last act


class LocalDamaged(Exception):
    """A local step that cannot be used as it is (missing, damaged, another layout); the message says why."""


def run_folder(local_dir: str, output_dir: str) -> Path:
    """This run's folder in `local_dir`: several runs may share one node's /dev/shm."""
    absolute = str(Path(output_dir).absolute())
    return Path(local_dir) / f"{Path(absolute).name}-{hashlib.sha256(absolute.encode()).hexdigest()[:10]}"


def process_folder(local_dir: str, output_dir: str) -> Path:
    """This process's folder of the run's local tier."""
    return run_folder(local_dir, output_dir) / f"process-{jax.process_index()}-of-{jax.process_count()}"


def held_bytes(ckpt_cfg, output_dir: str) -> int:
    """Bytes this process's local steps of the run hold already (an earlier launch's), which a new
    launch's steps replace: the start-up fit check leaves them out of what it still needs."""
    if not ckpt_cfg.get("local_dir", ""):
        return 0
    folder = process_folder(ckpt_cfg.local_dir, output_dir)
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file()) if folder.is_dir() else 0


def layout(tree) -> str:
    """A digest of where every array of `tree` lives (each leaf's mesh, its device ids and its
    partition spec) and of the process layout: a local step is read back only into the same."""
    def where(leaf):
        sharding = leaf.sharding
        mesh = getattr(sharding, "mesh", None)
        if mesh is None:
            return repr(sharding)
        return [list(mesh.axis_names), list(mesh.devices.shape), [d.id for d in mesh.devices.flat],
                str(sharding.spec)]
    described = [jax.process_count(), jax.process_index(), [where(x) for x in jax.tree_util.tree_leaves(tree)]]
    return hashlib.sha256(json.dumps(described).encode()).hexdigest()[:16]


def _orbax_checkpointer(asynchronous: bool):
    """Orbax set up for one process's own checkpoint (the module's docstring says why so)."""
    only_me = ocp.options.MultiprocessingOptions(
        primary_host=None, active_processes={jax.process_index()},
        barrier_sync_key_prefix=f"local-tier-{jax.process_index()}")
    every_shard = type_handlers.create_type_handler_registry(
        (jax.Array, type_handlers.ArrayHandler(primary_host=None, replica_id=None, use_replica_parallel=False)))
    synchronous_directories = ocp.options.AsyncOptions(create_directories_asynchronously=False)
    handler = ocp.CompositeCheckpointHandler(
        composite_options=ocp.CompositeOptions(multiprocessing_options=only_me, async_options=synchronous_directories),
        **{STATE: ocp.PyTreeCheckpointHandler(multiprocessing_options=only_me, type_handler_registry=every_shard),
           DATA: ocp.JsonCheckpointHandler(multiprocessing_options=only_me),
           META: ocp.JsonCheckpointHandler(multiprocessing_options=only_me)})
    if asynchronous:
        return ocp.AsyncCheckpointer(handler, multiprocessing_options=only_me, async_options=synchronous_directories)
    return ocp.Checkpointer(handler, multiprocessing_options=only_me)


class LocalTier:
    """One process's local checkpoints of one run. Every process calls `save` at the same steps
    (the step alone decides); each writes only its own files."""

    def __init__(self, ckpt_cfg, output_dir: str):
        self.every, self.keep = int(ckpt_cfg.local_every), int(ckpt_cfg.local_keep)
        self.run_dir = run_folder(ckpt_cfg.local_dir, output_dir)
        self.directory = process_folder(ckpt_cfg.local_dir, output_dir)
        self._orbax = _orbax_checkpointer(asynchronous=True)
        # Waits for each orbax write to commit, then keeps local_keep steps: at most local_keep
        # committed steps and one being written, as the fit check counts.
        self._committer = ThreadPoolExecutor(1, thread_name_prefix="local-checkpoint")
        self._pending: Future | None = None
        self._failed_once = False
        self.last_saved: int | None = None

    def due(self, step: int) -> bool:
        return self.every > 0 and step % self.every == 0

    # ------------------------------------------------------------------------------------------
    # Saving

    def save(self, step: int, state, data_state: dict, built_from: dict | None = None) -> None:
        """Starts the save of this process's shards of `state` (every process calls it at the same
        step: the checksums are global sums); returns once orbax has them off the devices. Waits
        first for the previous local write (one in flight at a time). `built_from`: what the run was
        built from beyond its config (a LoRA run's base), recorded in `meta` as the persistent tier
        records it, so that a resume from either checks it the same way."""
        if step == self.last_saved:
            return
        self.wait()
        summary = checksums.start_summary(state)  # dispatched, not waited for: the commit reads it
        meta = {"format": FORMAT, "step": step, "process": jax.process_index(), "processes": jax.process_count(),
                "layout": layout(state), "checksum_algorithm": checksums.ALGORITHM,
                "data_checksum": checksums.json_digest(data_state), **(built_from or {})}
        final = self.directory / str(step)
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(final, ignore_errors=True)  # a step written again after a resume from before it
            self._orbax.save(final, args=ocp.args.Composite(**{
                STATE: ocp.args.PyTreeSave(state), DATA: ocp.args.JsonSave(data_state), META: ocp.args.JsonSave(meta)}))
        except Exception as error:  # noqa: BLE001 - orbax and tensorstore raise many types
            self._warn_failed(error)
            self.remove_unfinished()
            return
        self.last_saved = step
        self._pending = self._committer.submit(self._commit, final, summary)

    def _commit(self, final: Path, summary) -> bool:
        """In the background: waits for orbax's write, then writes the checksums into the step, which
        makes it a step (steps()), and keeps local_keep steps. A state holding inf/NaN is not kept
        (the persistent tier's save or the divergence check reports it): returns False then."""
        self._orbax.wait_until_finished()
        sums, nonfinite = checksums.finish_summary(summary)
        if nonfinite:
            shutil.rmtree(final, ignore_errors=True)
            return False
        partial = final / f"{CHECKSUMS}.partial"
        partial.write_text(json.dumps(sums))
        os.replace(partial, final / CHECKSUMS)
        for old in self.steps()[self.keep:]:
            shutil.rmtree(self.directory / str(old), ignore_errors=True)
        return True

    def wait(self) -> None:
        """Waits for the write in flight; a failed one is a warning (the tier is a cache)."""
        pending, self._pending = self._pending, None
        if pending is None:
            return
        try:
            if not pending.result():
                self.last_saved = None
        except Exception as error:  # noqa: BLE001 - disk full, permissions, I/O: all the same here
            self.last_saved = None
            self._warn_failed(error)
            self.remove_unfinished()

    def _warn_failed(self, error: BaseException) -> None:
        if not self._failed_once:
            self._failed_once = True
            print(f"warning: process {jax.process_index()}: a local checkpoint write in {self.directory} "
                  f"failed ({cause(error)}); the run goes on and the persistent tier still protects it",
                  file=sys.stderr, flush=True)

    def remove_unfinished(self) -> None:
        """Removes the writes that did not complete (this process's, killed or failed mid-write):
        orbax's temporary directories, and steps that orbax committed but that have no checksums."""
        if self.directory.is_dir():
            for unfinished in self.directory.iterdir():
                if UNFINISHED in unfinished.name or (unfinished.name.isdigit() and not (unfinished / CHECKSUMS).is_file()):
                    shutil.rmtree(unfinished, ignore_errors=True)

    def close(self) -> None:
        self.wait()
        self._committer.shutdown(wait=True)
        self._orbax.close()

    # ------------------------------------------------------------------------------------------
    # Reading

    def steps(self) -> list[int]:
        """This process's complete local steps, newest first: orbax committed them and their
        checksums are written (the last act of a save)."""
        if not self.directory.is_dir():
            return []
        return sorted((int(p.name) for p in self.directory.iterdir() if p.name.isdigit() and (p / CHECKSUMS).is_file()),
                      reverse=True)

    def load(self, step: int, abstract_state) -> tuple[object, dict, dict]:
        """(state, data position, meta) of local `step`, each array placed in `abstract_state`'s
        sharding. Raises LocalDamaged with the reason. The state is not verified here: that takes
        every process (verify_loaded), and a process that failed to read would not be there."""
        folder = self.directory / str(step)
        reader = _orbax_checkpointer(asynchronous=False)
        try:
            return self._read(reader, folder, step, abstract_state)
        finally:
            reader.close()

    @staticmethod
    def _read(reader, folder: Path, step: int, abstract_state) -> tuple[object, dict, dict]:
        try:
            meta = reader.restore(folder, args=ocp.args.Composite(**{META: ocp.args.JsonRestore()}))[META]
        except Exception as error:  # noqa: BLE001
            raise LocalDamaged(f"cannot be read ({cause(error)})") from None
        if not isinstance(meta, dict) or meta.get("format") != FORMAT or meta.get("step") != step:
            raise LocalDamaged("was written by another version of this tier")
        try:
            meta["checksums"] = json.loads((folder / CHECKSUMS).read_text())
        except (OSError, ValueError) as error:
            raise LocalDamaged(f"has no readable {CHECKSUMS} ({cause(error)})") from None
        if meta.get("layout") != layout(abstract_state):
            raise LocalDamaged("was saved on another mesh or process layout")
        restore_args = jax.tree_util.tree_map(
            lambda x: ocp.ArrayRestoreArgs(sharding=x.sharding, global_shape=x.shape, dtype=x.dtype), abstract_state)
        try:
            restored = reader.restore(folder, args=ocp.args.Composite(**{
                STATE: ocp.args.PyTreeRestore(abstract_state, restore_args=restore_args),
                DATA: ocp.args.JsonRestore()}))
        except Exception as error:  # noqa: BLE001 - orbax and tensorstore raise many types
            raise LocalDamaged(f"cannot be read ({cause(error)})") from None
        return restored[STATE], restored[DATA], meta

    def set_aside(self, step: int) -> Path:
        """Moves a damaged local step out of the way (kept, for a person to look at); returns where."""
        folder, target = self.directory / str(step), self.directory / f"{step}.damaged"
        n = 1
        while target.exists():
            n += 1
            target = self.directory / f"{step}.damaged.{n}"
        if folder.is_dir():
            folder.rename(target)
        return target

    def discard_after(self, step: int) -> None:
        """Removes this process's local steps after `step`: the run resumed from before them and
        writes them again."""
        for newer in self.steps():
            if newer > step:
                shutil.rmtree(self.directory / str(newer), ignore_errors=True)


def verify_loaded(state, data_state: dict, meta: dict) -> str | None:
    """Why a loaded local step is not what was saved (None: it is). A collective: the checksums are
    global sums over every process's shards, so every process calls it with its own load of the
    same step, and a damaged shard on any process shows on all."""
    if meta.get("checksum_algorithm") != checksums.ALGORITHM:
        return f"has checksums of an unknown kind ({meta.get('checksum_algorithm')!r})"
    computed, _ = checksums.summarise(state)
    difference = checksums.first_difference(meta.get("checksums", {}), computed)
    if difference is not None:
        return f"failed verification ({difference})"
    if checksums.json_digest(data_state) != meta.get("data_checksum"):
        return "failed verification (its data position does not match its checksum)"
    return None
