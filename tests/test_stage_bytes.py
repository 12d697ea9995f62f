"""The pipeline's bytes over DCN counted twice: comm.py's report against scripts/dcn_bytes.py's
separate walk of the same HLO, and both against what the schedule must send (maxtext_rocm/parallel/pipeline/)."""

import os
import sys

import pytest

from conftest import small_config
from helpers import script_module
from maxtext_rocm.planner import report as compile_lib


def _dcn_bytes():
    return script_module("dcn_bytes")


def _compiled_with_its_hlo(cfg, nodes: int) -> tuple:
    """The planner's report of `cfg` on 8 fake devices over `nodes` nodes, the optimized HLO it
    counted and the jit's device assignment (partition p is device_ids[p])."""
    with _dcn_bytes().what_comm_counts() as seen:
        report = compile_lib.analyse(cfg, "mi355x", 8, comm=True, nodes=nodes)
    return report, seen["text"], seen["device_ids"]


@pytest.mark.parametrize("case", ["untied", "tied", "head on every stage"])
def test_the_stage_axis_dcn_bytes_agree_with_a_separate_count_and_the_schedule(case, devices):
    """tiny Llama, 2 nodes of 4: dcn.stage=2 x ici.fsdp=4, GPipe with M=4 (fp32, so the CPU's
    dtypes are the program's). comm.py's DCN figure equals dcn_bytes.py's, and what crosses `stage`
    is what the schedule says must: the inter-stage permutes, and once a step what is replicated
    over `stage`. The loss runs on the last stage (pipeline.layout.loss_on_the_last_stage) and an
    untied table and head are stored on their stages, so only the final norm's scale is summed
    there; a tied table's gradient is summed twice (its lookups', its head's); without the fused
    loss (model.loss_chunk_len=0) the last stage's outputs go to every stage (pipeline.transfers.from_stage)."""
    S, M, fsdp, batch, seq, d = 2, 4, 4, 2, 32, 64
    cfg = small_config(**{"mesh.dcn.stage": S, "mesh.ici.fsdp": fsdp, "mesh.ici.stage": 1, "model.n_layers": 4,
                          "model.remat": "full", "train.per_device_batch_size": batch, "pipeline.microbatches": M,
                          "model.tie_embeddings": case == "tied",
                          **({"model.loss_chunk_len": 0} if case == "head on every stage" else {})})
    cfg.model.attention = "xla"
    report, text, device_ids = _compiled_with_its_hlo(cfg, 2)
    ops = _dcn_bytes().dcn_count(text, device_ids, 8 // 2)
    assert report.comm["bytes_by_link"]["DCN"] == pytest.approx(sum(o.bytes_per_step for o in ops), rel=1e-12)
    assert report.comm["stages"]["link"] == "DCN"
    assert not any(r["link"] == "DCN" and "stage" not in r["axes"] for r in report.comm["rows"])

    # What the schedule sends, fp32. A stage's devices see the whole batch (it is not split over
    # `stage`): per device S * batch sequences of its fsdp shard, in M microbatches.
    sequences = S * batch
    whole_batch = sequences * seq * d * 4  # [B, seq, d] of one device
    microbatch = whole_batch // M
    ring = 2 * (S - 1) / S  # an all-reduce over `stage`
    table_shard = 128 * d // fsdp * 4  # each device's [V, d/fsdp]
    expected = {
        # M + S - 1 iterations, each sending a microbatch forward and, transposed, its cotangent back
        ("collective-permute", "forward", "ppermute"): (M + S - 1) * microbatch,
        ("collective-permute", "backward", "ppermute"): (M + S - 1) * microbatch,
    }
    if case == "untied":  # the final norm's scale, [d], whole on every device
        expected[("all-reduce", "forward", "reduce_sum)")] = ring * d * 4
    elif case == "tied":  # the table's gradient from its lookups and from its use as the head, and the scale's
        expected[("all-reduce", "backward", "reduce_sum)")] = ring * (2 * table_shard + d * 4)
    else:  # the last stage's outputs to every stage, whose head and loss run on them alike
        expected[("all-reduce", "forward", "psum_invariant")] = ring * whole_batch
    by_origin, scalars = {}, 0.0
    for o in ops:
        if o.bytes_once <= 8:  # a scalar: the loss's, the gradient norm's, an fp32 sum's count
            scalars += o.bytes_per_step
            continue
        key = (o.kind, "backward" if "transpose(" in o.op_name else "forward", o.op_name.rsplit("/", 1)[-1])
        by_origin[key] = by_origin.get(key, 0.0) + o.bytes_per_step
    assert by_origin == expected
    assert scalars <= 64


def test_the_separate_count_reads_each_form_of_replica_groups():
    """dcn_bytes.groups_of against groups written out by hand, in the three forms XLA prints."""
    groups_of = _dcn_bytes().groups_of
    assert groups_of("replica_groups={{0,2},{1,3}}, to_apply=%add", 4) == [[0, 2], [1, 3]]
    assert groups_of("replica_groups=[2,2]<=[2,2]T(1,0), to_apply=%add", 4) == [[0, 2], [1, 3]]
    assert groups_of("replica_groups=[2,2]<=[4], to_apply=%add", 4) == [[0, 1], [2, 3]]
    # a 2 x 4 mesh of partitions, groups along its first axis
    assert groups_of("replica_groups=mesh['axis_0'=2,'axis_1'=4] {'axis_0'}, dims", 8) == [
        [0, 4], [1, 5], [2, 6], [3, 7]]
    # the same mesh laid over the partitions transposed: position (i, j) is partition 2j + i
    assert groups_of("replica_groups=mesh['axis_0'=2,'axis_1'=4], device_ids=([4,2]T(1,0)) {'axis_1'}", 8) == [
        [0, 2, 4, 6], [1, 3, 5, 7]]
    assert groups_of("channel_id=3, to_apply=%add", 4) == [[0, 1, 2, 3]]


@pytest.mark.slow  # ~20 s: compiles 405B for 64 fake devices in its own process
def test_the_405b_pipelines_dcn_figure_is_counted_alike_twice():
    """docs/figures.md, "The stage axis's bytes, counted twice": 405B:fp8 on 8 nodes of 8,
    dcn.stage=8 x ici.fsdp=8. The report read 30.7 GiB while the program moved 34.2 (issue #32);
    23.7 since each stage looks the tokens up itself; 22.0 since the untied table is stored on the
    first stage (its gradient's all-reduce over `stage` gone); 15.0 since the loss runs on the last
    stage (the last stage's outputs no longer go to every stage)."""
    import re
    import subprocess
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    done = subprocess.run([sys.executable, os.path.join(root, "scripts", "dcn_bytes.py"),
                           "configs/llama3_1_405b.py:fp8", "--target=mi355x:8x8", "--config.mesh.dcn.stage=8",
                           "--config.mesh.ici.fsdp=8"], cwd=root, capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": root, "XLA_FLAGS": ""})
    assert done.returncode == 0, done.stderr[-2000:]
    figures = re.search(r"comm.py ([\d.]+) GiB, counted again ([\d.]+) GiB", done.stdout)
    assert figures.group(1) == figures.group(2) == "15.0091"
