"""The node-local checkpoint tier: frequent saves of what resumes the run on the same nodes.

`checkpoint.local_dir` (node-local: NVMe, /dev/shm or /tmp) holds, per process,
`<local_dir>/<run>/process-<i>-of-<n>/<step>/`: the arrays of the train state that this process's
devices hold (one file per distinct shard, its raw bytes), and `manifest.json` naming each file's
leaf, index, dtype and CRC-32, with the data position saved beside it. Nothing else: a local step
restores only onto the same mesh and process layout (a replaced node, another mesh or another
process count finds nothing it can use, and the run falls back to the persistent tier, which
restores onto any mesh). It is a cache of the persistent tier, never a replacement.

Why not orbax's emergency CheckpointManager (orbax-checkpoint 0.12.8, installed in both venvs)?
It keeps a local copy per *replica slice* and restores by broadcasting from a slice that holds
a complete copy: it requires at least two data-parallel replicas along a replica axis of the mesh,
drops `local_directory` silently for one slice (one node, or a mesh with no pure data axis, which
is what most runs here are), saves only the state item (not each process's data position nor the
checksums every reader of a checkpoint verifies), and is marked "experimental; do not use without
specific approval". So the tier is this module: each process writes its own shards in a
background thread, and the choice at start-up (choose_local_step) is one agreed decision.

Writes are asynchronous: `save` copies this process's shards off the devices (the stall) and
returns; a thread writes them into `<step>.partial` and renames it to `<step>` once complete, so
a process killed mid-write leaves nothing a resume would pick. A failed local write is one warning
and the run goes on (the persistent tier still protects it): the tier is a cache.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import sys
import zlib
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import jax
import numpy as np

MANIFEST = "manifest.json"
FORMAT = 1


class LocalDamaged(Exception):
    """A local step that cannot be used as it is (missing, damaged, another layout); the message says why."""


def run_folder(local_dir: str, output_dir: str) -> Path:
    """This run's folder in `local_dir`: several runs may share one node's /dev/shm."""
    absolute = str(Path(output_dir).absolute())
    return Path(local_dir) / f"{Path(absolute).name}-{hashlib.sha256(absolute.encode()).hexdigest()[:10]}"


def held_bytes(ckpt_cfg, output_dir: str) -> int:
    """Bytes this process's local steps of the run hold already (an earlier launch's), which a new
    launch's steps replace: the start-up fit check leaves them out of what it still needs."""
    if not ckpt_cfg.get("local_dir", ""):
        return 0
    folder = run_folder(ckpt_cfg.local_dir, output_dir) / f"process-{jax.process_index()}-of-{jax.process_count()}"
    return sum(p.stat().st_size for p in folder.glob("*/*") if p.is_file()) if folder.is_dir() else 0


def _index_key(index: tuple, shape: tuple) -> list[list[int]]:
    """A shard's index (a tuple of slices) as [[start, stop], ...] with the Nones filled in."""
    return [[s.start or 0, dim if s.stop is None else s.stop] for s, dim in zip(index, shape)]


class LocalTier:
    """One process's local checkpoints of one run. Every process calls `save` at the same steps
    (the step alone decides); each writes only its own files."""

    def __init__(self, ckpt_cfg, output_dir: str):
        self.every, self.keep = int(ckpt_cfg.local_every), int(ckpt_cfg.local_keep)
        self.run_dir = run_folder(ckpt_cfg.local_dir, output_dir)
        self.directory = self.run_dir / f"process-{jax.process_index()}-of-{jax.process_count()}"
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="local-checkpoint")
        self._pending: Future | None = None
        self._failed_once = False
        self.last_saved: int | None = None

    def due(self, step: int) -> bool:
        return self.every > 0 and step % self.every == 0

    # ------------------------------------------------------------------------------------------
    # Saving

    def save(self, step: int, state, data_state: dict) -> None:
        """Copies this process's shards of `state` off the devices and writes them in the
        background; waits first for the previous local write (one in flight at a time)."""
        if step == self.last_saved:
            return
        self.wait()
        leaves, shards = [], []
        for path, leaf in jax.tree_util.tree_leaves_with_path(state):
            seen, entry = set(), {"path": jax.tree_util.keystr(path), "dtype": str(leaf.dtype),
                                  "shape": list(leaf.shape), "shards": []}
            for shard in leaf.addressable_shards:
                key = _index_key(shard.index, leaf.shape)
                if str(key) in seen:  # replicas of one shard on this process's devices: one file
                    continue
                seen.add(str(key))
                entry["shards"].append({"index": key, "file": f"{len(shards)}.bin"})
                shards.append(shard.data)
            leaves.append(entry)
        host = jax.device_get(shards)  # the stall: later steps donate these buffers
        self.last_saved = step
        self._pending = self._writer.submit(self._write, step, leaves, host, data_state)

    def _write(self, step: int, leaves: list, host: list, data_state: dict) -> None:
        partial = self.directory / f"{step}.partial"
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir(parents=True)
        for entry in leaves:
            for shard in entry["shards"]:
                data = np.ascontiguousarray(host[int(shard["file"].split(".")[0])])
                (partial / shard["file"]).write_bytes(data.tobytes())
                shard["crc32"] = zlib.crc32(data.reshape(-1).view(np.uint8))
        manifest = {"format": FORMAT, "step": step, "process": jax.process_index(),
                    "processes": jax.process_count(), "leaves": leaves, "data": data_state}
        (partial / MANIFEST).write_text(json.dumps(manifest))
        final = self.directory / str(step)
        shutil.rmtree(final, ignore_errors=True)  # a step written again after a resume from before it
        partial.rename(final)
        for old in self.steps()[self.keep:]:
            shutil.rmtree(self.directory / str(old), ignore_errors=True)

    def wait(self) -> None:
        """Waits for the write in flight; a failed one is a warning (the tier is a cache)."""
        pending, self._pending = self._pending, None
        if pending is None:
            return
        try:
            pending.result()
        except Exception as error:  # noqa: BLE001 - disk full, permissions, I/O: all the same here
            self.last_saved = None
            if not self._failed_once:
                self._failed_once = True
                print(f"warning: process {jax.process_index()}: a local checkpoint write in {self.directory} "
                      f"failed ({type(error).__name__}: {error}); the run goes on and the persistent tier "
                      "still protects it", file=sys.stderr, flush=True)

    def close(self) -> None:
        self.wait()
        self._writer.shutdown(wait=True)

    # ------------------------------------------------------------------------------------------
    # Reading

    def steps(self) -> list[int]:
        """This process's committed local steps, newest first (a `.partial` write is not one)."""
        if not self.directory.is_dir():
            return []
        return sorted((int(p.name) for p in self.directory.iterdir() if p.name.isdigit() and p.is_dir()),
                      reverse=True)

    def load(self, step: int, abstract_state):
        """(state, data position) of local `step`, each array placed in `abstract_state`'s sharding,
        every file checked against its CRC-32. Raises LocalDamaged with the reason."""
        folder = self.directory / str(step)
        try:
            manifest = json.loads((folder / MANIFEST).read_text())
        except (OSError, ValueError) as error:
            raise LocalDamaged(f"its manifest cannot be read ({type(error).__name__})") from None
        flat, treedef = jax.tree_util.tree_flatten_with_path(abstract_state)
        if manifest.get("format") != FORMAT or len(manifest.get("leaves", [])) != len(flat):
            raise LocalDamaged("it holds another state's tree")
        arrays = []
        for (path, want), entry in zip(flat, manifest["leaves"]):
            if (entry["path"], entry["shape"], entry["dtype"]) != (jax.tree_util.keystr(path), list(want.shape),
                                                                   str(want.dtype)):
                raise LocalDamaged(f"its {entry['path']} does not fit this run's state")
            arrays.append(_assemble(folder, entry, want))
        return jax.tree_util.tree_unflatten(treedef, arrays), manifest["data"]

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


def _assemble(folder: Path, entry: dict, want) -> jax.Array:
    files = {str(s["index"]): s for s in entry["shards"]}
    dtype = jax.numpy.dtype(entry["dtype"])
    read = {}
    singles = []
    for device, index in want.sharding.addressable_devices_indices_map(tuple(want.shape)).items():
        key = str(_index_key(index, tuple(want.shape)))
        if key not in files:
            raise LocalDamaged(f"it holds no shard {key} of {entry['path']} for this mesh")
        if key not in read:
            shard = files[key]
            try:
                raw = (folder / shard["file"]).read_bytes()
            except OSError as error:
                raise LocalDamaged(f"its file {shard['file']} cannot be read ({type(error).__name__})") from None
            if zlib.crc32(raw) != shard.get("crc32"):
                raise LocalDamaged(f"its file {shard['file']} ({entry['path']}) failed its CRC-32 check")
            shape = [stop - start for start, stop in shard["index"]]
            try:
                read[key] = np.frombuffer(raw, dtype=dtype).reshape(shape)
            except ValueError:
                raise LocalDamaged(f"its file {shard['file']} has the wrong size for {entry['path']}") from None
        singles.append(jax.device_put(read[key], device))
    return jax.make_array_from_single_device_arrays(tuple(want.shape), want.sharding, singles)
