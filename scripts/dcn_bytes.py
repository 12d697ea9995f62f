"""Bytes each device sends between nodes per step, counted apart from maxtext_rocm/planner/comm.py.

    python scripts/dcn_bytes.py CONFIG.py[:VARIANT] --target=GPU:NODESxGPUS [--config.KEY=VALUE ...]

compiles the step as `python -m maxtext_rocm.compile ... --comm` does, then prints comm.py's DCN
bytes beside this module's own count of the same optimized HLO, op by op. The count is
deliberately simpler and written without comm.py's parser, so that a mistake there shows as a
disagreement:

- every collective instruction of the text, run as many times as the product of the
  `known_trip_count`s of the while loops around it (a loop without one is refused);
- its device groups expanded from whichever form XLA printed (explicit lists, an iota with a
  transpose, or a `mesh[...]` with the axes a group varies along);
- a group is DCN when its devices sit on more than one node, a device's node being its id // the
  GPUs per node (gpu_nodes.cluster_mesh places node n's devices at ids nG..(n+1)G-1), partition
  p being device `device_ids[p]` of the jit's device assignment (the mesh's devices in order);
  a collective-permute is DCN when any of its pairs crosses nodes;
- bytes leaving a device for a ring of n: all-gather (n-1)/n x result, all-reduce 2(n-1)/n x
  size, all-to-all (n-1)/n x size, reduce-scatter (n-1) x result; a permute its size times the
  most pairs any one device sends.

It does not recount an all-reduce as the reduce-scatter a GPU compiler would make of it (comm.py
does, hlo_slices.py), so the two totals agree only where comm.py recounted no DCN all-reduce: so
it is for the pipelines (the all-reduces over `stage` are used whole), and a disagreement
elsewhere is the first thing to look at. A collective inside a conditional's branch or a loop of
unknown trip count is refused, not guessed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import re
import sys
from collections import defaultdict

import numpy as np

KINDS = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "collective-permute")
_LINE = re.compile(r"^\s*(?:ROOT\s+)?%([\w.\-]+)\s*=\s*(.+?)\s+([a-z][a-z0-9\-]*)\((.*)$")
_TYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4,
               "f32": 4, "s64": 8, "u64": 8, "f64": 8}


@dataclasses.dataclass
class Op:
    """One collective instruction: where it is, what it moves and how often."""
    name: str
    computation: str
    kind: str
    dtype: str
    group_size: int
    bytes_once: float  # leaving one device, one execution
    executions: int
    op_name: str  # jax's metadata: which part of the program made it

    @property
    def bytes_per_step(self) -> float:
        return self.bytes_once * self.executions


def _array_bytes(shape: str) -> list[tuple[str, float]]:
    """(dtype, bytes) of each array in a result shape's text (a tuple lists several)."""
    out = []
    for dtype, dims in re.findall(r"\b([a-z]+\d*)\[([\d,]*)\]", shape):
        if dtype in _TYPE_BYTES:
            out.append((dtype, _TYPE_BYTES[dtype] * math.prod(int(x) for x in dims.split(",") if x)))
    return out


def _computations(text: str) -> tuple[dict[str, list[tuple]], str]:
    """name -> [(instruction, shape, opcode, rest of line)], and the entry computation's name."""
    comps, current, entry = {}, None, None
    for line in text.splitlines():
        header = re.match(r"^(ENTRY\s+)?%([\w.\-]+)\s.*\{\s*$", line)
        if header and not line.startswith(" "):
            current = header.group(2)
            comps[current] = []
            entry = current if header.group(1) else entry
        elif line.startswith("}"):
            current = None
        elif current is not None:
            match = _LINE.match(line)
            if match:
                comps[current].append(match.groups())
    return comps, entry


def _executions(comps: dict, entry: str) -> tuple[dict[str, int], set[str], set[str]]:
    """How many times each computation runs per step (the trip counts of the loops around it),
    the computations inside a loop whose trip count the text does not give, and the branches of
    schedule phases' conditionals (counted as often as their phase runs)."""
    runs: dict[str, int] = defaultdict(int)
    unknown: set[str] = set()

    def visit(name: str, times: int, in_unknown: bool, phases: frozenset = frozenset()):
        runs[name] += times
        if in_unknown:
            unknown.add(name)
        for _, _, opcode, rest in comps[name]:
            phase = _PHASE.search(rest) if opcode == "conditional" else None
            if phase and phase.group(0) not in phases and times * int(phase.group(1)) % int(phase.group(2)) == 0:
                # a schedule phase's conditional runs in K of its loop's N iterations
                # (parallel/pipeline/one_f_one_b_loop.phase_scope): its branches, K/N of the loop's
                for callee in _branches(rest):
                    visit(callee, times * int(phase.group(1)) // int(phase.group(2)), in_unknown,
                          phases | {phase.group(0)})
                    phased.add(callee)
                continue
            if opcode == "while":
                trips = re.search(r'"known_trip_count":\{"n":"(\d+)"\}', rest)
                n = int(trips.group(1)) if trips else 1
                visit(re.search(r"body=%([\w.\-]+)", rest).group(1), times * n, in_unknown or not trips, phases)
                visit(re.search(r"condition=%([\w.\-]+)", rest).group(1), times * (n + 1), in_unknown or not trips,
                      phases)
                continue
            called = re.findall(r"\bcalls=%([\w.\-]+)", rest) + _branches(rest)
            if opcode == "call":
                called += re.findall(r"to_apply=%([\w.\-]+)", rest)
            for callee in called:  # every branch of a conditional: dcn_count refuses collectives there
                visit(callee, times, in_unknown, phases)

    phased: set[str] = set()
    visit(entry, 1, False)
    return runs, unknown, phased


_PHASE = re.compile(r"phase_runs_(\d+)_of_(\d+)")  # a schedule phase's conditional (one_f_one_b_loop.phase_scope)


def _branches(rest: str) -> list[str]:
    """A conditional's branch computations, in either of its text forms."""
    listed = re.search(r"branch_computations=\{([^}]*)\}", rest)
    named = re.findall(r"\b(?:true|false)_computation=%([\w.\-]+)", rest)
    return named + ([c.strip().lstrip("%") for c in listed.group(1).split(",")] if listed else [])


def _ints(text: str) -> list[int]:
    return [int(x) for x in re.findall(r"\d+", text)]


def _iota(dims: list[int], perm: list[int] | None) -> np.ndarray:
    ids = np.arange(math.prod(dims)).reshape(dims)
    return (ids.transpose(perm) if perm else ids).reshape(-1)


def groups_of(rest: str, partitions: int) -> list[list[int]]:
    """The device groups of a collective's attribute text."""
    explicit = re.search(r"replica_groups=\{((?:\{[\d,]*\},?)*)\}", rest)
    if explicit:
        found = [_ints(g) for g in re.findall(r"\{([\d,]*)\}", explicit.group(1))]
        return found or [list(range(partitions))]
    iota = re.search(r"replica_groups=\[(\d+),(\d+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", rest)
    if iota:
        ids = _iota(_ints(iota.group(3)), _ints(iota.group(4)) if iota.group(4) else None)
        return ids.reshape(int(iota.group(1)), int(iota.group(2))).tolist()
    mesh = re.search(r"replica_groups=mesh\[([^\]]*)\](?:,\s*device_ids=\(\[([\d,]+)\](?:<=\[([\d,]+)\])?"
                     r"(?:T\(([\d,]+)\))?\))?\s*\{([^}]*)\}", rest)
    if mesh:
        axes = [(a.strip().strip("'"), int(n)) for a, n in (p.rsplit("=", 1) for p in mesh.group(1).split(","))]
        dims = [n for _, n in axes]
        ids = np.arange(math.prod(dims)) if mesh.group(2) is None else _iota(
            _ints(mesh.group(3) or mesh.group(2)), _ints(mesh.group(4)) if mesh.group(4) else None)
        grid = ids.reshape(dims)
        listed = [item.strip().strip("'") for item in mesh.group(5).split(",") if item.strip()]
        if any(":" in item for item in listed):
            raise ValueError(f"sub-axis groups are not read here: {mesh.group(0)}")
        varying = [[a for a, _ in axes].index(item) for item in listed]
        fixed = [k for k in range(len(dims)) if k not in varying]
        size = math.prod(dims[k] for k in varying)
        return grid.transpose(fixed + varying).reshape(-1, size).tolist()
    if "replica_groups" in rest:
        raise ValueError(f"replica groups not read here: {rest[:200]}")
    return [list(range(partitions))]


def _refuse_if(uncounted: bool, name: str) -> None:
    if uncounted:
        raise ValueError(f"{name}: a collective across nodes in a conditional's branch or a loop of unknown trip "
                         "count is not counted here")


def dcn_count(text: str, device_ids: list[int], gpus_per_node: int) -> list[Op]:
    """Every collective of the module that crosses nodes, with its bytes per device per step."""
    comps, entry = _computations(text)
    runs, unknown, phased = _executions(comps, entry)
    partitions = len(device_ids)
    node = [device_ids[p] // gpus_per_node for p in range(partitions)]
    conditional_branches = {callee for ops in comps.values() for _, _, opcode, rest in ops if opcode == "conditional"
                            for callee in _branches(rest)} - phased
    found = []
    for comp, instructions in comps.items():
        by_name = {i[0]: i for i in instructions}
        for name, shape, opcode, rest in instructions:
            kind = opcode.removesuffix("-done")
            if kind not in KINDS or runs.get(comp, 0) == 0:
                continue
            uncounted = comp in conditional_branches or comp in unknown
            attributes = rest if not opcode.endswith("-done") else by_name[rest.split(")")[0].strip().lstrip("%")][3]
            op_name = re.search(r'op_name="([^"]*)"', rest)
            arrays = _array_bytes(shape)
            if kind == "collective-permute":
                pairs = [(a, b) for a, b in re.findall(r"\{(\d+),(\d+)\}", attributes.split("source_target_pairs=")[1])
                         if a != b]
                pairs = [(int(a), int(b)) for a, b in pairs]
                if not any(node[a] != node[b] for a, b in pairs):
                    continue
                _refuse_if(uncounted, name)
                sends = max(np.bincount([a for a, _ in pairs]))
                found += [Op(name, comp, kind, dtype, 2, size * sends, runs[comp],
                             op_name.group(1) if op_name else "") for dtype, size in arrays]
                continue
            groups = groups_of(attributes, partitions)
            if not any(len({node[p] for p in g}) > 1 for g in groups):
                continue  # within a node (a conditional's branch may hold these: 1f1b's tail)
            _refuse_if(uncounted, name)
            n = max(len(g) for g in groups)
            factor = {"all-gather": (n - 1) / n, "all-reduce": 2 * (n - 1) / n, "all-to-all": (n - 1) / n,
                      "reduce-scatter": n - 1}[kind]
            found += [Op(name, comp, kind, dtype, n, size * factor, runs[comp],
                         op_name.group(1) if op_name else "") for dtype, size in arrays]
    return found


# ----------------------------------------------------------------------------------------------
# The command: compile as the planner does, keep what it counted, count again


@contextlib.contextmanager
def what_comm_counts():
    """While open, every count comm.py makes is kept in the yielded dict: "text" (the optimized HLO
    it read), "result" (its count) and "device_ids" (the mesh's devices in partition order)."""
    from maxtext_rocm.planner import comm as comm_lib

    seen = {}
    of, account = comm_lib.MeshLayout.of, comm_lib.account

    def layout_of(mesh, mesh_shape=None, compiled=None):
        seen["device_ids"] = [d.id for d in mesh.devices.flat]
        return of(mesh, mesh_shape, compiled)

    def counted(text, layout):
        seen["text"], seen["result"] = text, account(text, layout)
        return seen["result"]

    comm_lib.MeshLayout.of, comm_lib.account = layout_of, counted
    try:
        yield seen
    finally:
        comm_lib.MeshLayout.of, comm_lib.account = of, account


def main(argv: list[str]) -> int:
    sys.path.insert(0, __file__.rsplit("/scripts/", 1)[0])
    from maxtext_rocm.planner import report as report_lib
    from maxtext_rocm.planner.gpu_nodes import force_host_devices

    target = next(a.split("=", 1)[1] for a in argv if a.startswith("--target="))
    nodes, gpus = (int(x) for x in target.split(":")[1].split("x"))
    force_host_devices(nodes * gpus)
    with what_comm_counts() as seen:
        report_lib.main([*argv, "--comm"])
    print(compare(seen["text"], seen["device_ids"], gpus, seen["result"]))
    return 0


def compare(text: str, device_ids: list[int], gpus_per_node: int, counted: dict) -> str:
    """comm.py's DCN figure beside this count, grouped by kind and by the jax op that made each."""
    ops = dcn_count(text, device_ids, gpus_per_node)
    mib, gib = 2 ** 20, 2 ** 30
    theirs = counted["bytes_by_link"].get("DCN", 0.0)
    mine = sum(o.bytes_per_step for o in ops)
    lines = [f"DCN bytes per device per step: comm.py {theirs / gib:.4f} GiB, counted again {mine / gib:.4f} GiB",
             f"  {'kind':<20}{'n':>3}{'dtype':>6}{'runs':>6}{'MiB/step':>12}  made by"]
    rows = defaultdict(float)
    for o in ops:
        where = re.sub(r"\s+stack_frame_id=\d+", "", o.op_name)
        rows[(o.kind, o.group_size, o.dtype, o.executions, where)] += o.bytes_per_step
    for (kind, n, dtype, runs, where), b in sorted(rows.items(), key=lambda kv: -kv[1]):
        lines.append(f"  {kind:<20}{n:>3}{dtype:>6}{runs:>6}{b / mib:>12.2f}  {where[:110]}")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
