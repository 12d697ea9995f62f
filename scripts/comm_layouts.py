"""Bytes per device per step of each parallel layout against its analytic minimum (issue 21's table).

    python scripts/comm_layouts.py [--target=h100:8] [--layouts MoE] [--json OUT]

Each layout is compiled by `python -m maxtext_rocm.compile ... --comm` in its own process (XLA reads
its flags once per process) on 8 fake CPU devices, at the issue's dimensions: d_model 256, 4
layers, 4 heads (4 kv heads), head_dim 64, mlp 1024 (MoE: 8 experts, top 2, mlp 512), vocab 32000,
8 x 256 tokens, fp32, scanned, remat full. Beside the report's figure, an INDEPENDENT count of
the same program from XLA's own dump (`--xla_dump_to=DIR --xla_dump_hlo_as_text`, the
*after_optimizations* file), by a deliberately separate line-based parser below, so that a
mistake in maxtext_rocm/planner/comm.py shows as a disagreement. Where comm.py evaluates a sliced
all-reduce's offsets per device (hlo_slices.py), this count asks only that each slice's start
depend on the partition id and constants alone.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
import subprocess
import sys
import tempfile
from collections import defaultdict

DIMS = ["--config.model.vocab_size=32000", "--config.model.d_model=256", "--config.model.n_layers=4",
        "--config.model.n_heads=4", "--config.model.n_kv_heads=4", "--config.model.head_dim=64",
        "--config.model.scan_layers=true", "--config.model.remat=full", "--config.precision.policy=fp32",
        "--config.data.source=synthetic", "--config.train.per_device_batch_size=1", "--config.train.seq_len=256"]
DENSE = ["configs/tiny_llama.py", "--config.model.mlp_dim=1024"]
MOE = ["configs/tiny_mixtral.py", "--config.model.mlp_dim=512", "--config.model.n_experts=8",
       "--config.model.experts_per_token=2"]


def mesh(**axes: int) -> list[str]:
    sizes = {"stage": 1, "data": 1, "fsdp": 1, "expert": 1, "sequence": 1, "tensor": 1, **axes}
    return [f"--config.mesh.ici.{a}={n}" for a, n in sizes.items()]


LAYOUTS = {
    "fsdp=8": DENSE + mesh(fsdp=8),
    "fsdp=4 x tensor=2": DENSE + mesh(fsdp=4, tensor=2),
    "fsdp=4 x sequence=2": DENSE + mesh(fsdp=4, sequence=2),
    "data=2 x fsdp=4": DENSE + mesh(data=2, fsdp=4),
    "data=8": DENSE + mesh(data=8),
    "fsdp=2 x tensor=4": DENSE + mesh(fsdp=2, tensor=4),
    "data=2 x fsdp=2 x tensor=2": DENSE + mesh(data=2, fsdp=2, tensor=2),
    "fsdp=2 x sequence=2 x tensor=2": DENSE + mesh(fsdp=2, sequence=2, tensor=2),
    "sequence=8, ring": DENSE + mesh(sequence=8) + ["--config.model.context_parallel=ring"],
    "sequence=8, all-gather": DENSE + mesh(sequence=8) + ["--config.model.context_parallel=all_gather"],
    # GPipe, 2 microbatches: the stage boundary's permutes, and the loop's bubble iterations
    "stage=2 x fsdp=4": DENSE + mesh(stage=2, fsdp=4),
    # Circular, 2 repeats (a chunk of one layer per device each time round), 2 microbatches
    "stage=2 x fsdp=4, circular R=2": DENSE + mesh(stage=2, fsdp=4) + [
        "--config.pipeline.schedule=circular", "--config.pipeline.repeats=2"],
    # GPipe's order with the backward written by hand (parallel/pipeline/gpipe_recompute.py)
    "stage=2 x fsdp=4, gpipe_recompute": DENSE + mesh(stage=2, fsdp=4) + ["--config.pipeline.schedule=gpipe_recompute"],
    # The stage's weights gathered and their gradient reduce-scattered once a step
    # (parallel/pipeline/gather.py), 16 microbatches: the bubble's share of the permutes is 1/16
    "stage=2 x fsdp=4, once, M=16": DENSE + mesh(stage=2, fsdp=4) + [
        "--config.pipeline.weight_gather=once", "--config.pipeline.gradient_reduce=once",
        "--config.pipeline.microbatches=16", "--config.train.per_device_batch_size=8"],
    # 1f1b (parallel/pipeline/one_f_one_b.py), the weights gathered once, 16 microbatches: the head and
    # loss on the last stage alone, the table stored on the first stage and the head on the last
    "stage=2 x fsdp=4, 1f1b, once, M=16": DENSE + mesh(stage=2, fsdp=4) + [
        "--config.pipeline.schedule=1f1b", "--config.pipeline.weight_gather=once",
        "--config.pipeline.microbatches=16", "--config.train.per_device_batch_size=8"],
    # Interleaved 1F1B (parallel/pipeline/one_f_one_b_order.py), 2 chunks per device: each microbatch
    # crosses the stage boundaries twice as often, forward and back; weights gathered once, and
    # per iteration (a chunk, half the stage's weights, each time)
    "stage=2 x fsdp=4, interleaved 1f1b, once, M=16": DENSE + mesh(stage=2, fsdp=4) + [
        "--config.pipeline.schedule=1f1b", "--config.pipeline.repeats=2", "--config.pipeline.weight_gather=once",
        "--config.pipeline.microbatches=16", "--config.train.per_device_batch_size=8"],
    "stage=2 x fsdp=4, interleaved 1f1b, M=16": DENSE + mesh(stage=2, fsdp=4) + [
        "--config.pipeline.schedule=1f1b", "--config.pipeline.repeats=2",
        "--config.pipeline.microbatches=16", "--config.train.per_device_batch_size=8"],
    "MoE expert=8, dropless": MOE + mesh(expert=8) + ["--config.model.moe_impl=dropless"],
    "MoE expert=8, capacity 1.25": MOE + mesh(expert=8) + ["--config.model.moe_impl=capacity",
                                                          "--config.model.moe_capacity_factor=1.25"],
    "MoE expert=4 x fsdp=2, dropless": MOE + mesh(expert=4, fsdp=2) + ["--config.model.moe_impl=dropless"],
}


# ----------------------------------------------------------------------------------------------
# The independent count: line by line, totals only.

_KINDS = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "collective-permute", "ragged-all-to-all")
_OP = re.compile(r"^\s*(?:ROOT )?%(\S+) = (.*?) ([a-z\-]+)\((.*?)\)(, .*)?$")
_ARRAY = re.compile(r"\b(pred|[su](?:8|16|32|64)|bf16|f16|f32|f64|f8\w*)\[([\d,]*)\]")
_WIDTH = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "bf16": 2, "f16": 2, "s32": 4, "u32": 4,
          "f32": 4, "s64": 8, "u64": 8, "f64": 8}


def _arrays(shape: str) -> list[float]:
    out = []
    for dtype, dims in _ARRAY.findall(shape):
        n = 1
        for x in filter(None, dims.split(",")):
            n *= int(x)
        out.append(n * _WIDTH.get(dtype, 1))
    return out


def _elements(shape) -> int:
    """Elements of a shape's text, or of one (dtype, dims) match."""
    n_total = 0
    for _, dims in ([shape] if isinstance(shape, tuple) else _ARRAY.findall(shape)):
        n = 1
        for x in filter(None, dims.split(",")):
            n *= int(x)
        n_total += n
    return n_total


def _group_size(attrs: str, partitions: int) -> int:
    if "replica_groups=mesh[" in attrs:
        sizes = dict(re.findall(r"'([^']+)'=(\d+)", attrs.split("replica_groups=mesh[")[1].split("]")[0]))
        listed = re.search(r"\] ?(?:, device_ids=\(.*?\)\))? ?\{([^}]*)\}", attrs.split("replica_groups=mesh[")[1])
        n = 1
        for item in filter(None, (i.strip() for i in listed.group(1).split(","))):
            sub = re.search(r":\(\d+\)(\d+)", item)
            n *= int(sub.group(1)) if sub else int(sizes[item.strip("'")])
        return n
    iota = re.search(r"replica_groups=\[\d+,(\d+)\]<=", attrs)
    if iota:
        return int(iota.group(1))
    first = re.search(r"replica_groups=\{\{([\d,]*)\}", attrs)
    return len(first.group(1).split(",")) if first else partitions


def dump_total(text: str) -> dict:
    partitions = int(re.search(r"num_partitions=(\d+)", text).group(1))
    comps, roots, entry, name = defaultdict(list), {}, None, None
    for line in text.splitlines():
        head = re.match(r"^(ENTRY )?%(\S+) .*\{$", line)
        if head:
            name = head.group(2)
            entry = name if head.group(1) else entry
        elif line.startswith("}"):
            name = None
        elif name:
            op = _OP.match(re.sub(r"/\*.*?\*/", "", line))
            if op:
                comps[name].append(op.groups())
                if line.lstrip().startswith("ROOT "):
                    roots[name] = op.group(1)

    def uses(comp, value):
        return [(o, [x.strip().lstrip("%") for x in o[3].split(",")].index(value))
                for o in comps[comp] if value in [x.strip().lstrip("%") for x in o[3].split(",")]]

    def operand_names(o):
        return [x.strip().lstrip("%") for x in o[3].split(",")]

    def tuple_element(comp, value):
        """(tuple, index) where `value` is an element of a tuple: a get-tuple-element, or newer XLA's
        operand shorthand `%tuple#index` (jax 0.12); None otherwise."""
        if "#" in value:
            base, index = value.rsplit("#", 1)
            return base, int(index)
        o = next((x for x in comps[comp] if x[0] == value), None)
        if o is not None and o[2] == "get-tuple-element":
            return operand_names(o)[0], int(re.search(r"index=(\d+)", o[4]).group(1))
        return None

    def elements_of(comp, out, count):
        """The names by which `out`'s tuple elements are used: its get-tuple-elements (or the
        `%out#i` shorthand where it has none)."""
        named = [[o[0] for o in comps[comp] if o[2] == "get-tuple-element" and o[3].strip() == f"%{out}"
                  and re.search(rf"\bindex={i}\b", o[4] or "")] for i in range(count)]
        return [names or [f"{out}#{i}"] for i, names in enumerate(named)]

    def of_the_device(comp, value, callers=(), depth=0):
        """'device' if `value` is computed from partition-id (or replica-id) and constants alone,
        'constant' if from constants alone, None otherwise (a loop counter, a parameter, data)."""
        if depth > 64:
            return None
        element = tuple_element(comp, value)
        if element is not None:
            base, index = element
            source = next(x for x in comps[comp] if x[0] == base)
            if source[2] == "tuple":
                return of_the_device(comp, operand_names(source)[index], callers, depth + 1)
            loops = [(c, x) for c in comps for x in comps[c] if x[2] == "while" and f"body=%{comp}" in (x[4] or "")]
            root = next(x for x in comps[comp] if x[0] == roots[comp])
            kept = tuple_element(comp, operand_names(root)[index]) if root[2] == "tuple" else None
            if source[2] != "parameter" or len(loops) != 1 or kept != (source[0], index):
                return None  # not a value the loop passes through unchanged
            outer, loop = loops[0]
            init = next(x for x in comps[outer] if x[0] == operand_names(loop)[0])
            return of_the_device(outer, operand_names(init)[index], (), depth + 1) if init[2] == "tuple" else None
        o = next((x for x in comps[comp] if x[0] == value), None)
        if o is None:
            return None
        if o[2] in ("partition-id", "replica-id"):
            return "device"
        if o[2] == "constant":
            return "constant"
        if o[2] == "parameter":
            if not callers:
                return None
            (outer, fusion), *rest = callers
            caller = next(x for x in comps[outer] if x[0] == fusion)
            return of_the_device(outer, operand_names(caller)[int(o[3])], tuple(rest), depth + 1)
        if o[2] == "fusion":
            callee = re.search(r"calls=%(\S+?)[,\s]", o[4] + " ").group(1)
            return of_the_device(callee, roots[callee], ((comp, o[0]), *callers), depth + 1)
        kinds = {of_the_device(comp, name, callers, depth + 1) for name in operand_names(o) if name}
        return None if None in kinds or not kinds else "device" if "device" in kinds else "constant"

    def only_sliced(comp, value, part, depth=0, callers=()):
        """Every use of `value` (elements) ends in a dynamic-slice to `part` elements whose start
        depends on the device (each device its own piece); a fusion's root continues at the
        fusion's users in its caller."""
        found = uses(comp, value)
        if not found and callers and roots.get(comp) == value:
            (outer, fusion), *rest = callers
            return only_sliced(outer, fusion, part, depth + 1, tuple(rest))
        for o, k in found:
            if o[2] == "dynamic-slice" and k == 0 and _elements(o[1]) == part:
                starts = {of_the_device(comp, name, callers) for name in operand_names(o)[1:]}
                if "device" in starts and None not in starts:
                    continue
                return False
            if o[2] in ("bitcast", "copy", "reshape", "transpose", "convert") and only_sliced(
                    comp, o[0], part, depth + 1, callers):
                continue
            if o[2] == "fusion":
                callee = re.search(r"calls=%(\S+?)[,\s]", o[4] + " ").group(1)
                param = next(p[0] for p in comps[callee] if p[2] == "parameter" and p[3] == str(k))
                if only_sliced(callee, param, part, depth + 1, ((comp, o[0]), *callers)):
                    continue
            return False
        return bool(found) and depth < 13

    def total(comp, phases=frozenset()):
        bytes_, recounted = 0.0, 0
        ops = {o[0]: o for o in comps[comp]}
        for out, shape, opcode, operands, attrs in comps[comp]:
            attrs = attrs or ""
            kind = opcode[:-5] if opcode.endswith("-done") else opcode
            if kind in _KINDS:
                source = ops.get(operands.strip().lstrip("%"), (None,) * 4 + (attrs,))[4] if opcode.endswith("-done") else attrs
                sizes = _arrays(shape)
                if kind == "collective-permute":
                    pairs = [tuple(map(int, p)) for p in re.findall(r"\{(\d+),(\d+)\}", source)]
                    senders = [s for s, t in pairs if s != t]
                    bytes_ += sum(sizes) * max((senders.count(s) for s in set(senders)), default=0)
                    continue
                n = _group_size(source, partitions)
                if kind == "ragged-all-to-all":  # the smaller of the input and output buffers
                    buffers = [ops[name.strip().lstrip("%")][1] for name in operands.split(",")[:2]]
                    bytes_ += min(_arrays(b)[0] for b in buffers) * (n - 1) / n
                    continue
                for i, size in enumerate(sizes):
                    element_kind = kind
                    if kind == "all-reduce" and n > 1:
                        values = [out] if len(sizes) == 1 else elements_of(comp, out, len(sizes))[i]
                        elements = _elements(shape) if len(sizes) == 1 else _elements(_ARRAY.findall(shape)[i])
                        if values and all(only_sliced(comp, v, elements / n) for v in values):
                            element_kind, recounted = "reduce-scatter", recounted + 1
                    bytes_ += {"all-gather": (n - 1) / n, "all-reduce": 2 * (n - 1) / n, "all-to-all": (n - 1) / n,
                               "reduce-scatter": (n - 1) if kind == "reduce-scatter" else (n - 1) / n}[element_kind] * size
            trips = re.search(r'"known_trip_count":\{"n":"(\d+)"\}', attrs)
            callees = re.findall(r"\b(calls|body|condition|to_apply|true_computation|false_computation)=%([\w.\-]+)", attrs)
            branches = re.search(r"branch_computations=\{([^}]*)\}", attrs)
            callees += [("branch", c.strip().lstrip("%")) for c in branches.group(1).split(",")] if branches else []
            if opcode == "conditional":  # one branch runs: the one that moves the most
                # in K of the N iterations of the loop around it if it is a schedule phase
                # (pipeline.one_f_one_b_loop.phase_scope: "phase_runs_K_of_N" in its op_name)
                phase = re.search(r"phase_runs_(\d+)_of_(\d+)", attrs)
                share = int(phase.group(1)) / int(phase.group(2)) if phase and phase.group(0) not in phases else 1.0
                inner = phases | {phase.group(0)} if phase else phases
                best = max((total(c, inner) for _, c in callees), default=(0.0, 0))
                bytes_, recounted = bytes_ + share * best[0], recounted + share * best[1]
                continue
            for role, callee in callees:
                if opcode == "while":
                    times = int(trips.group(1)) + (role == "condition") if trips else 1
                elif role == "to_apply" and opcode != "call" or opcode in ("async-done", "async-update"):
                    continue
                else:
                    times = 1
                sub_bytes, sub_recounted = total(callee, phases)
                bytes_ += times * sub_bytes
                recounted += times * sub_recounted
        return bytes_, recounted

    total_bytes, recounted = total(entry)
    return {"bytes": total_bytes, "recounted": recounted}


# ----------------------------------------------------------------------------------------------


def run_layout(name: str, args: list[str], target: str) -> dict:
    with tempfile.TemporaryDirectory(prefix="comm_layouts_") as tmp:
        dump, out = os.path.join(tmp, "dump"), os.path.join(tmp, "report.json")
        env = dict(os.environ, XLA_FLAGS=f"--xla_dump_to={dump} --xla_dump_hlo_as_text")
        command = [sys.executable, "-m", "maxtext_rocm.compile", args[0], f"--target={target}", "--comm",
                   f"--json={out}", *DIMS, *args[1:]]
        done = subprocess.run(command, env=env, capture_output=True, text=True)
        if done.returncode:
            return {"layout": name, "error": (done.stderr.strip().splitlines() or ["failed"])[-1]}
        r = json.load(open(out))["comm"]
        files = glob.glob(os.path.join(dump, "*jit_train_step*after_optimizations.txt"))
        independent = dump_total(open(files[0]).read()) if len(files) == 1 else {"bytes": float("nan"), "recounted": 0}
        return {"layout": name, "measured_bytes": r["total_bytes"], "minimum_bytes": r["minimum"]["cpu_bytes"],
                "ratio": r["ratio"], "dump_bytes": independent["bytes"], "dump_recounted": independent["recounted"],
                "recounted": r["recounted_as_reduce_scatter"], "unknown_loops": len(r["unknown_trip_count_loops"]),
                "by_axes": r["by_axes"], "stage_permute_bytes": (r.get("stages") or {}).get("permute_bytes", 0.0)}


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default="h100:8", help="KIND:8, as python -m maxtext_rocm.compile takes it")
    parser.add_argument("--layouts", help="only layouts whose name contains this (case-insensitive)")
    parser.add_argument("--json", dest="out", help="write the rows here")
    args = parser.parse_args(argv)
    target, out = args.target, args.out
    mib = 2 ** 20
    print(f"{'layout':<34}{'measured MiB':>14}{'minimum MiB':>13}{'ratio':>7}{'dump MiB':>11}"
          f"{'agree':>7}  re-counted / unknown-trip loops")
    rows = []
    for name, layout_args in LAYOUTS.items():
        if args.layouts and args.layouts.lower() not in name.lower():
            continue
        row = run_layout(name, layout_args, target)
        rows.append(row)
        if "error" in row:
            print(f"{name:<34}error: {row['error']}", flush=True)
            continue
        agree = abs(row["dump_bytes"] - row["measured_bytes"]) <= 1e-9 * row["measured_bytes"]
        print(f"{name:<34}{row['measured_bytes'] / mib:>14.2f}{row['minimum_bytes'] / mib:>13.2f}"
              f"{row['ratio']:>7.2f}{row['dump_bytes'] / mib:>11.2f}{'yes' if agree else 'NO':>7}  "
              f"{row['recounted']} / {row['unknown_loops']}" + ("  (lower bound)" if row["unknown_loops"] else ""),
              flush=True)
    if out:
        with open(out, "w") as f:
            json.dump(rows, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
