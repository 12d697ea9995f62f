"""`python -m maxtext_rocm.compile ... --plan` (maxtext_rocm/planner/plan.py): the layouts it
enumerates, its state estimate against the exact one, pruning and ranking, its refusals, and one
plan of a tiny model on a fake 2 x 4 target that compiles its best layout."""

import dataclasses
import json
import types

import pytest

from conftest import small_config
from maxtext_rocm.planner import comm_minimum, estimates, plan
from maxtext_rocm.planner import report as compile_cli

TINY = ["--config.model.vocab_size=128", "--config.model.d_model=64", "--config.model.n_layers=2",
        "--config.model.n_heads=4", "--config.model.n_kv_heads=2", "--config.model.head_dim=16",
        "--config.model.mlp_dim=128", "--config.data.source=synthetic", "--config.train.seq_len=32"]


def test_layouts_fill_the_target_and_divide_the_model():
    cfg = small_config()
    layouts = plan.enumerate_layouts(cfg.model, cfg.train, nodes=2, gpus=4)
    meshes = {(x.ici, x.dcn) for x in layouts}
    assert len(layouts) == len(meshes) * len(plan.REMAT_ORDER)
    for ici, dcn in meshes:
        ici, dcn = dict(ici), dict(dcn)
        assert _prod(ici.values()) == 4 and _prod(dcn.values()) == 2
        assert cfg.model.n_kv_heads % ici.get("tensor", 1) == 0
        assert "expert" not in ici  # a dense model
        assert not ("stage" in ici and "stage" in dcn)
    # the layouts a person would try are among them
    assert (((("fsdp", 4),), (("fsdp", 2),))) in meshes
    assert (((("fsdp", 2), ("tensor", 2)), (("stage", 2),))) in meshes
    moe = small_config(**{"model.n_experts": 4, "model.experts_per_token": 2})
    assert any("expert" in dict(x.ici) for x in plan.enumerate_layouts(moe.model, moe.train, nodes=1, gpus=8))


def _prod(values):
    out = 1
    for v in values:
        out *= v
    return out


def test_pipelines_get_microbatches_that_split_a_batch_shard():
    cfg = small_config(**{"train.per_device_batch_size": 2})
    staged = plan.Layout(ici=(("fsdp", 4),), dcn=(("stage", 2),), microbatches=0, remat="full")
    # 2 x 8 sequences over 4 fsdp shards: 4 per shard, so 2 or 4 microbatches (at least the 2 stages),
    # each under every schedule, the fsdp-sharded stage's weights gathered per microbatch and once
    assert [(x.microbatches, x.schedule, x.weight_gather) for x in plan.with_microbatches(staged, cfg, 8)] == [
        (m, s, g) for m in (2, 4) for s in ("gpipe", "1f1b", "gpipe_recompute") for g in ("per_iteration", "once")]
    # without a ZeRO-3 axis there is nothing to gather
    tensor_only = plan.Layout(ici=(("tensor", 4),), dcn=(("stage", 2),), microbatches=0, remat="full")
    assert {x.weight_gather for x in plan.with_microbatches(tensor_only, cfg, 8)} == {"per_iteration"}
    flat = plan.Layout(ici=(("fsdp", 8),), dcn=(), microbatches=0, remat="full")
    assert plan.with_microbatches(flat, cfg, 8) == [flat]
    assert plan.bubble(cfg, plan.with_microbatches(staged, cfg, 8)[0]) == pytest.approx(1 / 3)  # (S-1)/(M+S-1)


@pytest.mark.parametrize("layout", [
    plan.Layout(ici=(("fsdp", 4),), dcn=(("fsdp", 2),), microbatches=0, remat="full"),
    plan.Layout(ici=(("fsdp", 2), ("tensor", 2)), dcn=(("data", 2),), microbatches=0, remat="full"),
    plan.Layout(ici=(("fsdp", 4),), dcn=(("stage", 2),), microbatches=2, remat="full"),
])
def test_state_estimate_matches_the_sharded_state(layout, devices):
    """The estimate counts parameters from the model's dimensions; analyse() reads the abstract
    state's shardings. They agree but for the norm scales the estimate leaves out."""
    from maxtext_rocm.planner.analysis import analyse

    cfg = plan.apply(small_config(**{"train.per_device_batch_size": 2}), layout)
    exact = analyse(cfg, "mi300x", 8, compile_it=False, nodes=2).memory
    exact_state = exact.params_bytes + exact.opt_state_bytes + exact.gradients_bytes
    estimated = plan.state_bytes(cfg.model, plan._sizes(layout), cfg.train.grad_accum)
    assert estimated <= exact_state
    assert estimated == pytest.approx(exact_state, rel=0.03)


def _candidate(ici, remat, fits=True, compute=1.0, comm=1.0, compiled=False):
    layout = plan.Layout(ici=ici, dcn=(), microbatches=0, remat=remat)
    return plan.Candidate(layout=layout, memory_bytes=1.0, usable_bytes=2.0, fits=fits, compute_s=compute,
                          comm_s=comm, bubble=0.0, compiled=compiled)


def test_prune_keeps_each_mesh_at_its_least_recompute_and_ranks_by_step_time():
    fsdp, tensor = (("fsdp", 8),), (("fsdp", 4), ("tensor", 2))
    candidates = [
        _candidate(fsdp, "full", compute=1.3, comm=0.2),
        _candidate(fsdp, "minimal", compute=1.1, comm=0.2),
        _candidate(fsdp, "none", fits=False, compute=1.0, comm=0.2),  # faster, but does not fit
        _candidate(tensor, "full", compute=1.0, comm=0.05),
        _candidate((("data", 8),), "full", fits=False),
    ]
    ranked = plan.prune(candidates)
    assert [(c.layout.ici, c.layout.remat) for c in ranked] == [(tensor, "full"), (fsdp, "minimal")]
    # A compiled layout outranks an estimated one, and one that turned out not to fit drops to the end.
    ranked[1].compiled = True
    ranked.append(_candidate((("data", 8),), "full", fits=False, compute=0.1, comm=0.0, compiled=True))
    assert [c.layout.ici for c in sorted(ranked, key=plan.rank_key)] == [fsdp, tensor, (("data", 8),)]


def test_a_memory_bound_pipeline_picks_gpipe_recompute_and_says_so():
    """GPipe's activations grow with the loop's M + S - 1 iterations, gpipe_recompute's do not: where
    only the latter fits, the plan keeps it, and its row and command name the schedule. Where both
    fit, GPipe wins on compute (no stage recompute)."""
    cfg = small_config(**{"train.per_device_batch_size": 8, "train.seq_len": 256, "model.remat": "none"})
    staged = plan.Layout(ici=(("fsdp", 4),), dcn=(("stage", 2),), microbatches=16, remat="none")
    by_schedule = {s: plan.estimate(cfg, dataclasses.replace(staged, schedule=s), "mi300x", 8, 0.92)
                   for s in plan.SCHEDULES}
    gpipe, recompute = by_schedule["gpipe"], by_schedule["gpipe_recompute"]
    assert recompute.memory_bytes < gpipe.memory_bytes and recompute.compute_s > gpipe.compute_s
    assert recompute.bubble == gpipe.bubble
    assert plan.prune([gpipe, recompute]) == [gpipe]
    gpipe.fits = False  # as if the target were smaller
    assert plan.prune([gpipe, recompute]) == [recompute]
    assert "gpipe_recompute, 16 microbatches" in recompute.layout.describe()
    assert "--config.pipeline.schedule=gpipe_recompute" in recompute.layout.overrides()


def test_stage_weights_gathered_once_cost_their_memory_and_save_their_gathers():
    """pipeline.weight_gather="once": the same compute, the stage's weights held whole (the fit
    check's "gathered stage weights") for fewer bytes moved. Both forms stay in the plan, so the
    per-microbatch one is there if the gathered weights do not fit once compiled; the row and the
    command say which."""
    cfg = small_config(**{"train.per_device_batch_size": 8, "train.seq_len": 256})
    staged = plan.Layout(ici=(("fsdp", 4),), dcn=(("stage", 2),), microbatches=16, remat="full", schedule="1f1b")
    each, once = (plan.estimate(cfg, dataclasses.replace(staged, weight_gather=g), "mi300x", 8, 0.92)
                  for g in plan.WEIGHT_GATHERS)
    held = estimates.gathered_stage_weights_bytes(plan.apply(cfg, once.layout), plan._sizes(once.layout))
    assert held > 0 and once.memory_bytes == pytest.approx(each.memory_bytes + held, rel=1e-12)
    assert once.compute_s == each.compute_s and once.comm_s < each.comm_s
    assert plan.prune([each, once]) == sorted([each, once], key=plan.rank_key)
    once.fits = False
    assert plan.prune([each, once]) == [each]
    assert "1f1b, 16 microbatches, stage weights gathered once" in once.layout.describe()
    assert "--config.pipeline.weight_gather=once" in once.layout.overrides()
    assert not any("weight_gather" in flag for flag in each.layout.overrides())


def test_interleaved_1f1b_trades_its_bubble_for_boundary_traffic_and_both_stay_in_the_plan():
    """pipeline.repeats=2 under 1f1b: the bubble (S-1)/(R M+S-1) and the layers' dots with it, for
    R times the stage activations in the communication minimum. Plain and interleaved stay apart
    in pruning, so the ranking (compute + communication) chooses; the row and command say which.
    Offered only where the microbatches are whole groups of the stages."""
    cfg = small_config(**{"train.per_device_batch_size": 8, "train.seq_len": 256, "model.n_layers": 4})
    staged = plan.Layout(ici=(("fsdp", 4),), dcn=(("stage", 2),), microbatches=4, remat="full", schedule="1f1b")
    plain, interleaved = (plan.estimate(cfg, dataclasses.replace(staged, repeats=r), "mi300x", 8, 0.92)
                          for r in (1, 2))
    assert plain.bubble == pytest.approx(1 / 5) and interleaved.bubble == pytest.approx(1 / 9)
    assert interleaved.compute_s < plain.compute_s
    stage_bytes = {}
    for c in (plain, interleaved):
        least = comm_minimum.minimum(cfg.model, cfg.train, "bf16", plan._sizes(c.layout), microbatches=4,
                                     **comm_minimum.pipeline_options(plan.apply(cfg, c.layout).pipeline))
        stage_bytes[c.layout.repeats] = sum(t["gpu_bytes"] for t in least["terms"] if t["axes"] == "stage")
    assert stage_bytes[2] == pytest.approx(2 * stage_bytes[1], rel=1e-12) and stage_bytes[1] > 0
    assert plan.prune([plain, interleaved]) == sorted([plain, interleaved], key=plan.rank_key)
    assert "1f1b interleaved x2, 4 microbatches" in interleaved.layout.describe()
    assert "--config.pipeline.repeats=2" in interleaved.layout.overrides()
    offered = plan.with_microbatches(plan.Layout(ici=(("fsdp", 4),), dcn=(("stage", 2),), microbatches=0,
                                                 remat="full"), cfg, 8)
    assert {(x.microbatches, x.repeats) for x in offered if x.schedule == "1f1b"} == {
        (2, 1), (2, 2), (4, 1), (4, 2), (8, 1), (8, 2)}


def test_plan_compiles_at_most_max_compiles_and_reranks_on_what_it_measured():
    cfg = small_config(**{"train.per_device_batch_size": 2})
    calls = []

    def fake_analyse(trial, kind, n, usable, comm, nodes):  # the first compiled layout turns out not to fit
        calls.append(trial)
        memory = types.SimpleNamespace(analytic_total_bytes=1.0, checkpoint_save_peak_bytes=None)
        comm_report = {"ratio": 1.0, "bytes_by_link": {"ICI": 0.0, "DCN": 0.0}, "minimum": {"terms": []}}
        return types.SimpleNamespace(memory=memory, fits=len(calls) > 1, comm=comm_report)

    found = plan.make_plan(cfg, "tiny_llama", "mi300x", 2, 4, 0.92, 2, [], analyse=fake_analyse,
                           log=lambda *a, **k: None)
    assert len(calls) == 2 and found.fitting == len(found.ranked)
    compiled = [c for c in found.ranked if c.compiled]
    assert found.ranked[0].compiled and found.ranked[0].fits  # the second one compiled, and fits
    assert compiled[-1] is found.ranked[-1] and not compiled[-1].fits
    assert found.ranked[0].command.startswith("python -m maxtext_rocm.train tiny_llama --config.mesh.ici.fsdp=")


@pytest.mark.parametrize("flags, says", [
    (["--comm"], "drop --comm"),
    (["--search"], "drop --search"),
    (["--config.mesh.ici.fsdp=2"], "drop --config.mesh.ici.fsdp"),
    (["--config.model.remat=full"], "drop --config.model.remat"),
    (["--config.pipeline.schedule=gpipe"], "drop --config.pipeline.schedule"),
    (["--config.pipeline.weight_gather=once"], "drop --config.pipeline.weight_gather"),
    (["--max-compiles=-1"], "--max-compiles"),
])
def test_flags_plan_cannot_take_are_refused(flags, says, capsys):
    assert compile_cli.main(["tiny_llama", "--target=mi300x:2x4", "--plan", *flags]) == 2
    error = capsys.readouterr().err.strip()
    assert error.startswith("error: ") and says in error and error.count("\n") == 0


@pytest.mark.slow  # one real compile (~40 s); make_plan's logic is tested above with a stub compile
def test_plan_of_a_tiny_model_on_a_fake_cluster(tmp_path, devices, capsys):
    out = tmp_path / "plan.json"
    assert compile_cli.main(["tiny_llama", "--target=mi300x:2x4", "--plan", "--max-compiles=1", f"--json={out}",
                             *TINY]) == 0
    printed = capsys.readouterr().out
    assert "[1/1]" in printed and printed.count("\n1. ") == 1
    ranked = json.loads(out.read_text())["ranked"]
    assert ranked[0]["compiled"] and ranked[0]["fits"] and ranked[0]["comm_ratio"] >= 1 - 1e-9
    assert [r["compiled"] for r in ranked].count(True) == 1
    steps = [r["compute_s"] + r["comm_s"] for r in ranked[1:]]
    assert steps == sorted(steps)  # the estimated rest, best first
    assert all(r["command"].startswith("python -m maxtext_rocm.train tiny_llama ") for r in ranked)
