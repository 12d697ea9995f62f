"""Collective accounting (maxtext_rocm/planner/comm.py): hand-written HLO with known answers, a real compile
of a program with known collectives, and a tiny model's report against a minimum worked by hand."""

import json
import os
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, Mesh, PartitionSpec as P

from maxtext_rocm.planner import comm, comm_minimum
from maxtext_rocm.planner.hlo_text import replica_groups

MESH_2x4 = comm.MeshLayout.from_shape({"a": 2, "b": 4})
ADD = """
%add (x: f32[], y: f32[]) -> f32[] {
  %x = f32[] parameter(0)
  %y = f32[] parameter(1)
  ROOT %sum = f32[] add(%x, %y)
}
"""


def module(entry: str, *computations: str) -> str:
    return ("HloModule test, num_partitions=8\n" + ADD + "".join(computations)
            + "\nENTRY %main (p: f32[8,16]) -> f32[8,16] {\n" + entry + "\n}\n")


def loop(name: str, body_lines: str, carry: str = "f32[8,16]") -> str:
    """A while body `name` over (s32[], carry) and its condition `name.cond`."""
    return f"""
%{name} (param: (s32[], {carry})) -> (s32[], {carry}) {{
  %param = (s32[], {carry}) parameter(0)
  %i = s32[] get-tuple-element(%param), index=0
  %x = {carry} get-tuple-element(%param), index=1
{body_lines}
  ROOT %out = (s32[], {carry}) tuple(%i, %y)
}}

%{name}.cond (param.c: (s32[], {carry})) -> pred[] {{
  %param.c = (s32[], {carry}) parameter(0)
  %i.c = s32[] get-tuple-element(%param.c), index=0
  %n = s32[] constant(4)
  ROOT %lt = pred[] compare(%i.c, %n), direction=LT
}}
"""


def while_op(name: str, body: str, trip: int | None, operand: str = "%t") -> str:
    config = (f', backend_config={{"known_trip_count":{{"n":"{trip}"}},"known_init_step":{{"init":"0","step":"1"}}}}'
              if trip else "")
    return (f"  %{name} = (s32[], f32[8,16]) while({operand}), condition=%{body}.cond, body=%{body}{config}")


ENTRY_LOOP_HEAD = """  %p = f32[8,16]{1,0} parameter(0)
  %zero = s32[] constant(0)
  %t = (s32[], f32[8,16]) tuple(%zero, %p)"""
GATHER_BODY = ("  %y = f32[8,16]{1,0} all-gather(%x), channel_id=1, replica_groups={{0,1,2,3},{4,5,6,7}}, "
               "dimensions={0}, use_global_device_ids=true")
F32_8x16 = 8 * 16 * 4


def totals(result):
    return {(r["kind"], r["axes"], r["link"]): r["bytes"] for r in result["rows"]}


def test_all_gather_in_a_loop_runs_its_trip_count():
    text = module(ENTRY_LOOP_HEAD + "\n" + while_op("w", "body", 4)
                  + "\n  ROOT %r = f32[8,16] get-tuple-element(%w), index=1", loop("body", GATHER_BODY))
    result = comm.account(text, MESH_2x4)
    # group of 4 along b; result f32[8,16]: (4-1)/4 of it leaves each device, 4 times
    assert totals(result) == {("all-gather", "b", "ICI"): pytest.approx(4 * 3 / 4 * F32_8x16)}
    assert result["rows"][0]["count"] == 4 and result["unknown_trip_count_loops"] == []


def test_nested_loops_multiply_and_a_loop_without_trip_count_is_flagged():
    inner = loop("inner", GATHER_BODY)
    outer = loop("outer", "  %zero.o = s32[] constant(0)\n  %t.o = (s32[], f32[8,16]) tuple(%zero.o, %x)\n"
                 + while_op("w.in", "inner", 3, "%t.o")
                 + "\n  %y = f32[8,16] get-tuple-element(%w.in), index=1")
    nested = module(ENTRY_LOOP_HEAD + "\n" + while_op("w", "outer", 2)
                    + "\n  ROOT %r = f32[8,16] get-tuple-element(%w), index=1", inner, outer)
    assert comm.account(nested, MESH_2x4)["total_bytes"] == pytest.approx(2 * 3 * 3 / 4 * F32_8x16)

    unknown = module(ENTRY_LOOP_HEAD + "\n" + while_op("w", "body", None)
                     + "\n  ROOT %r = f32[8,16] get-tuple-element(%w), index=1", loop("body", GATHER_BODY))
    result = comm.account(unknown, MESH_2x4)
    assert result["unknown_trip_count_loops"] == [{"while": "w", "computation": "main", "body": "body"}]
    assert result["total_bytes"] == pytest.approx(3 / 4 * F32_8x16)  # once, and flagged as a lower bound
    assert "FLAGGED" in comm.format_report(_with_minimum(result))

    compute_only = module(ENTRY_LOOP_HEAD + "\n" + while_op("w", "body", None)
                          + "\n  ROOT %r = f32[8,16] get-tuple-element(%w), index=1",
                          loop("body", "  %y = f32[8,16] add(%x, %x)"))
    assert comm.account(compute_only, MESH_2x4)["unknown_trip_count_loops"] == []  # nothing to undercount


def _with_minimum(measured):
    return {**measured, "by_axes": {}, "minimum": {"terms": [], "cpu_bytes": 1.0, "gpu_bytes": 1.0}, "ratio": 1.0,
            "target": "mi300x", "link": comm.LINKS["mi300x"], "measured_seconds": 0.0,
            "minimum_seconds": 0.0, "policy": "fp32"}


SLICE_FUSION = """
%slice_it (param_0: f32[8,16], param_1: s32[]) -> f32[2,16] {
  %param_0 = f32[8,16]{1,0} parameter(0)
  %param_1 = s32[] parameter(1)
  %z = s32[] constant(0)
  ROOT %ds = f32[2,16]{1,0} dynamic-slice(%param_0, %param_1, %z), dynamic_slice_sizes={2,16}
}
"""


def own_offset(table: str = "0,2,4,6,0,2,4,6", name: str = "off") -> str:
    """A row offset per device, as XLA's SPMD partitioner writes it: a table indexed by partition-id."""
    return f"""  %pid.{name} = u32[] partition-id()
  %table.{name} = s32[8]{{0}} constant({{{table}}})
  %row.{name} = s32[1]{{0}} dynamic-slice(%table.{name}, %pid.{name}), dynamic_slice_sizes={{1}}
  %{name} = s32[] bitcast(%row.{name})"""


def test_all_reduce_sliced_to_one_nth_is_a_reduce_scatter():
    entry = """  %p = f32[8,16]{1,0} parameter(0)
""" + own_offset() + """
  %ar = f32[8,16]{1,0} all-reduce(%p), channel_id=1, replica_groups={{0,1,2,3},{4,5,6,7}}, use_global_device_ids=true, to_apply=%add
  %b = f32[8,16]{1,0} bitcast(%ar)
  %piece = f32[2,16]{1,0} fusion(%b, %off), kind=kLoop, calls=%slice_it
  %ar.kept = f32[8,16]{1,0} all-reduce(%p), channel_id=2, replica_groups={{0,1,2,3},{4,5,6,7}}, use_global_device_ids=true, to_apply=%add
  %used = f32[8,16]{1,0} add(%ar.kept, %p)
  ROOT %r = (f32[2,16], f32[8,16]) tuple(%piece, %used)"""
    result = comm.account(module(entry, SLICE_FUSION), MESH_2x4)
    assert totals(result) == {("reduce-scatter", "b", "ICI"): pytest.approx(3 / 4 * F32_8x16),
                              ("all-reduce", "b", "ICI"): pytest.approx(2 * 3 / 4 * F32_8x16)}
    assert result["recounted_as_reduce_scatter"] == 1


# XLA:CPU's float normalization of a bf16 all-reduce: converts to f32 around it, the slice later
BF16_BRACKET = """
%to_bf16 (c0: f32[8,16]) -> bf16[8,16] {
  %c0 = f32[8,16]{1,0} parameter(0)
  ROOT %down = bf16[8,16]{1,0} convert(%c0)
}

%slice_bf16 (s0: f32[4,16], s1: bf16[8,16], s2: s32[]) -> f32[2,16] {
  %s0 = f32[4,16]{1,0} parameter(0)
  %s1 = bf16[8,16]{1,0} parameter(1)
  %s2 = s32[] parameter(2)
  %up = f32[8,16]{1,0} convert(%s1)
  %z0 = s32[] constant(0)
  ROOT %piece.b = f32[2,16]{1,0} dynamic-slice(%up, %s2, %z0), dynamic_slice_sizes={2,16}
}
"""


def test_float_normalized_all_reduce_sliced_later_is_a_reduce_scatter():
    entry = """  %p = f32[8,16]{1,0} parameter(0)
  %other = f32[4,16]{1,0} parameter(1)
""" + own_offset() + """
  %ar = f32[8,16]{1,0} all-reduce(%p), channel_id=1, replica_groups={{0,1,2,3},{4,5,6,7}}, use_global_device_ids=true, to_apply=%add
  %narrow = bf16[8,16]{1,0} fusion(%ar), kind=kLoop, calls=%to_bf16
  ROOT %piece = f32[2,16]{1,0} fusion(%other, %narrow, %off), kind=kLoop, calls=%slice_bf16"""
    result = comm.account(module(entry, BF16_BRACKET), MESH_2x4)
    assert totals(result) == {("reduce-scatter", "b", "ICI"): pytest.approx(3 / 4 * F32_8x16)}


def test_tuple_collectives_count_each_element():
    entry = """  %p = f32[8,16]{1,0} parameter(0)
  %q = f32[4]{0} parameter(1)
  %x0 = bf16[2,16]{1,0} parameter(2)
  %x1 = bf16[2,16]{1,0} parameter(3)
  %x2 = bf16[2,16]{1,0} parameter(4)
  %x3 = bf16[2,16]{1,0} parameter(5)
  %ar = (f32[8,16]{1,0}, f32[4]{0}) all-reduce(%p, %q), channel_id=1, replica_groups={{0,4},{1,5},{2,6},{3,7}}, use_global_device_ids=true, to_apply=%add
  %e0 = f32[8,16]{1,0} get-tuple-element(%ar), index=0
  %e1 = f32[4]{0} get-tuple-element(%ar), index=1
""" + own_offset("0,0,0,0,4,4,4,4") + """
  %z = s32[] constant(0)
  %half = f32[4,16]{1,0} dynamic-slice(%e0, %off, %z), dynamic_slice_sizes={4,16}
  %a2a = (bf16[2,16]{1,0}, bf16[2,16]{1,0}, bf16[2,16]{1,0}, bf16[2,16]{1,0}) all-to-all(%x0, %x1, %x2, %x3), channel_id=2, replica_groups=[2,4]<=[8]
  ROOT %r = (f32[4,16], f32[4]) tuple(%half, %e1)"""
    result = comm.account(module(entry), MESH_2x4)
    # element 0 sliced to 1/2 over its pairs along a: a reduce-scatter; element 1 stays an all-reduce
    assert totals(result) == {("reduce-scatter", "a", "ICI"): pytest.approx(1 / 2 * F32_8x16),
                              ("all-reduce", "a", "ICI"): pytest.approx(2 * 1 / 2 * 16),
                              ("all-to-all", "b", "ICI"): pytest.approx(3 / 4 * 4 * 2 * 16 * 2)}
    rows = {r["kind"]: r for r in result["rows"]}
    assert rows["all-to-all"]["count"] == 1 and rows["all-to-all"]["tensors"] == 4


@pytest.mark.parametrize("text, axes", [
    ("replica_groups={{0,1,2,3},{4,5,6,7}}", ("b",)),
    ("replica_groups={{0,4},{1,5},{2,6},{3,7}}", ("a",)),
    ("replica_groups={{0,1},{2,3},{4,5},{6,7}}", ("b",)),  # part of b: still b
    ("replica_groups={}", ("a", "b")),
    ("replica_groups=[2,4]<=[8]", ("b",)),
    ("replica_groups=[4,2]<=[2,4]T(1,0)", ("a",)),
    ("replica_groups=[1,8]<=[8]", ("a", "b")),
    ("replica_groups=mesh['x'=2,'y'=4] {'y'}", ("b",)),
    ("replica_groups=mesh['x'=2,'y'=4] {'x'}", ("a",)),
    ("replica_groups=mesh['x'=2,'y'=4] {'x', 'y'}", ("a", "b")),
    # the collective's own mesh orders the devices column-major: its axis y is our axis a
    ("replica_groups=mesh['x'=4,'y'=2], device_ids=([2,4]T(1,0)) {'y'}", ("a",)),
    ("replica_groups=mesh['x'=2,'y'=4] {'y':(1)2}", ("b",)),
])
def test_replica_groups_map_to_the_mesh_axes_they_span(text, axes):
    groups = replica_groups(text, 8)
    assert sorted(d for g in groups for d in g) == list(range(8))
    assert {MESH_2x4.axes_of(g)[0] for g in groups} == {axes}


def test_sub_axis_groups():
    # y (size 4) as 2 x 2: the major sub-axis pairs devices 2 apart, the minor one neighbours
    assert replica_groups("replica_groups=mesh['x'=2,'y'=4] {'y':(1)2}", 8) == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert replica_groups("replica_groups=mesh['x'=2,'y'=4] {'y':(2)2}", 8) == [[0, 1], [2, 3], [4, 5], [6, 7]]


def test_permute_async_forms_conditional_and_dcn():
    branch_big = """
%big (bp: f32[8,16]) -> f32[8,16] {
  %bp = f32[8,16]{1,0} parameter(0)
  ROOT %g = f32[8,16]{1,0} all-reduce(%bp), channel_id=5, replica_groups={{0,1,2,3,4,5,6,7}}, to_apply=%add
}

%small (sp: f32[8,16]) -> f32[8,16] {
  %sp = f32[8,16]{1,0} parameter(0)
  ROOT %s = f32[8,16]{1,0} copy(%sp)
}
"""
    entry = """  %p = f32[8,16]{1,0} parameter(0)
  %q = f32[2,16]{1,0} parameter(1)
  %cp = f32[8,16]{1,0} collective-permute(%p), channel_id=1, source_target_pairs={{0,0},{1,2},{2,4},{3,6},{4,1},{5,3},{6,5},{7,7}}
  %ags = (f32[2,16]{1,0}, f32[8,16]{1,0}) all-gather-start(%q), channel_id=2, replica_groups={{0,4},{1,5},{2,6},{3,7}}, dimensions={0}, use_global_device_ids=true
  %agd = f32[8,16]{1,0} all-gather-done(%ags)
  %c = pred[] constant(true)
  %cond = f32[8,16]{1,0} conditional(%c, %p, %p), true_computation=%big, false_computation=%small
  ROOT %r = f32[8,16]{1,0} add(%cp, %agd)"""
    # a 2 x 4 mesh whose axis a spans two processes (DCN) and b one host's devices
    layout = comm.MeshLayout.from_shape({"a": 2, "b": 4}, {"a": 2, "b": 1})
    result = comm.account(module(entry, branch_big), layout)
    assert totals(result) == {
        ("collective-permute", "a,b", "DCN"): pytest.approx(F32_8x16),  # each device sends once (0 and 7 to themselves)
        ("all-gather", "a", "DCN"): pytest.approx(1 / 2 * F32_8x16),  # counted once, at the -done
        ("all-reduce", "a,b", "DCN"): pytest.approx(2 * 7 / 8 * F32_8x16),  # the branch that moves more
    }
    assert comm.account(module(entry, branch_big), MESH_2x4)["bytes_by_link"] == {
        "ICI": pytest.approx(F32_8x16 * (1 + 1 / 2 + 14 / 8))}


def test_a_compiled_program_is_counted_exactly(devices):
    """XLA's own text, not a hand-written one: a psum in a 4-step scan, an all-gather, a ppermute
    and a psum_scatter over a 2 x 4 mesh."""
    mesh = Mesh(np.array(devices).reshape(2, 4), ("a", "b"), axis_types=(AxisType.Auto,) * 2)

    def f(x):  # x: f32[8,16] per device
        x, _ = jax.lax.scan(lambda c, _: (c + jax.lax.psum(c, "b"), None), x, None, length=4)
        gathered = jax.lax.all_gather(x, "a", tiled=True)  # f32[16,16]
        shifted = jax.lax.ppermute(x, "b", [(i, (i + 1) % 4) for i in range(4)])
        scattered = jax.lax.psum_scatter(x, ("a", "b"), tiled=True)  # f32[1,16]
        return gathered.sum() + shifted.sum() + scattered.sum()

    program = jax.jit(jax.shard_map(f, mesh=mesh, in_specs=P(("a", "b")), out_specs=P(), check_vma=False))
    compiled = program.lower(jnp.ones((64, 16))).compile()
    result = comm.account(compiled.as_text(), comm.MeshLayout.of(mesh, compiled=compiled))
    expected = {("all-reduce", "b", "ICI"): 4 * 2 * 3 / 4 * F32_8x16,
                ("all-gather", "a", "ICI"): 1 / 2 * 16 * 16 * 4,
                ("collective-permute", "b", "ICI"): F32_8x16,
                ("reduce-scatter", "a,b", "ICI"): 7 / 8 * F32_8x16}
    assert totals(result) == pytest.approx(expected)


def test_tiny_model_report_and_minimum_by_hand(tmp_path):
    """`compile --comm` on a tiny Llama, fsdp=8 over two fake nodes of 4 (`--target=h100:2x4`,
    mesh.dcn.fsdp=2): the minimum worked out here by hand, every fsdp group crossing the NICs."""
    from maxtext_rocm.planner import report as compile_cli

    out = tmp_path / "report.json"
    args = ["tiny_llama", "--target=h100:2x4", "--comm", f"--json={out}",
            "--config.model.vocab_size=128", "--config.model.d_model=64", "--config.model.n_layers=2",
            "--config.model.n_heads=4", "--config.model.n_kv_heads=2", "--config.model.head_dim=16",
            "--config.model.mlp_dim=128", "--config.model.scan_layers=true", "--config.model.remat=full",
            "--config.precision.policy=fp32", "--config.data.source=synthetic",
            "--config.train.per_device_batch_size=1", "--config.train.seq_len=32",
            "--config.mesh.ici.fsdp=4", "--config.mesh.dcn.fsdp=2"]
    assert compile_cli.main(args) == 0
    r = json.loads(out.read_text())["comm"]
    # one layer's matmul weights: q 64x64, k and v 64x32 each, o 64x64, gate/up/down 64x128 each
    layer = 64 * 64 + 2 * 64 * 32 + 64 * 64 + 3 * 64 * 128
    weights = 2 * (2 * 4 + 4) * 7 / 8 * layer  # 2 layers: gathered twice (remat), reduce-scattered once
    head = (4 + 4) * 7 / 8 * 64 * 128  # gathered once, reduce-scattered once
    # embedding rows exchanged instead of the table: 32 tokens per device, d split 8 ways
    embedding = min(head, 7 / 8 * 2 * 32 * 64 * 4 + 7 * 32 * 4)
    norms = 2 * 7 / 8 * 4 * (2 * 2 + 1) * 64  # replicated scales' gradients all-reduced
    assert r["minimum"]["cpu_bytes"] == pytest.approx(weights + head + embedding + norms)
    assert {t["term"] for t in r["minimum"]["terms"]} == {"layer weights", "LM head", "embedding", "norm scales"}
    assert r["ratio"] >= 1 - 1e-9  # the compiled program cannot beat the minimum
    assert {(row["axes"], row["link"]) for row in r["rows"]} == {("fsdp", "DCN")}
    assert r["unknown_trip_count_loops"] == []
    assert r["minimum_seconds"] == pytest.approx(r["minimum"]["cpu_bytes"] / 50e9)  # a 400 Gb/s NIC, one way


def test_bf16_weights_cross_the_links_in_bf16(tmp_path):
    """Under bf16 every weight is cast before it is gathered (the head too, parallel/loss.py), so
    it crosses the links in bf16. XLA:CPU's float normalization later makes every bf16 collective
    an f32 one, which is why the CPU's byte counts cannot show it; the program right after SPMD
    partitioning, before that pass, can."""
    dump = tmp_path / "dump"
    flags = (f"--xla_dump_to={dump} --xla_dump_hlo_as_text --xla_dump_hlo_pass_re=spmd-partitioning "
             "--xla_dump_hlo_module_re=.*train_step.*")
    result = subprocess.run(
        [sys.executable, "-m", "maxtext_rocm.compile", "tiny_llama", "--target=h100:2", "--config.mesh.ici.fsdp=2",
         "--config.precision.policy=bf16", "--config.model.tie_embeddings=false", "--config.model.vocab_size=128",
         "--config.model.d_model=64", "--config.model.n_layers=2", "--config.model.n_heads=4",
         "--config.model.n_kv_heads=2", "--config.model.head_dim=16", "--config.model.mlp_dim=128",
         "--config.data.source=synthetic", "--config.train.seq_len=32", "--config.train.per_device_batch_size=1"],
        env={**os.environ, "XLA_FLAGS": flags, "JAX_PLATFORMS": "cpu"}, capture_output=True, text=True,
        timeout=300, cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert result.returncode == 0, result.stderr[-2000:]
    (partitioned,) = dump.glob("*jit_train_step*after_spmd-partitioning*.txt")
    gathers = set(re.findall(r"= (\w+)\[([\d,]*)\]\S* all-gather\(", partitioned.read_text()))
    floats = {(dtype, shape) for dtype, shape in gathers if dtype in ("f32", "bf16")}
    assert ("bf16", "64,128") in floats  # the LM head [d_model, vocab]
    assert len(floats) >= 5 and {dtype for dtype, _ in floats} == {"bf16"}, gathers


def test_cluster_targets(devices):
    from maxtext_rocm.planner import report as compile_cli

    assert compile_cli.parse_target("mi355x:2x8") == ("mi355x", 16)
    assert compile_cli.target_nodes("mi355x:2x8") == 2 and compile_cli.target_nodes("mi355x:8") == 1
    with pytest.raises(ValueError, match="KIND:NODESxGPUS"):
        compile_cli.parse_target("mi355x:2x")
    mesh = compile_cli.cluster_mesh(_mesh_cfg(ici={"fsdp": 2, "tensor": 2}, dcn={"fsdp": 2}), devices, 2)
    # fsdp = 2 nodes x 2: the node is the major factor; tensor pairs neighbours within a node
    assert np.vectorize(lambda d: d.id)(mesh.devices).squeeze().tolist() == [[0, 1], [2, 3], [4, 5], [6, 7]]


def _mesh_cfg(ici, dcn):
    from ml_collections import ConfigDict

    from maxtext_rocm.config import MESH_AXES
    return ConfigDict({"ici": {a: ici.get(a, 1) for a in MESH_AXES}, "dcn": {a: dcn.get(a, 1) for a in MESH_AXES}})


def test_minimum_terms_of_the_other_axes():
    """tensor, expert, sequence and data terms, against their formulas worked out by hand."""
    from ml_collections import ConfigDict

    m = ConfigDict(dict(n_layers=2, d_model=64, n_heads=4, n_kv_heads=2, head_dim=16, mlp_dim=128,
                        vocab_size=128, n_experts=4, experts_per_token=2, tie_embeddings=True, remat="full"))
    train = ConfigDict(dict(per_device_batch_size=2, seq_len=32, grad_accum=1))
    sizes = {"data": 2, "fsdp": 1, "expert": 2, "sequence": 2, "tensor": 1}
    terms = {t["term"]: t for t in comm_minimum.minimum(m, train, "bf16", sizes)["terms"]}
    T = 2 * 32  # tokens per device
    assert terms["expert dispatch/combine"]["cpu_bytes"] == pytest.approx(5 * 2 * 1 / 2 * T * 2 * 64 * 4)
    assert terms["expert dispatch/combine"]["gpu_bytes"] == pytest.approx(5 * 2 * 1 / 2 * T * 2 * 64 * 2)
    assert terms["sequence K/V"]["cpu_bytes"] == pytest.approx(2 * 3 * 2 * 1 * T * 32 * 4)
    assert "embedding" not in terms  # tied: the head's gather serves it
    attention = (2 * 4 + 2 * 2) * 16 * 64
    zero_grads = 2 * (attention + 64 * 4) / 4 + 2 * 3 * 64 * 128 * 4 / (2 * 2) + 64 * 128 / 4
    assert terms["data-parallel gradients"]["cpu_bytes"] == pytest.approx(2 * 1 / 2 * 4 * zero_grads)
    sizes = {"data": 1, "fsdp": 2, "expert": 1, "sequence": 1, "tensor": 4}
    m.update(n_experts=1, remat="none")
    terms = {t["term"]: t for t in comm_minimum.minimum(m, train, "fp32", sizes)["terms"]}
    assert terms["tensor activations"]["cpu_bytes"] == pytest.approx((4 * 2 + 2) * 2 * 3 / 4 * (2 * 32 * 4) * 64 * 4)
    layer = (attention + 3 * 64 * 128) / 4
    assert terms["layer weights"]["cpu_bytes"] == pytest.approx(2 * (1 * 4 + 4) * 1 / 2 * layer)
    # the GPU figure under bf16: weights gathered in bf16, gradients reduce-scattered in fp32; with
    # bf16 parameters the gradients cross in bf16 too
    bf16 = {t["term"]: t for t in comm_minimum.minimum(m, train, "bf16", sizes)["terms"]}
    assert bf16["layer weights"]["cpu_bytes"] == terms["layer weights"]["cpu_bytes"]
    assert bf16["layer weights"]["gpu_bytes"] == pytest.approx(2 * (1 * 2 + 4) * 1 / 2 * layer)
    bf16_params = {t["term"]: t for t in comm_minimum.minimum(m, train, "bf16", sizes, param_bytes=2)["terms"]}
    assert bf16_params["layer weights"]["gpu_bytes"] == pytest.approx(2 * (1 * 2 + 2) * 1 / 2 * layer)
    assert bf16_params["layer weights"]["cpu_bytes"] == terms["layer weights"]["cpu_bytes"]



@pytest.mark.parametrize("remat, g, n_t", [("none", 1, 4), ("full", 2, 5)])
def test_the_stage_recompute_sends_the_forwards_collectives_once_more(remat, g, n_t):
    """gpipe_recompute runs each stage's forward again in its backward: one more gather of the
    stage's weights and two more tensor all-reduces per layer and microbatch (counted in the tiny
    stage=2 x fsdp=2 x tensor=2 program, docs/figures.md "Layout plans": fsdp gathers 30.12 ->
    45.12 MiB, tensor 43.02 -> 63.02 MiB, both at the bubble's (M+S-1)/M over these terms)."""
    from ml_collections import ConfigDict

    m = ConfigDict(dict(n_layers=4, d_model=64, n_heads=4, n_kv_heads=2, head_dim=16, mlp_dim=128,
                        vocab_size=128, n_experts=1, experts_per_token=1, tie_embeddings=False, remat=remat))
    train = ConfigDict(dict(per_device_batch_size=2, seq_len=32, grad_accum=1))
    sizes = {"stage": 2, "fsdp": 2, "tensor": 2}

    def terms(recompute):
        return {t["term"]: t["cpu_bytes"] for t in comm_minimum.minimum(
            m, train, "fp32", sizes, microbatches=4, stage_recompute=recompute)["terms"]}
    gpipe, recompute = terms(False), terms(True)
    A, L, T = 4, 2, 2 * 32 * 2 * 2 / 4  # microbatches, layers per stage, tokens per device per microbatch
    layer = ((2 * 4 + 2 * 2) * 16 * 64 + 3 * 64 * 128) / 2
    assert gpipe["layer weights"] == pytest.approx(A * L * (g * 4 + 4) * 1 / 2 * layer)
    assert recompute["layer weights"] == pytest.approx(A * L * ((g + 1) * 4 + 4) * 1 / 2 * layer)
    assert recompute["tensor activations"] - gpipe["tensor activations"] == pytest.approx(
        A * 2 * L * 2 * 1 / 2 * T * 64 * 4)
    assert recompute["stage activations"] == gpipe["stage activations"]  # the permutes do not repeat
    assert recompute["LM head"] == gpipe["LM head"]
