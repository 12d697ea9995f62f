"""comm.py's reduce-scatter rule (maxtext_rocm/planner/hlo_slices.py): an all-reduce counts as the
reduce-scatter a GPU compiler makes of it only when each device slices its own piece; one used
whole, through N slices of 1/N, stays an all-reduce. Hand-written HLO and XLA's own program."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, Mesh, PartitionSpec as P

from maxtext_rocm.planner import comm
from test_comm import F32_8x16, MESH_2x4, SLICE_FUSION, module, own_offset, totals

SLICED_ALL_REDUCE = """  %p = f32[8,16]{1,0} parameter(0)
  %ar = f32[8,16]{1,0} all-reduce(%p), channel_id=1, replica_groups={{0,1,2,3},{4,5,6,7}}, use_global_device_ids=true, to_apply=%add
"""


@pytest.mark.parametrize("case, uses", [
    # every device takes all four pieces: the result is used whole
    ("four constant offsets", "".join(f"  %o{k} = s32[] constant({2 * k})\n  %s{k} = f32[2,16]{{1,0}} fusion(%ar, %o{k}), "
                                      f"kind=kLoop, calls=%slice_it\n" for k in range(4))
     + "  ROOT %r = (f32[2,16], f32[2,16], f32[2,16], f32[2,16]) tuple(%s0, %s1, %s2, %s3)"),
    ("static slices", "  %s0 = f32[2,16]{1,0} slice(%ar), slice={[0:2], [0:16]}\n"
                      "  %s1 = f32[2,16]{1,0} slice(%ar), slice={[2:4], [0:16]}\n  ROOT %r = (f32[2,16], f32[2,16]) tuple(%s0, %s1)"),
    # the device's own piece and its neighbour's
    ("two pieces per device", own_offset() + "\n" + own_offset("2,4,6,0,2,4,6,0", "next")
     + "\n  %s0 = f32[2,16]{1,0} fusion(%ar, %off), kind=kLoop, calls=%slice_it"
       "\n  %s1 = f32[2,16]{1,0} fusion(%ar, %next), kind=kLoop, calls=%slice_it\n  ROOT %r = (f32[2,16], f32[2,16]) tuple(%s0, %s1)"),
    # devices 0 and 1 take the same piece: the one at row 6 is reduced for nobody in their group
    ("a piece shared", own_offset("0,0,2,4,0,2,4,6") + "\n  ROOT %s0 = f32[2,16]{1,0} fusion(%ar, %off), kind=kLoop, calls=%slice_it"),
    ("an offset from a parameter", "  %q = s32[] parameter(1)\n  ROOT %s0 = f32[2,16]{1,0} fusion(%ar, %q), kind=kLoop, calls=%slice_it"),
])
def test_all_reduce_used_whole_through_slices_stays_an_all_reduce(case, uses):
    result = comm.account(module(SLICED_ALL_REDUCE + uses, SLICE_FUSION), MESH_2x4)
    assert totals(result) == {("all-reduce", "b", "ICI"): pytest.approx(2 * 3 / 4 * F32_8x16)}, case
    assert result["recounted_as_reduce_scatter"] == 0


def _offset_loop(offset: str) -> str:
    """A 4-trip loop whose body all-reduces its carry and takes the piece at `offset`; element 2
    of its carry is an offset computed before the loop and passed through unchanged."""
    return f"""
%slicer (param: (s32[], f32[8,16], s32[])) -> (s32[], f32[8,16], s32[]) {{
  %param = (s32[], f32[8,16], s32[]) parameter(0)
  %i = s32[] get-tuple-element(%param), index=0
  %x = f32[8,16] get-tuple-element(%param), index=1
  %hoisted = s32[] get-tuple-element(%param), index=2
  %two = s32[] constant(2)
  %by_step = s32[] multiply(%i, %two)
  %ar = f32[8,16]{{1,0}} all-reduce(%x), channel_id=1, replica_groups={{{{0,1,2,3}},{{4,5,6,7}}}}, use_global_device_ids=true, to_apply=%add
  %piece = f32[2,16]{{1,0}} fusion(%ar, {offset}), kind=kLoop, calls=%slice_it
  %wide = f32[8,16]{{1,0}} pad(%piece, %zero.f), padding=0_6x0_0
  %one = s32[] constant(1)
  %next = s32[] add(%i, %one)
  ROOT %out = (s32[], f32[8,16], s32[]) tuple(%next, %wide, %hoisted)
}}

%slicer.cond (param.c: (s32[], f32[8,16], s32[])) -> pred[] {{
  %param.c = (s32[], f32[8,16], s32[]) parameter(0)
  %i.c = s32[] get-tuple-element(%param.c), index=0
  %n = s32[] constant(4)
  ROOT %lt = pred[] compare(%i.c, %n), direction=LT
}}
"""


@pytest.mark.parametrize("offset, kind", [("%by_step", "all-reduce"), ("%hoisted", "reduce-scatter")])
def test_a_loop_counter_offset_is_not_a_device_offset(offset, kind):
    """A pipeline's loop takes piece i of a whole result in iteration i: an all-reduce. An offset
    the loop-invariant code motion hoisted out of the loop is still the device's own."""
    entry = ("  %p = f32[8,16]{1,0} parameter(0)\n" + own_offset() + "\n  %zero = s32[] constant(0)\n"
             "  %t = (s32[], f32[8,16], s32[]) tuple(%zero, %p, %off)\n"
             '  %w = (s32[], f32[8,16], s32[]) while(%t), condition=%slicer.cond, body=%slicer, '
             'backend_config={"known_trip_count":{"n":"4"}}\n  ROOT %r = f32[8,16] get-tuple-element(%w), index=1')
    text = module(entry, SLICE_FUSION, _offset_loop(offset).replace("%zero.f", "%zf").replace(
        "  %two = s32[] constant(2)", "  %two = s32[] constant(2)\n  %zf = f32[] constant(0)"))
    result = comm.account(text, MESH_2x4)
    factor = 2 * 3 / 4 if kind == "all-reduce" else 3 / 4
    assert totals(result) == {(kind, "b", "ICI"): pytest.approx(4 * factor * F32_8x16)}


def test_a_compiled_slice_of_ones_own_piece_or_of_every_piece(devices):
    """XLA's own program: a psum sliced at the device's axis index is a reduce-scatter; the same
    psum used piece by piece, every piece on every device, is an all-reduce."""
    mesh = Mesh(np.array(devices).reshape(2, 4), ("a", "b"), axis_types=(AxisType.Auto,) * 2)

    def own(x):  # x: f32[8,16] per device
        total = jax.lax.psum(x * 2, "b")
        return jax.lax.dynamic_slice_in_dim(total, jax.lax.axis_index("b") * 2, 2) + 1

    def every(x):  # four slices of 1/4, the same on every device
        total = jax.lax.psum(x * 2, "b")
        pieces = [jax.lax.dynamic_slice_in_dim(total, k * 2, 2) for k in range(4)]
        return pieces[0] * pieces[1] + pieces[2] * pieces[3]

    for f, kind, factor in ((own, "reduce-scatter", 3 / 4), (every, "all-reduce", 2 * 3 / 4)):
        program = jax.jit(jax.shard_map(f, mesh=mesh, in_specs=P(("a", "b")), out_specs=P(("a", "b")),
                                        check_vma=False))
        compiled = program.lower(jnp.ones((64, 16))).compile()
        result = comm.account(compiled.as_text(), comm.MeshLayout.of(mesh, compiled=compiled))
        assert totals(result) == {(kind, "b", "ICI"): pytest.approx(factor * F32_8x16)}, compiled.as_text()


def test_optimized_text_prints_the_constants_as_text_elides(devices):
    """From about 16 partitions on, the offset tables that slice a gradient's all-reduce to each
    device's shard are constants long enough for as_text() to print as `{...}`, and the slice rule
    cannot read them (70B stage=4 x fsdp=8 read 1,570.5 GiB of fsdp traffic instead of 1,180.0).
    hlo_text.optimized_text prints them whole and is otherwise the same program."""
    from maxtext_rocm.planner.hlo_text import optimized_text

    table = np.random.default_rng(0).permutation(64).astype(np.int32)  # nothing XLA can fold to a formula
    compiled = jax.jit(lambda i, x: x + jnp.asarray(table)[i]).lower(jnp.int32(0), jnp.ones(4, jnp.int32)).compile()
    elided, whole = compiled.as_text(), optimized_text(compiled)
    assert "{...}" in elided and "{...}" not in whole
    assert ", ".join(str(v) for v in table[:4]) in whole.replace(", ", ",").replace(",", ", ")

    def instructions(text):
        return sorted(line.split("=")[0].strip() for line in text.splitlines() if " = " in line)
    assert instructions(elided) == instructions(whole)
