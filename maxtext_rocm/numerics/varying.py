"""How values vary over the manual mesh axes of a `shard_map`, for code that runs both inside one
(maxtext_rocm/parallel/) and outside (one device, or GSPMD's automatic sharding).

Inside shard_map JAX types each value by the mesh axes it varies over: a loop's carry must keep
its type, and a custom VJP's cotangent must have its primal's. Outside, nothing varies and every
helper here returns its input unchanged.
"""

from __future__ import annotations

import jax

Array = jax.Array


def varying_axes(x: Array) -> set:
    """The mesh axes `x` varies over (jax 0.10 calls the type manual_axis_type, later ones vma)."""
    aval = jax.typeof(x)
    mat = getattr(aval, "manual_axis_type", None)
    return set(mat.varying) if mat is not None else set(getattr(aval, "vma", ()))


def varying_like(init: Array, *operands: Array) -> Array:
    """`init` (a loop's initial carry, a zero buffer) typed as varying over every axis its
    operands vary over, as the values computed from them will."""
    axes = set().union(*(varying_axes(x) for x in operands)) - varying_axes(init)
    return jax.lax.pcast(init, tuple(sorted(axes)), to="varying") if axes else init


def varying_over(x: Array, axes) -> Array:
    """`x` typed as varying over `axes` (those it does not vary over already). The transpose of
    that cast sums the cotangent over them: where `x` is then gathered, the sum happens after the
    gather's reduce-scatter, on the shard, rather than on the gathered whole where `x` meets data
    that varies."""
    missing = set(axes) - varying_axes(x)
    return jax.lax.pcast(x, tuple(sorted(missing)), to="varying") if missing else x


def summed_like(cotangent: Array, primal: Array) -> Array:
    """A custom VJP's cotangent typed like its primal input: summed over the axes it varies over
    and the primal does not. An input that is the same on every device of an axis (an expert
    weight under data parallelism) gets the sum of every device's contribution."""
    axes = varying_axes(cotangent) - varying_axes(primal)
    return jax.lax.psum(cotangent, tuple(sorted(axes))) if axes else cotangent


def check_vma(mesh) -> bool:
    """`check_vma` for a shard_map of parallel/ over `mesh`: False where the mesh has stages.
    The pipeline runs the layers under `jax.vmap(spmd_axis_name="stage")`, and in this JAX
    (0.10.2) a loop inside a shard_map batched that way fails the type check: the loop's batched
    body types its batched inputs without `stage`, while the values broadcast to meet them get it
    ("Primitive mul requires varying manual axes to match"; batching._batch_jaxpr_axes). Unchecked,
    the shard_map's transpose sums each input's cotangent over the mesh axes its spec leaves out,
    which is what the checked one derives from the types, and the helpers above see no varying
    axes and change nothing; tests/test_pipeline.py holds both layers to one device's gradients."""
    return mesh.shape.get("stage", 1) <= 1
