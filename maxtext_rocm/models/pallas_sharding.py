"""How the Pallas attention kernels split over devices: by batch and by kv head, never by sequence
or head_dim (each kernel walks the whole sequence of its heads).

XLA cannot look inside a kernel's custom call; without a rule it would gather the operands and run
the whole attention on every device. `jax.experimental.custom_partitioning` gives it the rule (a
Shardy einsum-like string) and, at compile time, asks for the per-device program under the
shardings it chose: each device runs the kernels on its own rows and heads, with no communication.
The model never names a mesh axis; a mesh appears only in the callback XLA calls as it partitions.

Heads are ordered kv head major (h = kv_head * groups + g), so sharding kv heads shards the query
heads in the same blocks; the group factor g stays whole, so a device holds every query head of
its kv heads.
"""

from __future__ import annotations

import re

from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import NamedSharding, PartitionSpec as P

# Each operand's axes: b batch, s query and t key positions, k kv heads, g query heads per kv
# head, d head_dim.
Q, KV, SEGMENTS, STATS = "b s (k g) d", "b t k d", "b s", "b (k g) s"


def _spec(axes: str, batch, kv_heads) -> P:
    names = axes.replace("(k g)", "kg").split()
    return P(*(batch if n == "b" else kv_heads if n in ("k", "kg") else None for n in names))


def split_by_batch_and_heads(kernel, operands: tuple[str, ...], results: tuple[str, ...], groups: int):
    """`kernel(*arrays)` (returning one array, or a tuple when `results` names several), made
    splittable over batch and kv heads; `operands`, `results`: each one's axes (Q, KV, ...)."""

    def shardings(mesh, q_sharding):
        spec = tuple(getattr(q_sharding, "spec", ())) + (None,) * 4
        batch, heads = spec[0], spec[2]  # q's (k g) axis is sharded as k: g stays whole
        args = tuple(NamedSharding(mesh, _spec(o, batch, heads)) for o in operands)
        outs = tuple(NamedSharding(mesh, _spec(r, batch, heads)) for r in results)
        return args, outs if len(outs) > 1 else outs[0]

    def partition(mesh, arg_shapes, result_shape):
        args, outs = shardings(mesh, arg_shapes[0].sharding)
        return mesh, kernel, outs, args

    def infer(mesh, arg_shapes, result_shape):  # the GSPMD partitioner's question (Shardy off)
        return shardings(mesh, arg_shapes[0].sharding)[1]

    rule = ", ".join(operands) + " -> " + ", ".join(results)
    # Shardy numbers the factors (one letter each) by first appearance and wants these in that order.
    whole = [name for name in dict.fromkeys(re.findall(r"[a-z]", rule)) if name in "stdg"]
    split = custom_partitioning(kernel)
    split.def_partition(partition=partition, infer_sharding_from_operands=infer, sharding_rule=rule,
                        need_replication_factors=tuple(whole), g=groups)
    return split
