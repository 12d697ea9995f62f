"""Reading XLA's HLO text: computations, instructions, shapes and the device groups of collectives.

Only what collective accounting needs (maxtext_rocm/planner/comm.py). The forms read are those XLA prints
today: array shapes such as `f32[4,256]{1,0}` and tuples of them; replica groups as explicit lists
`{{0,1},{2,3}}`, iota lists `[2,4]<=[4,2]T(1,0)`, or mesh axes
`mesh['axis_0'=4,'axis_1'=2][, device_ids=(...)] {'axis_0'}` (a group is the devices that differ
only along the listed axes; `'a':(p)s` names the sub-axis of size s after p major ones, as Shardy
does); `source_target_pairs={{0,1},...}`.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections import defaultdict

import numpy as np

_DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4,
                "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16,
                "s4": 0.5, "u4": 0.5, "s2": 0.25, "u2": 0.25, "s1": 0.125, "u1": 0.125}
_ARRAY = re.compile(r"\b([a-z][a-z0-9]*)\[([0-9,<=]*)\]")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?([^\s=]+)\s*=\s*")
_SINGLE_CALLEE = re.compile(r"\b(calls|body|condition|to_apply|true_computation|false_computation)=%?([\w.\-]+)")
_CALLEE_LIST = re.compile(r"\b(branch_computations|called_computations)=\{([^}]*)\}")

def optimized_text(compiled) -> str:
    """A compiled program's optimized HLO as `compiled.as_text()` prints it, but with every
    constant whole: as_text() elides constants of more than a few elements as `{...}`, and from 16
    or so partitions on, the offset tables by which a gradient's all-reduce is sliced to one shard
    per device are such constants, so hlo_slices could not see that the all-reduce is a
    reduce-scatter and counted it at twice the bytes (70B dcn.stage=4 x ici.fsdp=8: 1,570.5 GiB of
    fsdp traffic read instead of 1,180.0). Falls back to as_text() where this jaxlib does not
    expose the print options."""
    try:
        from jaxlib import _hlo
        options = _hlo.HloPrintOptions()
        options.print_large_constants = True
        return "\n".join(module.to_string(options) for module in compiled.runtime_executable().hlo_modules())
    except (ImportError, AttributeError, TypeError):  # a jaxlib without this binding, or another signature
        return compiled.as_text()


# ----------------------------------------------------------------------------------------------
# Instructions and computations


def array_bytes(dtype: str, dims: str) -> float:
    """Bytes of one array shape such as f32[4,256] (token[], tuples: see shape_arrays)."""
    sizes = [int(d.replace("<=", "")) for d in dims.split(",") if d]
    return (element_bytes(dtype) or 0.0) * math.prod(sizes)


def array_dims(shape: str) -> list[int]:
    """The dimensions of an array shape such as f32[4,256]{1,0} (bounded dims <=N: the bound)."""
    return [int(d.replace("<=", "")) for d in _ARRAY.search(shape).group(2).split(",") if d]


def tuple_element(shape: str, index: int) -> str:
    """The index-th array shape of a (tuple) shape, as text."""
    return [m.group(0) for m in _ARRAY.finditer(shape) if element_bytes(m.group(1)) is not None][index]


def shape_elements(shape: str) -> int:
    """Elements of an array shape (of every array of a tuple, together)."""
    return sum(math.prod(int(d.replace("<=", "")) for d in m.group(2).split(",") if d)
               for m in _ARRAY.finditer(shape) if element_bytes(m.group(1)) is not None)


def element_bytes(dtype: str) -> float | None:
    """Bytes of one element; None for what is not data (token, opaque)."""
    return 1 if dtype.startswith("f8") else _DTYPE_BYTES.get(dtype)


def shape_arrays(shape: str) -> list[tuple[str, float]]:
    """(dtype, bytes) of each array in a shape, tuple elements in order."""
    return [(m.group(1), array_bytes(m.group(1), m.group(2))) for m in _ARRAY.finditer(shape)
            if element_bytes(m.group(1)) is not None]


def _matching(text: str, start: int, open_: str, close: str) -> int:
    """Index just past the bracket that closes the one at text[start]."""
    depth = 0
    for i in range(start, len(text)):
        if text[i] == open_:
            depth += 1
        elif text[i] == close:
            depth -= 1
            if depth == 0:
                return i + 1
    raise ValueError(f"unbalanced {open_}{close} in HLO text: {text[start:start + 80]!r}")


@dataclasses.dataclass
class Instruction:
    name: str
    shape: str
    opcode: str
    operands: list[str]
    attributes: str  # everything after the operand list

    def callees(self) -> list[tuple[str, str]]:
        """(role, computation name) of every computation this instruction calls."""
        found = [(m.group(1), m.group(2)) for m in _SINGLE_CALLEE.finditer(self.attributes)]
        for m in _CALLEE_LIST.finditer(self.attributes):
            found += [(m.group(1), name.strip().lstrip("%")) for name in m.group(2).split(",") if name.strip()]
        return found


@dataclasses.dataclass
class Computation:
    name: str
    instructions: dict[str, Instruction]
    users: dict[str, list[tuple[Instruction, int]]]  # value -> (user, operand position)
    parameters: dict[int, str]  # parameter number -> instruction name
    root: str = ""


def _parse_instruction(line: str) -> Instruction | None:
    head = _INSTRUCTION.match(line)
    if not head:
        return None
    rest = line[head.end():]
    if rest.startswith("("):
        end = _matching(rest, 0, "(", ")")
    else:
        end = rest.index(" ") if " " in rest else len(rest)
    shape, rest = rest[:end], rest[end:].lstrip()
    opcode_match = re.match(r"([\w\-]+)\(", rest)
    if not opcode_match:
        return None
    close = _matching(rest, opcode_match.end() - 1, "(", ")")
    operand_text = re.sub(r"/\*.*?\*/", "", rest[opcode_match.end():close - 1])
    operands = [o.strip().split(" ")[-1].lstrip("%") for o in operand_text.split(",") if o.strip()]
    return Instruction(head.group(1).lstrip("%"), shape, opcode_match.group(1), operands, rest[close:])


def parse_module(text: str) -> tuple[dict[str, Computation], str, int | None]:
    """The computations of an HLO module's text, the ENTRY computation's name, and num_partitions."""
    computations, entry, current = {}, None, None
    partitions = re.search(r"num_partitions=(\d+)", text)
    for line in text.splitlines():
        if current is None:
            if line.endswith("{") and (line.startswith("%") or line.startswith("ENTRY")):
                name = line.split()[1] if line.startswith("ENTRY") else line.split()[0]
                current = Computation(name.lstrip("%"), {}, defaultdict(list), {})
                if line.startswith("ENTRY"):
                    entry = current.name
            continue
        if line.startswith("}"):
            computations[current.name] = current
            current = None
            continue
        instruction = _parse_instruction(line)
        if instruction is None:
            continue
        current.instructions[instruction.name] = instruction
        if line.lstrip().startswith("ROOT "):
            current.root = instruction.name
        for position, operand in enumerate(instruction.operands):
            current.users[operand].append((instruction, position))
        if instruction.opcode == "parameter":
            current.parameters[int(instruction.operands[0])] = instruction.name
    if entry is None:
        raise ValueError("HLO text has no ENTRY computation")
    return computations, entry, int(partitions.group(1)) if partitions else None


# ----------------------------------------------------------------------------------------------
# Device groups


def _iota(dims: list[int], perm: list[int] | None) -> np.ndarray:
    ids = np.arange(math.prod(dims)).reshape(dims)
    return ids.transpose(perm) if perm else ids


def _ints(text: str) -> list[int]:
    return [int(x) for x in re.findall(r"\d+", text)]


def _mesh_groups(text: str, start: int) -> list[list[int]]:
    """Groups of the form `mesh['a'=2,'b'=4][, device_ids=(...)] {'b', 'a':(1)2}`."""
    close = text.index("]", start)
    axes = [(name.strip().strip("'\""), int(size)) for name, size in
            (part.rsplit("=", 1) for part in text[start + len("mesh["):close].split(","))]
    dims = [size for _, size in axes]
    rest, ids = text[close + 1:], None
    device_ids = re.match(r"\s*,\s*device_ids=\(", rest)
    if device_ids:
        end = _matching(rest, device_ids.end() - 1, "(", ")")
        body = rest[device_ids.end():end - 1]
        iota = re.fullmatch(r"\s*\[([\d,]+)\](?:<=\[([\d,]+)\])?(?:T\(([\d,]+)\))?\s*", body)
        if iota:  # an iota tile assignment: [reshape dims] then an optional transpose
            ids = _iota(_ints(iota.group(2) or iota.group(1)), _ints(iota.group(3)) if iota.group(3) else None)
        else:
            ids = np.array(_ints(body))
        rest = rest[end:]
    ids = (np.arange(math.prod(dims)) if ids is None else ids).reshape(dims)
    brace = rest.index("{")
    listed = rest[brace + 1:_matching(rest, brace, "{", "}") - 1]
    # axis -> [(pre_size, size)] of the listed (sub-)axes; a whole axis is (1, axis size)
    varying = defaultdict(list)
    names = [name for name, _ in axes]
    for item in filter(None, (i.strip() for i in listed.split(","))):
        sub = re.fullmatch(r"['\"]?(.+?)['\"]?(?::\((\d+)\)(\d+))?", item)
        axis = names.index(sub.group(1))
        varying[axis].append((int(sub.group(2)), int(sub.group(3))) if sub.group(2) else (1, dims[axis]))
    groups = defaultdict(list)
    for index in np.ndindex(*dims):
        key = []
        for axis, coordinate in enumerate(index):
            for pre, size in varying.get(axis, ()):
                post = dims[axis] // (pre * size)  # the sub-axis is the middle factor of pre x size x post
                coordinate -= ((coordinate // post) % size) * post
            key.append(coordinate)
        groups[tuple(key)].append(int(ids[index]))
    return list(groups.values())


def replica_groups(attributes: str, n_partitions: int) -> list[list[int]]:
    """The device groups of a collective, from any of the text forms XLA prints."""
    at = attributes.find("replica_groups=")
    if at < 0:
        return [list(range(n_partitions))]
    start = at + len("replica_groups=")
    text = attributes[start:]
    if text.startswith("mesh["):
        return _mesh_groups(attributes, start)
    iota = re.match(r"\[(\d+),(\d+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", text)
    if iota:
        n_groups, size = int(iota.group(1)), int(iota.group(2))
        ids = _iota(_ints(iota.group(3)), _ints(iota.group(4)) if iota.group(4) else None)
        return ids.reshape(n_groups, size).tolist()
    body = text[:_matching(text, 0, "{", "}")]
    groups = [_ints(g) for g in re.findall(r"\{([\d,\s]*)\}", body[1:-1])]
    return groups or [list(range(n_partitions))]  # `{}`: every partition in one group


def source_target_pairs(attributes: str) -> list[tuple[int, int]]:
    m = re.search(r"source_target_pairs=\{(.*?)\}\}", attributes)
    return [tuple(_ints(p)) for p in re.findall(r"\{(\d+\s*,\s*\d+)", m.group(1) + "}")] if m else []
