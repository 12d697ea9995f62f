"""Collective accounting of a compiled, partitioned program: bytes leaving each device per step.

    report = comm.account(compiled.as_text(), comm.MeshLayout.of(mesh, mesh_shape, compiled))

What is counted, from the optimized HLO text (`compiled.as_text()`, or the *after_optimizations*
file of `XLA_FLAGS=--xla_dump_to=DIR --xla_dump_hlo_as_text`), starting at ENTRY and following every
called computation (fusions, calls, async wrappers, while bodies and conditions, conditional
branches):

- all-gather, all-reduce, reduce-scatter, all-to-all, collective-permute, ragged-all-to-all, and
  their asynchronous -start/-done forms (counted once, at the -done, with the -start's groups);
- bytes leaving one device per execution, for a ring over a group of N devices:
    all-gather          (N-1)/N x result          reduce-scatter  (N-1)/N x input
    all-reduce         2(N-1)/N x size            all-to-all      (N-1)/N x size
    collective-permute  size, if the device sends to another device (the busiest sender)
    ragged-all-to-all   (N-1)/N x the smaller of its input and output buffers: an UPPER bound on
                        the average device's bytes (the sizes are run-time data; what all devices
                        send, all receive, so the average sent is at most the output buffer too;
                        an exact expert exchange sizes one of the two for its worst case);
- a tuple-shaped (combined) collective counts each element, by its own shape;
- a collective inside a `while` runs its trip count (`known_trip_count` in the loop's backend
  config), nested loops multiply; a loop without a known trip count that holds a collective is listed in
  `unknown_trip_count_loops` and its collectives are counted once, so the total is then a lower
  bound (the report says so);
- of a conditional, the branch that moves the most (an upper bound for the step), in every
  execution of the computation around it; but a conditional named as a schedule phase that runs
  in K of its loop's N iterations (`phase_runs_K_of_N` in its op_name: 1f1b's forward, tail and
  backward, parallel/pipeline/one_f_one_b_loop.phase_scope) counts K/N of them;
- XLA:CPU has no reduce-scatter pass: an all-reduce (or tuple element of one) whose every use is a
  dynamic-slice to 1/N of it (through bitcasts, copies and fusion parameters) that takes each
  device's own piece (its start a function of the partition id, one piece per device, N different
  pieces in a group: hlo_slices.py) is counted as the reduce-scatter a GPU compiler makes of it;
  `recounted_as_reduce_scatter` says how many. One whose result is used whole, through N slices
  of 1/N (a loop counter's offset, static slices), stays an all-reduce;
- each group is mapped back to the mesh axes its devices differ along (partition p is the device
  at `mesh.devices.flat[p]`, or the executable's own device order); an axis part that spans
  processes (the DCN part, the major factor of an axis whose mesh.dcn size > 1) makes the
  collective a DCN one, otherwise it is ICI.

Not counted: host transfers (infeed, outfeed, send/recv to the host), and the few bytes of
synchronisation a real collective library adds. Dtypes are as the program shows them: XLA:CPU's
float normalization shows bf16 collectives as f32, so on the CPU a bf16 run's bytes read as fp32's
(see comm_minimum.py for the minimum in both dtypes).

The same walk counts the program's matmul work (`dot_flops`: every dot and convolution, 2 FLOPs per
multiply-add, times its loops' trip counts, inside fusions too, the larger branch of a conditional),
so the compile report can hold the compiled step to the analytic FLOPs (maxtext_rocm/planner/estimates.py).
A dot in a loop without a known trip count (the blockwise attention's run-time bounds) counts
once and is listed in `unknown_trip_count_dot_loops`: the count is then a lower bound. On XLA:CPU
every matmul is a plain dot; a GPU program's cuBLAS/hipBLASLt custom calls would not be counted.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections import Counter, defaultdict

import numpy as np

from maxtext_rocm.planner import comm_minimum
from maxtext_rocm.planner.hlo_slices import SliceCheck
from maxtext_rocm.planner.hlo_text import (Computation, Instruction, array_dims, parse_module, replica_groups,
                                           shape_arrays, shape_elements, source_target_pairs)

COLLECTIVES = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "collective-permute",
               "ragged-all-to-all")
_TRIP_COUNT = re.compile(r'"known_trip_count"\s*:\s*\{\s*"n"\s*:\s*"(\d+)"')
_PHASE = re.compile(r"phase_runs_(\d+)_of_(\d+)")


@dataclasses.dataclass(frozen=True)
class MeshLayout:
    """Which mesh position each partition id has, and how large each axis's ICI part is."""

    axis_names: tuple[str, ...]
    coordinates: tuple[tuple[int, ...], ...]  # partition id -> coordinate along each axis
    ici_sizes: tuple[int, ...]  # an axis's coordinate // its ICI size is its DCN (process) index
    dcn_sizes: tuple[int, ...]

    @classmethod
    def from_shape(cls, axis_sizes: dict[str, int], dcn_sizes: dict[str, int] | None = None,
                   partition_positions=None) -> "MeshLayout":
        """Partition p at mesh position `partition_positions[p]` (default: row-major order)."""
        names = tuple(axis_sizes)
        dims = [axis_sizes[a] for a in names]
        dcn = [(dcn_sizes or {}).get(a, 1) for a in names]
        positions = (partition_positions if partition_positions is not None
                     else [np.unravel_index(p, dims) for p in range(math.prod(dims))])
        return cls(names, tuple(tuple(int(c) for c in pos) for pos in positions),
                   tuple(d // s for d, s in zip(dims, dcn)), tuple(dcn))

    @classmethod
    def of(cls, mesh, mesh_shape: dict | None = None, compiled=None) -> "MeshLayout":
        """The layout of a `jax.sharding.Mesh`; `mesh_shape` is config.mesh_shape(...)'s result
        (for the DCN sizes); the executable's device order when `compiled` can tell it."""
        ids = np.vectorize(lambda d: d.id)(mesh.devices)
        order = [d.id for d in mesh.devices.flat]
        try:  # the executable's partitions, in order
            order = [d.id for d in compiled._executable.xla_executable.local_devices()]
        except AttributeError:
            pass
        where = {int(i): np.unravel_index(k, ids.shape) for k, i in enumerate(ids.flat)}
        return cls.from_shape(dict(mesh.shape), mesh_shape["dcn"] if mesh_shape else None,
                              [where[i] for i in order])

    def axes_of(self, devices) -> tuple[tuple[str, ...], bool]:
        """The mesh axes a set of partition ids differ along, and whether any crosses DCN."""
        coords = np.array([self.coordinates[d] for d in devices])
        varying = [a for a in range(len(self.axis_names)) if len(set(coords[:, a])) > 1]
        dcn = any(self.dcn_sizes[a] > 1 and len(set(coords[:, a] // self.ici_sizes[a])) > 1 for a in varying)
        return tuple(self.axis_names[a] for a in varying), dcn


# ----------------------------------------------------------------------------------------------
# Accounting


@dataclasses.dataclass
class Collective:
    kind: str  # the ring algorithm it is counted as (reduce-scatter for a re-counted all-reduce)
    opcode: str  # as the HLO names it
    name: str
    computation: str
    axes: tuple[str, ...]
    dcn: bool
    group_size: int
    dtype: str
    bytes: float  # leaving one device, one execution
    executions: int
    recounted: bool = False  # an all-reduce counted as a reduce-scatter
    upper_bound: bool = False  # ragged-all-to-all: its buffer, not its run-time sizes
    in_unknown_loop: bool = False

    @property
    def bytes_per_step(self) -> float:
        return self.bytes * self.executions


def matmul_flops(comp: Computation, inst: Instruction) -> float:
    """FLOPs of one dot or convolution: 2 x result elements x the contracted elements of each
    (a multiply and an add per term). A convolution's contraction is its kernel's elements per
    output feature (dim_labels name the kernel's `o` dimension)."""
    operands = [comp.instructions.get(o) for o in inst.operands[:2]]
    if any(o is None for o in operands):
        raise ValueError(f"{inst.opcode} {inst.name} in {comp.name}: an operand is not in its computation")
    if inst.opcode == "dot":
        lhs = array_dims(operands[0].shape)
        contracting = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", inst.attributes)
        contracted = math.prod(lhs[int(i)] for i in contracting.group(1).split(",") if i) if contracting else 1
    else:
        kernel = array_dims(operands[1].shape)
        labels = re.search(r"dim_labels=\w+_(\w+)->", inst.attributes)
        contracted = math.prod(kernel) / kernel[labels.group(1).index("o")] if labels else math.prod(kernel)
    return 2.0 * shape_elements(inst.shape) * contracted


class _Walker:
    def __init__(self, text: str, layout: MeshLayout):
        self.computations, self.entry, partitions = parse_module(text)
        self.layout = layout
        self.partitions = partitions or len(layout.coordinates)
        self.unknown_loops: list[dict] = []
        self.unknown_flops_loops: list[dict] = []  # dots counted once: dot_flops is then a lower bound
        self.slices = SliceCheck(self.computations)

    def walk(self, name: str, executions: int, unknown: bool, phases: frozenset = frozenset()
             ) -> tuple[list[Collective], float]:
        """The collectives of computation `name` and what it calls, and their dot/convolution
        FLOPs, each executed `executions` times. `phases`: the schedule phases (_PHASE) whose
        share of the iterations is counted already (a conditional nested in one carries its name too)."""
        comp, found, flops = self.computations[name], [], 0.0
        for inst in comp.instructions.values():
            base = inst.opcode.removesuffix("-done")
            if base in COLLECTIVES:
                started = comp.instructions.get(inst.operands[0]) if inst.opcode.endswith("-done") else inst
                found += self.count(comp, inst, started or inst, base, executions, unknown)
            elif inst.opcode in ("dot", "convolution"):
                flops += executions * matmul_flops(comp, inst)
            if inst.opcode == "while":
                callees = dict(inst.callees())
                trip = _TRIP_COUNT.search(inst.attributes)
                n = int(trip.group(1)) if trip else 1
                inside, inside_flops = self.walk(callees["body"], executions * n, unknown or trip is None, phases)
                cond, cond_flops = self.walk(callees["condition"], executions * (n + 1 if trip else 1),
                                             unknown or trip is None, phases)
                inside += cond
                # Flagged only if it holds a collective (or, apart, a matmul): a loop of other compute
                # changes no count (context parallelism's blockwise loops, whose bounds depend on the shard).
                loop = {"while": inst.name, "computation": name, "body": callees["body"]}
                if trip is None and inside:
                    self.unknown_loops.append(loop)
                if trip is None and inside_flops:
                    self.unknown_flops_loops.append(loop)
                found, flops = found + inside, flops + inside_flops + cond_flops
            elif inst.opcode == "conditional":  # one branch runs: each count takes its largest branch
                runs, inner = executions, phases
                phase = _PHASE.search(inst.attributes)
                if phase and phase.group(0) not in phases:
                    k, n = int(phase.group(1)), int(phase.group(2))
                    if executions * k % n == 0:  # the conditional is in that loop's body
                        runs, inner = executions * k // n, phases | {phase.group(0)}
                branches = [self.walk(c, runs, unknown, inner) for _, c in inst.callees()]
                found += max((b for b, _ in branches), key=lambda b: sum(c.bytes_per_step for c in b), default=[])
                flops += max((f for _, f in branches), default=0.0)
            elif inst.opcode not in ("async-done", "async-update"):  # async-start's callee counts once
                for role, callee in inst.callees():
                    if role != "to_apply" or inst.opcode == "call":  # reducers hold no collectives
                        inside, inside_flops = self.walk(callee, executions, unknown, phases)
                        found, flops = found + inside, flops + inside_flops
        return found, flops

    def count(self, comp: Computation, inst: Instruction, started: Instruction, kind: str,
              executions: int, unknown: bool) -> list[Collective]:
        arrays = shape_arrays(inst.shape)
        if kind == "collective-permute":
            pairs = [(s, t) for s, t in source_target_pairs(started.attributes) if s != t]
            sends = max(Counter(s for s, _ in pairs).values(), default=0)  # the busiest sender
            spans = [self.layout.axes_of(pair) for pair in pairs]  # each pair: the axes it crosses
            axes = tuple(sorted({a for s, _ in spans for a in s}, key=self.layout.axis_names.index))
            dcn = any(d for _, d in spans)
            return [Collective(kind, started.opcode, inst.name, comp.name, axes, dcn, 2, dt,
                               b * sends, executions, in_unknown_loop=unknown) for dt, b in arrays]
        groups = replica_groups(started.attributes, self.partitions)
        n = max(len(g) for g in groups)
        spans = [self.layout.axes_of(g) for g in groups if len(g) > 1]
        axes = tuple(sorted({a for s, _ in spans for a in s}, key=self.layout.axis_names.index))
        dcn = any(d for _, d in spans)
        if kind == "ragged-all-to-all":
            buffers = [comp.instructions.get(name) for name in started.operands[:2]]
            dt, size = min((shape_arrays(b.shape)[0] for b in buffers if b is not None),
                           key=lambda a: a[1], default=arrays[0])
            return [Collective(kind, started.opcode, inst.name, comp.name, axes, dcn, n, dt,
                               size * (n - 1) / n, executions, upper_bound=True, in_unknown_loop=unknown)]
        out = []
        for index, (dt, size) in enumerate(arrays):
            element_kind, recounted = kind, False
            if kind == "all-reduce" and n > 1 and self.slices.one_piece_per_device(
                    comp, inst, index if len(arrays) > 1 else None, groups):
                element_kind, recounted = "reduce-scatter", True
            factor = {"all-gather": (n - 1) / n, "all-reduce": 2 * (n - 1) / n,
                      "reduce-scatter": (n - 1) / n, "all-to-all": (n - 1) / n}[element_kind]
            if kind == "reduce-scatter":
                size *= n  # its input: the result is 1/N of it
            out.append(Collective(element_kind, started.opcode, inst.name, comp.name, axes, dcn, n, dt,
                                  size * factor, executions, recounted=recounted, in_unknown_loop=unknown))
        return out


def account(text: str, layout: MeshLayout) -> dict:
    """Every collective of an HLO module, and their totals per kind, per axis and per link."""
    walker = _Walker(text, layout)
    collectives, flops = walker.walk(walker.entry, 1, False)
    by_kind, by_link = defaultdict(lambda: {"count": 0, "tensors": 0, "bytes": 0.0}), defaultdict(float)
    for c in collectives:
        key = (c.kind, ",".join(c.axes) or "-", "DCN" if c.dcn else "ICI")
        row = by_kind[key]
        row["tensors"] += c.executions
        row["bytes"] += c.bytes_per_step
        by_link[key[2]] += c.bytes_per_step
    # an op (not a tuple element) per instruction and execution
    seen = set()
    for c in collectives:
        key = (c.kind, ",".join(c.axes) or "-", "DCN" if c.dcn else "ICI")
        if (key, c.computation, c.name) not in seen:
            seen.add((key, c.computation, c.name))
            by_kind[key]["count"] += c.executions
    rows = [{"kind": k, "axes": a, "link": link, **v} for (k, a, link), v in sorted(by_kind.items())]
    return {
        "rows": rows,
        "total_bytes": sum(c.bytes_per_step for c in collectives),
        "bytes_by_link": dict(by_link),
        "recounted_as_reduce_scatter": sum(c.executions for c in collectives if c.recounted),
        "ragged_upper_bound": any(c.upper_bound for c in collectives),
        "unknown_trip_count_loops": walker.unknown_loops,
        "dot_flops": flops,
        "unknown_trip_count_dot_loops": walker.unknown_flops_loops,
        "collectives": [dataclasses.asdict(c) | {"bytes_per_step": c.bytes_per_step} for c in collectives],
    }


# ----------------------------------------------------------------------------------------------
# Link bandwidths and the report

# Target -> (intra-node link, GB/s per GPU per direction; inter-node NIC, GB/s per GPU per direction).
# Vendors quote intra-node figures as the aggregate of both directions; a ring sends one way, so
# the figures here are half of those (unidirectional). NICs: one 400 Gb/s NIC per GPU, the
# reference platform of every target (400 Gb/s = 50 GB/s each way).
#   mi300x: AMD Instinct MI300X data sheet: 7 Infinity Fabric links, 128 GB/s each bidirectional,
#           896 GB/s aggregate -> 448; the MI300X platform pairs each GPU with a 400G NIC.
#   mi325x: AMD Instinct MI325X data sheet: the same 7 x 128 GB/s (896 aggregate) -> 448; 400G NIC.
#   mi355x, mi350x: AMD Instinct MI350 series data sheets: 7 links, 153.6 GB/s each bidirectional,
#           1075.2 GB/s aggregate -> 537.6; AMD Pensando Pollara 400 NIC (400 Gb/s) per GPU.
#   h100:   NVIDIA H100 SXM data sheet: NVLink 900 GB/s (bidirectional) -> 450; DGX H100: eight
#           ConnectX-7 at 400 Gb/s, one per GPU.
#   h200:   NVIDIA H200 SXM data sheet: NVLink 900 GB/s -> 450; DGX H200: ConnectX-7 400 Gb/s per GPU.
#   b200:   NVIDIA DGX B200 data sheet: fifth-generation NVLink 1.8 TB/s per GPU -> 900; eight
#           ConnectX-7 at 400 Gb/s.
# On the AMD parts the links are point to point (no switch): a single ring uses one link each way
# (64 / 76.8 GB/s); the aggregate is reached only by as many rings as links (RCCL's channels), so
# the time below is a lower bound there.
LINKS = {
    "mi300x": ("xGMI", 448.0, 50.0),
    "mi325x": ("xGMI", 448.0, 50.0),
    "mi355x": ("xGMI", 537.6, 50.0),
    "mi350x": ("xGMI", 537.6, 50.0),
    "h100": ("NVLink", 450.0, 50.0),
    "h200": ("NVLink", 450.0, 50.0),
    "b200": ("NVLink", 900.0, 50.0),
}
MIB = 2 ** 20


def link_seconds(bytes_by_link: dict[str, float], kind: str) -> float:
    """Seconds the bytes take at the target's per-GPU bandwidths, ICI and DCN one after the other."""
    _, intra, inter = LINKS[kind]
    return bytes_by_link.get("ICI", 0.0) / (intra * 1e9) + bytes_by_link.get("DCN", 0.0) / (inter * 1e9)


def report(hlo_text: str, layout: MeshLayout, model_cfg, train_cfg, policy: str, kind: str,
           microbatches: int = 1, measured: dict | None = None, pipeline: dict | None = None) -> dict:
    """The measured collectives of a compiled train step beside the layout's analytic minimum
    (`microbatches` and `pipeline` (comm_minimum.pipeline_options): a pipeline's, under mesh
    stage > 1; `measured`: account()'s result if at hand)."""
    measured = dict(measured or account(hlo_text, layout))
    sizes = dict(zip(layout.axis_names, (i * d for i, d in zip(layout.ici_sizes, layout.dcn_sizes))))
    least = comm_minimum.minimum(model_cfg, train_cfg, policy, sizes, microbatches=microbatches, **(pipeline or {}))
    least_by_link = {"ICI": 0.0, "DCN": 0.0}
    for term in least["terms"]:
        axes = [a for a in term["axes"].split(",") if a in layout.axis_names]
        dcn = any(layout.dcn_sizes[layout.axis_names.index(a)] > 1 for a in axes)
        least_by_link["DCN" if dcn else "ICI"] += term["cpu_bytes"]
    measured.pop("collectives")
    by_axes = defaultdict(lambda: {"measured_bytes": 0.0, "minimum_bytes": 0.0})
    for row in measured["rows"]:
        by_axes[row["axes"]]["measured_bytes"] += row["bytes"]
    for term in least["terms"]:
        by_axes[term["axes"]]["minimum_bytes"] += term["cpu_bytes"]
    stages = None
    if sizes.get("stage", 1) > 1:  # between stages: the activations' permutes apart from the rest
        on_stage = [row for row in measured["rows"] if "stage" in row["axes"].split(",")]
        stages = {"permute_bytes": sum(r["bytes"] for r in on_stage if r["kind"] == "collective-permute"),
                  "other_bytes": sum(r["bytes"] for r in on_stage if r["kind"] != "collective-permute"),
                  "link": "DCN" if any(r["link"] == "DCN" for r in on_stage) else "ICI",
                  "minimum_bytes": sum(t["cpu_bytes"] for t in least["terms"] if t["axes"] == "stage")}
    return {**measured, "by_axes": dict(sorted(by_axes.items())), "minimum": least, "stages": stages,
            "ratio": ratio(measured["total_bytes"], least["cpu_bytes"]), "target": kind, "link": LINKS[kind],
            "measured_seconds": link_seconds(measured["bytes_by_link"], kind),
            "minimum_seconds": link_seconds(least_by_link, kind), "policy": policy}


def ratio(measured_bytes: float, minimum_bytes: float) -> float | None:
    """Measured over minimum; None where the layout needs no communication at all (one device, or no
    axis over 1): there is nothing to hold the program to but zero, which describe_ratio reports."""
    return measured_bytes / minimum_bytes if minimum_bytes else None


def describe_ratio(r: dict) -> str:
    """The measured bytes against the minimum, in words: "x1.02 its minimum", or what a layout that
    needs no communication (one device) moved."""
    if r["ratio"] is not None:
        return f"x{r['ratio']:.2f} its minimum"
    if not r["total_bytes"]:
        return "none (one device has nothing to exchange)"
    return f"{r['total_bytes'] / MIB:.2f} MiB where the layout needs none"


def format_report(r: dict) -> str:
    name, intra, inter = r["link"]
    lines = ["communication per device per step (optimized HLO, every collective x its loops' trip "
             "counts; ring algorithm: bytes leaving one device)",
             f"  {'kind':<20}{'mesh axes':<22}{'link':<6}{'count':>7}{'tensors':>9}{'bytes/device':>16}"]
    for row in r["rows"]:
        lines.append(f"  {row['kind']:<20}{row['axes']:<22}{row['link']:<6}{row['count']:>7}"
                     f"{row['tensors']:>9}{row['bytes'] / MIB:>12.2f} MiB")
    links = "".join(f", {link} {b / MIB:.2f} MiB" for link, b in sorted(r["bytes_by_link"].items()))
    lines.append(f"  {'total':<55}{r['total_bytes'] / MIB:>12.2f} MiB  ({links[2:] or 'none'})")
    if r["recounted_as_reduce_scatter"]:
        lines.append(f"  ({r['recounted_as_reduce_scatter']} all-reduces whose result is only sliced to 1/N are "
                     "counted as the reduce-scatters a GPU compiler makes of them: XLA:CPU has no "
                     "reduce-scatter pass)")
    if r["ragged_upper_bound"]:
        lines.append("  (ragged all-to-alls count their whole send buffer: an upper bound)")
    least = r["minimum"]
    lines.append(f"analytic minimum ({r['policy']}; in the dtypes the CPU program shows: XLA:CPU's float "
                 "normalization makes bf16 collectives f32)")
    for t in least["terms"]:
        lines.append(f"  {t['term']:<26}{t['axes']:<22}{t['cpu_bytes'] / MIB:>10.2f} MiB   {t['formula']}")
    lines.append(f"  {'minimum':<48}{least['cpu_bytes'] / MIB:>10.2f} MiB   (GPU dtypes: "
                 f"{least['gpu_bytes'] / MIB:.2f} MiB)")
    by_axes = ", ".join(f"{axes} {v['measured_bytes'] / MIB:.2f} / {v['minimum_bytes'] / MIB:.2f} MiB"
                        for axes, v in r["by_axes"].items())
    lines.append(f"measured / minimum = {r['ratio']:.2f}; by mesh axes: {by_axes}" if r["ratio"] is not None
                 else f"measured communication: {describe_ratio(r)}")
    if r.get("stages"):
        st = r["stages"]
        lines.append(f"between stages ({st['link']}): {(st['permute_bytes'] + st['other_bytes']) / MIB:.2f} MiB over "
                     f"`stage` against a minimum of {st['minimum_bytes'] / MIB:.2f} MiB (each microbatch's activations "
                     "forward and cotangents back, once per pass round the stages; the loop's idle iterations also "
                     f"move the bubble's): collective-permutes {st['permute_bytes'] / MIB:.2f} MiB, other collectives "
                     f"{st['other_bytes'] / MIB:.2f} MiB (once a step, for what is replicated over `stage`: the "
                     "final outputs to every stage where the head runs on every stage (all but 1f1b), a tied "
                     "table's gradient summed over the stages' lookups, the final norm's scale's gradient; an "
                     "untied table is stored on the first stage, and under 1f1b the untied head on the last)")
    lines.append(f"time at {r['target']} link bandwidth ({name} {intra:g} GB/s, NIC {inter:g} GB/s per GPU "
                 f"per direction): measured {r['measured_seconds'] * 1e3:.3f} ms, minimum "
                 f"{r['minimum_seconds'] * 1e3:.3f} ms per step (bytes / bandwidth, no overlap, no latency)")
    if r["unknown_trip_count_loops"]:
        lines.append(f"FLAGGED: {len(r['unknown_trip_count_loops'])} while loop(s) without a known trip count; "
                     "their collectives are counted once, so the total is a LOWER bound:")
        lines += [f"  {loop['while']} in {loop['computation']} (body {loop['body']})"
                  for loop in r["unknown_trip_count_loops"]]
    return "\n".join(lines)
