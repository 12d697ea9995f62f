"""Whether an all-reduce in XLA:CPU's program is a reduce-scatter in disguise (for comm.py).

XLA:CPU has no reduce-scatter pass: a gradient reduce-scatter appears as an all-reduce whose result
each device then slices to its own 1/N. A GPU compiler makes that a reduce-scatter, which moves
half an all-reduce's bytes. But an all-reduce whose result is used whole, through N slices of 1/N
(a pipeline loop taking one piece per iteration, or static slices that every device takes alike),
is an all-reduce on any compiler. So the all-reduce counts as a reduce-scatter only when:

- every use of its result (through bitcasts, copies, reshapes, transposes, converts and into
  fusions) is a dynamic-slice to 1/N of it, and
- each slice's start indices are a function of the device alone: constants, partition-id,
  replica-id and arithmetic on them (XLA's SPMD partitioner writes them as a table of offsets
  indexed by partition-id). They are evaluated for every device of every group: each device
  takes one piece (all its slices start at the same place), and the N devices of a group take N
  different aligned pieces.

A start index that reads anything else (a loop counter, a parameter, data) fails the check, and
so does a static `slice` (every device takes the same piece).
"""

from __future__ import annotations

import math
import re

import numpy as np

from maxtext_rocm.planner.hlo_text import Computation, Instruction, array_dims, shape_elements, tuple_element

# Ops that pass a value's elements through to a later slice; convert because XLA:CPU's float
# normalization brackets a bf16 all-reduce with converts to f32 and back.
PASS_THROUGH = ("bitcast", "copy", "reshape", "transpose", "convert")
_BINARY = {"add": np.add, "subtract": np.subtract, "multiply": np.multiply, "maximum": np.maximum,
           "minimum": np.minimum, "and": np.bitwise_and, "or": np.bitwise_or, "xor": np.bitwise_xor,
           "divide": lambda a, b: np.fix(a / b).astype(np.int64), "remainder": np.fmod}
_COMPARE = {"EQ": np.equal, "NE": np.not_equal, "LT": np.less, "LE": np.less_equal, "GT": np.greater,
            "GE": np.greater_equal}
_MAX_DEPTH = 64


class _NotOfTheDevice(Exception):
    """A start index that depends on something other than the device (or an op not evaluated)."""


class SliceCheck:
    """The check above over one parsed module (hlo_text.parse_module's computations)."""

    def __init__(self, computations: dict[str, Computation]):
        self.computations = computations
        self.while_of_body = {callee: (comp, inst) for comp in computations.values()
                              for inst in comp.instructions.values() if inst.opcode == "while"
                              for role, callee in inst.callees() if role == "body"}

    def one_piece_per_device(self, comp: Computation, inst: Instruction, index: int | None,
                             groups: list[list[int]]) -> bool:
        """Whether the all-reduce `inst` (its tuple element `index`, or None for an array result) is
        used only through each device's own 1/N, N the size of its `groups`."""
        n = max(len(g) for g in groups)
        values = [inst.name]
        if index is not None:  # a combined all-reduce: its uses are get-tuple-elements, one per element
            users = [u for u, _ in comp.users[inst.name]]
            if any(u.opcode != "get-tuple-element" for u in users):
                return False
            values = [u.name for u in users if re.search(rf"\bindex={index}\b", u.attributes)]
        whole = inst.shape if index is None else tuple_element(inst.shape, index)
        slices: list = []
        part = shape_elements(whole) / n
        if not values or not all(self._slices(comp, v, part, 0, (), slices) for v in values):
            return False
        try:
            for group in groups:
                pieces = []
                for device in group:
                    starts = {self._starts(c, ds, callers, device) for c, ds, callers in slices}
                    if len(starts) != 1:  # this device reads more than one piece
                        return False
                    pieces.append(starts.pop())
                if len(set(pieces)) != len(group):  # two devices share a piece: some piece is unused
                    return False
                # Distinct starts are disjoint pieces only if they fall on the pieces' grid.
                sizes = _slice_sizes(slices[0][1])
                if any(start % size for piece in pieces for start, size in zip(piece, sizes)):
                    return False
        except _NotOfTheDevice:
            return False
        return True

    def _slices(self, comp: Computation, value: str, part: float, depth: int, callers, found: list) -> bool:
        """Whether every use of `value` ends in a dynamic-slice to `part` elements (appended to
        `found` with its computation and the (computation, fusion) chain its parameters come from)."""
        users = comp.users.get(value, [])
        if not users and value == comp.root and callers:  # a fusion's result: follow its users outside
            (outer, fusion), *rest = callers
            return self._slices(outer, fusion.name, part, depth + 1, tuple(rest), found)
        if not users or depth > 12:
            return False
        for user, position in users:
            if user.opcode == "dynamic-slice":
                if position != 0 or shape_elements(user.shape) != part:
                    return False
                found.append((comp, user, callers))
            elif user.opcode in PASS_THROUGH:
                if not self._slices(comp, user.name, part, depth + 1, callers, found):
                    return False
            elif user.opcode == "fusion":
                callee = self.computations[dict(user.callees())["calls"]]
                if not self._slices(callee, callee.parameters[position], part, depth + 1,
                                    ((comp, user), *callers), found):
                    return False
            else:  # a static slice (the same piece on every device), or any other use of the whole
                return False
        return True

    def _starts(self, comp: Computation, ds: Instruction, callers, device: int) -> tuple[int, ...]:
        """The start indices a dynamic-slice takes on `device`, clamped as XLA clamps them."""
        dims, sizes = array_dims(comp.instructions[ds.operands[0]].shape), _slice_sizes(ds)
        starts = [int(self._value(comp, name, callers, device, 0)) for name in ds.operands[1:]]
        return tuple(min(max(s, 0), d - k) for s, d, k in zip(starts, dims, sizes))

    def _value(self, comp: Computation, name: str, callers, device: int, depth: int) -> np.ndarray:
        """The value of `name` on `device`, if it depends on nothing but the device."""
        inst = comp.instructions.get(name)
        if inst is None or depth > _MAX_DEPTH:
            raise _NotOfTheDevice(name)
        op, args = inst.opcode, inst.operands

        def arg(i):
            return self._value(comp, args[i], callers, device, depth + 1)

        if op in ("partition-id", "replica-id"):  # one replica: SPMD programs are partitioned
            return np.array(device if op == "partition-id" else 0, np.int64)
        if op == "constant":
            if inst.shape.startswith(("f", "bf", "c")):  # offsets are integers
                raise _NotOfTheDevice(name)
            numbers = [int(x) for x in re.findall(r"-?\d+", " ".join(args))]
            if inst.shape.startswith("pred"):
                numbers = [w == "true" for w in re.findall(r"true|false", " ".join(args))]
            dims = array_dims(inst.shape)
            if len(numbers) != math.prod(dims):
                raise _NotOfTheDevice(name)  # a literal not read here
            return np.array(numbers, np.int64).reshape(dims)
        if op == "parameter" and callers:  # a fused computation's parameter: the fusion's operand
            (outer, fusion), *rest = callers
            return self._value(outer, fusion.operands[int(args[0])], tuple(rest), device, depth + 1)
        if op == "fusion":  # its fused computation's root, whose parameters are the fusion's operands
            callee = self.computations[dict(inst.callees())["calls"]]
            return self._value(callee, callee.root, ((comp, inst), *callers), device, depth + 1)
        if op == "get-tuple-element":
            index = int(re.search(r"\bindex=(\d+)", inst.attributes).group(1))
            source = comp.instructions.get(args[0])
            if source is not None and source.opcode == "fusion":  # a multi-output fusion's element
                callee = self.computations[dict(source.callees())["calls"]]
                comp, callers, source = callee, ((comp, source), *callers), callee.instructions[callee.root]
            if source is not None and source.opcode == "tuple":
                return self._value(comp, source.operands[index], callers, device, depth + 1)
            if source is not None and source.opcode == "parameter" and comp.name in self.while_of_body:
                return self._loop_invariant(comp, index, device, depth)
            raise _NotOfTheDevice(name)
        if op in ("convert", "bitcast", "reshape", "copy"):
            return np.reshape(arg(0), array_dims(inst.shape))
        if op == "broadcast" and np.ndim(arg(0)) == 0:
            return np.broadcast_to(arg(0), array_dims(inst.shape))
        if op in _BINARY:
            return _BINARY[op](arg(0), arg(1))
        if op == "negate":
            return -arg(0)
        if op == "compare":
            return _COMPARE[re.search(r"direction=(\w+)", inst.attributes).group(1)](arg(0), arg(1))
        if op in ("clamp", "select"):
            a, b, c = arg(0), arg(1), arg(2)
            return np.clip(b, a, c) if op == "clamp" else np.where(a, b, c)
        if op == "dynamic-slice":
            whole = arg(0)
            sizes = _slice_sizes(inst)
            starts = [min(max(int(arg(i)), 0), d - k) for i, d, k in zip(range(1, len(args)), whole.shape, sizes)]
            return whole[tuple(slice(s, s + k) for s, k in zip(starts, sizes))]
        if op == "slice":
            bounds = [tuple(int(x) for x in b.split(":")) for b in re.findall(r"\[([\d:]+)\]", inst.attributes)]
            return arg(0)[tuple(slice(*b) for b in bounds)]
        raise _NotOfTheDevice(name)

    def _loop_invariant(self, body: Computation, index: int, device: int, depth: int) -> np.ndarray:
        """Element `index` of a while body's parameter, if the loop passes it through unchanged
        (an offset the loop-invariant code motion hoisted): its initial value, outside the loop."""
        root = body.instructions[body.root]
        passed = body.instructions.get(root.operands[index]) if root.opcode == "tuple" else None
        if (passed is None or passed.opcode != "get-tuple-element"
                or body.instructions[passed.operands[0]].opcode != "parameter"
                or int(re.search(r"\bindex=(\d+)", passed.attributes).group(1)) != index):
            raise _NotOfTheDevice(f"{body.name} element {index} changes in the loop")
        outer, loop = self.while_of_body[body.name]
        init = outer.instructions.get(loop.operands[0])
        if init is None or init.opcode != "tuple":
            raise _NotOfTheDevice(f"{loop.name}'s initial value")
        return self._value(outer, init.operands[index], (), device, depth + 1)


def _slice_sizes(ds: Instruction) -> list[int]:
    return [int(x) for x in re.search(r"dynamic_slice_sizes=\{([\d,]*)\}", ds.attributes).group(1).split(",") if x]
