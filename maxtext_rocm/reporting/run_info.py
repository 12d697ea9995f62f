"""What a run directory records about how it was made: the resolved config and its environment."""

from __future__ import annotations

import importlib.metadata
import json
import os
import subprocess
from pathlib import Path

import jax

from maxtext_rocm.errors import UserError

PACKAGES = ("jax", "jaxlib", "flax", "optax", "orbax-checkpoint", "ml-collections")


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def git_commit() -> str | None:
    """The commit of the checkout the package runs from, when it runs from one."""
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=Path(__file__).resolve().parent,
                             capture_output=True, text=True, timeout=5)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() or None if out.returncode == 0 else None


def environment(mesh) -> dict:
    devices = jax.devices()
    return {
        "versions": {p: _version(p) for p in PACKAGES},
        "backend": jax.default_backend(),
        "device_kind": devices[0].device_kind,
        "device_count": len(devices),
        "process_count": jax.process_count(),
        "mesh": {axis: int(size) for axis, size in mesh.shape.items()},
        "git_commit": git_commit(),
    }


def write_config_json(cfg, mesh, path: str | os.PathLike) -> None:
    """Writes config + environment atomically, so a crash never leaves half a file; a directory
    that cannot be written is the user's to fix (UserError)."""
    path = Path(path)
    record = {"config": cfg.to_dict(), "environment": environment(mesh)}
    tmp = path.with_suffix(".json.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps(record, indent=2, default=str) + "\n")
        os.replace(tmp, path)
    except OSError as error:
        raise UserError(f"cannot write {path} ({error.strerror}); set output_dir to a writable directory") from None
