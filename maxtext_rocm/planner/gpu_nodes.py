"""The GPU nodes that `python -m maxtext_rocm.compile` plans for, and how it fakes them on this CPU: N host
devices (one process standing in for NODES hosts), the mesh a cluster run would build over them,
and XLA's dump of the optimized program (all there is of a GPU program XLA:CPU cannot finish)."""

from __future__ import annotations

import glob
import os
import sys
import tempfile

import jax
import numpy as np
from jax._src import xla_bridge
from jax.sharding import AxisType, Mesh

from maxtext_rocm import config as config_lib
from maxtext_rocm.models.attention import implementation_for
from maxtext_rocm.resolve import Target

# Target -> (memory in GiB, the device_kind substring metrics.PEAK_TFLOPS knows it by).
TARGETS = {
    "mi300x": 192, "mi325x": 256, "mi355x": 288, "mi350x": 288,
    "h100": 80, "h200": 141, "b200": 180,
}
FNUZ_TARGETS = ("mi300x", "mi325x")  # gfx942: fp8 "auto" resolves to FNUZ there
NVIDIA_PREFIXES = ("h100", "h200", "b200")
def parse_target(text: str) -> tuple[str, int]:
    """(kind, device count) of `KIND:N`, or of `KIND:NODESxGPUS` (NODES*GPUS devices; see target_nodes)."""
    kind, _, count = text.lower().partition(":")
    nodes, _, gpus = (count or "1").rpartition("x")
    if kind not in TARGETS or not gpus.isdigit() or not (nodes or "1").isdigit() or int(gpus) < 1 \
            or int(nodes or 1) < 1:
        raise ValueError(f"--target={text!r} is not valid; use KIND:N or KIND:NODESxGPUS with KIND one of "
                         f"{', '.join(TARGETS)}, e.g. mi355x:8 or mi355x:2x8")
    return kind, int(nodes or 1) * int(gpus)


def target_nodes(text: str) -> int:
    """NODES of `KIND:NODESxGPUS` (1 for `KIND:N`): the processes a cluster run would have."""
    count = text.lower().partition(":")[2]
    return int(count.partition("x")[0]) if "x" in count else 1


def cluster_mesh(mesh_cfg, devices, nodes: int):
    """The mesh a run on `nodes` hosts would build (sharding.make_mesh with one process per host),
    from fake devices of one process: node n holds devices n*G..(n+1)*G-1, an axis's DCN part is
    its major factor, as mesh_utils.create_hybrid_device_mesh lays it out."""
    shape = config_lib.mesh_shape(mesh_cfg, len(devices), nodes)
    ici = [shape["ici"][a] for a in config_lib.MESH_AXES]
    dcn = [shape["dcn"][a] for a in config_lib.MESH_AXES]
    grid = np.asarray(devices, dtype=object).reshape(*dcn, *ici)  # node-major, then the node's mesh
    k = len(ici)
    interleaved = grid.transpose([x for a in range(k) for x in (a, k + a)])  # (dcn_0, ici_0, dcn_1, ...)
    return Mesh(interleaved.reshape([i * d for i, d in zip(ici, dcn)]), config_lib.MESH_AXES,
                axis_types=(AxisType.Auto,) * k)


def force_host_devices(n: int, dump_hlo: bool = False) -> None:
    """N fake CPU devices. XLA reads the flag when JAX first starts a backend, which importing the
    package (it imports jax) does not do; if a backend already started, re-run this process.
    `dump_hlo`: XLA also writes the train step's optimized HLO to a directory (`hlo_dump_dir`),
    which is all there is of a GPU program that XLA:CPU cannot finish compiling."""
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split()
             if not f.startswith("--xla_force_host_platform_device_count")]
    flags.append(f"--xla_force_host_platform_device_count={n}")
    if dump_hlo and not hlo_dump_dir():
        flags += [f"--xla_dump_to={tempfile.mkdtemp(prefix='maxtext_rocm_hlo_')}", "--xla_dump_hlo_as_text",
                  "--xla_dump_hlo_module_re=.*train_step.*"]
    os.environ["XLA_FLAGS"] = " ".join(flags)
    os.environ["JAX_PLATFORMS"] = "cpu"
    # Importing jax (above) reads JAX_PLATFORMS already, so the platform goes to its config too.
    if getattr(xla_bridge, "_backends", None):  # started: the flag comes too late here
        if jax.default_backend() == "cpu" and jax.device_count() == n:
            return
        os.execv(sys.executable, [sys.executable, "-m", "maxtext_rocm.compile", *sys.argv[1:]])
    jax.config.update("jax_platforms", "cpu")


def hlo_dump_dir() -> str | None:
    for flag in os.environ.get("XLA_FLAGS", "").split():
        if flag.startswith("--xla_dump_to="):
            return flag.split("=", 1)[1]
    return None


def dumped_optimized_hlo() -> str | None:
    """The newest optimized train-step HLO that XLA dumped (see force_host_devices)."""
    directory = hlo_dump_dir()
    files = glob.glob(os.path.join(directory, "*train_step*after_optimizations.txt")) if directory else []
    if not files:
        return None
    with open(max(files, key=os.path.getmtime)) as f:
        return f.read()


def resolve_target(kind: str) -> Target:
    """What the resolve step (maxtext_rocm/resolve.py) needs to know of a GPU kind: its platform,
    and whether its fp8 is FNUZ-only (gfx942)."""
    if kind not in TARGETS:
        raise ValueError(f"unknown GPU kind {kind!r}; known: {', '.join(TARGETS)}")
    return Target("cuda" if kind.startswith(NVIDIA_PREFIXES) else "rocm", kind in FNUZ_TARGETS)


def flash_attention_for(kind: str, sinks: bool = False) -> str:
    """The attention that keeps no [seq, seq] scores on a target: cuDNN's fused kernel on NVIDIA
    GPUs, the blockwise XLA attention elsewhere (ROCm) and wherever the model has attention sinks
    (`sinks`, model.attention_sinks: gpt-oss), which cuDNN's kernel has no input for."""
    # the resolve step's own rule, in bf16
    return implementation_for("auto", resolve_target(kind).platform, sinks=sinks)
