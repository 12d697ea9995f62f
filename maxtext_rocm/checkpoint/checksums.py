"""Checksums of a checkpoint's arrays, computed on the devices and independent of the sharding.

Why our own: orbax 0.12.8 writes arrays as zarr3 through tensorstore (OCDBT), whose only checksum
is the crc32c of each shard's *index* (`_build_zarr3_metadata`); chunk data is zstd-compressed
without a content checksum, so flipped bytes either fail to decompress or, worse, decompress to
other numbers that orbax restores without complaint.

Why on the devices: a hash of host bytes is a hash of one process's shards in one layout, which
a restore onto another mesh (or another process count) no longer has. This one is a weighted sum
of every element's bits, modulo 2**32, over the whole global array:

    sum_i  bits(x_i) * w_i     with w_i odd and drawn from the element's global index i

Integer addition modulo 2**32 is associative and commutative, so the sum is the same however the
array is split over devices and processes, and XLA computes it as each device's partial sums
(one fused reduction per array: no temporaries of the array's size) combined across devices
(a few bytes each): one read of the state at memory bandwidth, no host copy. Every process gets the
same answer, so all agree on whether a checkpoint is intact. Any single changed element changes
the sum (an odd weight times a non-zero difference is non-zero modulo 2**32); a second,
differently weighted sum makes cancelling changes a ~2**-64 event.
"""

from __future__ import annotations

import functools
import hashlib
import json

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

ALGORITHM = "sum32x2-v1"  # stored beside the checksums, so a later change of scheme is recognised


def leaf_names(tree) -> list[str]:
    """"params.layers.mlp.up.kernel" for each leaf, in tree order: the same names for live pytrees
    (attributes, tuples) and orbax's metadata trees (dicts, lists)."""
    def name(key):
        for attr in ("key", "name", "idx"):
            if hasattr(key, attr):
                return str(getattr(key, attr))
        return str(key)
    return [".".join(name(k) for k in path) for path, _ in jax.tree_util.tree_leaves_with_path(tree)]


def _bits(x: jax.Array) -> jax.Array:
    """Each element's bit pattern as a uint32 (narrower types zero-extended)."""
    if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
        x = jax.random.key_data(x)
    if x.dtype == jnp.bool_:
        return x.astype(jnp.uint32)
    unsigned = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}[x.dtype.itemsize]
    return jax.lax.bitcast_convert_type(x, unsigned).astype(jnp.uint32)


def _global_index(shape) -> jax.Array:
    """Row-major position of every element, modulo 2**32, built from iotas so that each device
    computes only its own block (a reshape to 1-D would gather the array)."""
    index, stride = jnp.zeros(shape, jnp.uint32), 1
    for axis in reversed(range(len(shape))):
        index = index + jax.lax.broadcasted_iota(jnp.uint32, shape, axis) * jnp.uint32(stride % 2**32)
        stride *= shape[axis]
    return index


def _combine(a, b):
    """The reducer: both sums modulo 2**32, and whether any element was non-finite."""
    return a[0] + b[0], a[1] + b[1], a[2] | b[2]


def _leaf_summary(x: jax.Array):
    """(two uint32 sums, whether every element is finite) of one array, in one variadic reduction:
    XLA fuses the iotas, the weights and the isfinite test into the reduce's loop, so the program
    reads the array once and allocates no array-sized temporaries (separate jnp.sum calls
    materialised the index and weight arrays:
    docs/figures.md#checkpoint-saves-the-loops-stall-and-the-checksum). Each device reduces its own
    block; the partitioner combines the partial sums across devices (a few bytes per array)."""
    bits, index = _bits(x), _global_index(x.shape)
    w1 = index * jnp.uint32(0x9E3779B1) | jnp.uint32(1)  # odd: every single change shows
    w2 = (index ^ jnp.uint32(0x5BD1E995)) * jnp.uint32(0x85EBCA77) | jnp.uint32(1)
    mixed = bits ^ (bits >> 15)  # so that the second sum does not see exactly what the first does
    if jnp.issubdtype(x.dtype, jnp.inexact):
        bad = (~jnp.isfinite(x)).astype(jnp.uint32)
    else:
        bad = jnp.zeros(x.shape, jnp.uint32)
    zero = jnp.uint32(0)
    s1, s2, n_bad = jax.lax.reduce((bits * w1, mixed * w2, bad), (zero, zero, zero), _combine, tuple(range(x.ndim)))
    return jnp.stack([s1, s2]), n_bad == 0


@functools.lru_cache(maxsize=None)
def summariser(replicated):
    """The jitted summaries, their results replicated over the arrays' mesh: every process then
    holds them whole and can read them (None: wherever XLA puts them, for unmeshed arrays)."""
    return jax.jit(lambda leaves: [_leaf_summary(x) for x in leaves], out_shardings=replicated)


def start_summary(tree):
    """Dispatches the summaries of a pytree of global arrays and returns at once: (leaf names, the
    summaries still on the devices). Every process dispatches it at the same point (a collective
    program); `finish_summary` waits for it, in any thread. Later steps that donate the arrays
    wait for this read first (JAX orders a donation after the reads already dispatched)."""
    leaves = jax.tree_util.tree_leaves(tree)
    meshes = {x.sharding.mesh for x in leaves if isinstance(getattr(x, "sharding", None), NamedSharding)}
    replicated = NamedSharding(meshes.pop(), PartitionSpec()) if len(meshes) == 1 else None
    return leaf_names(tree), summariser(replicated)(leaves)


def finish_summary(started) -> tuple[dict[str, str], list[str]]:
    """({leaf name: 16-hex-digit checksum}, names of the leaves holding inf/NaN) of `start_summary`'s
    result; blocks until it is computed."""
    names, on_devices = started
    checksums, nonfinite = {}, []
    for name, (sums, finite) in zip(names, jax.device_get(on_devices)):
        checksums[name] = "".join(f"{int(s):08x}" for s in np.asarray(sums))
        if not bool(finite):
            nonfinite.append(name)
    return checksums, nonfinite


def summarise(tree) -> tuple[dict[str, str], list[str]]:
    """({leaf name: 16-hex-digit checksum}, names of the leaves holding inf/NaN) of a pytree of
    global arrays. Blocks until computed: callers are at a sync point already (a save, a restore)."""
    return finish_summary(start_summary(tree))


def json_digest(value) -> str:
    """sha256 of a JSON-able value's canonical text (the data iterator's position)."""
    return hashlib.sha256(json.dumps(value, sort_keys=True).encode()).hexdigest()


def first_difference(stored: dict[str, str], computed: dict[str, str]) -> str | None:
    """A phrase naming the first array whose checksum differs from the stored one (None: all agree)."""
    for name, value in computed.items():
        if name not in stored:
            return f"{name} has no stored checksum"
        if stored[name] != value:
            return f"{name} does not match its checksum"
    extra = sorted(set(stored) - set(computed))
    return f"{extra[0]} was saved but not restored" if extra else None
