"""pipeline.weight_gather="once" and pipeline.gradient_reduce="once" (maxtext_rocm/parallel/
pipeline/gather.py) on 8 fake devices: one device's loss and gradients under gpipe and
gpipe_recompute (circular, data, tensor, accumulation, fp8 delayed scaling and Mixtral's experts in
the slow run), and the compiled step's fsdp traffic for the stage's weights down from g (M + S - 1)
gathers and M + S - 1 reduce-scatters a step to one of each, counted by comm.py against the figures
worked out here."""

import jax
import numpy as np
import pytest

from maxtext_rocm.config import checks
from maxtext_rocm.planner import comm_minimum, report as compile_lib
from maxtext_rocm.train import Trainer

from conftest import small_config
from helpers import assert_close, loss_and_grads
from test_pipeline import CIRCULAR, SINGLE, llama, mixtral, on_mesh, one_device  # noqa: F401 - a fixture

ONCE = {"pipeline.weight_gather": "once"}
REDUCED_ONCE = {**ONCE, "pipeline.gradient_reduce": "once"}
# gradient_reduce="once" is refused on jax >= 0.11 (config/checks.py: XLA aborts its nested shard_maps)
RUNS_REDUCED_ONCE = pytest.mark.skipif(checks.installed_jax() >= (0, 11),
                                       reason="pipeline.gradient_reduce='once' is refused on this jax")
RECOMPUTE = {"pipeline.schedule": "gpipe_recompute"}


@pytest.mark.parametrize("mesh, overrides", [
    ({"stage": 2, "fsdp": 4}, ONCE),
    pytest.param({"stage": 4, "fsdp": 2}, {**REDUCED_ONCE, **RECOMPUTE}, marks=RUNS_REDUCED_ONCE),
    pytest.param({"stage": 2, "fsdp": 4}, REDUCED_ONCE, marks=[pytest.mark.slow, RUNS_REDUCED_ONCE]),
    pytest.param({"stage": 4, "fsdp": 2}, {**ONCE, **RECOMPUTE}, marks=pytest.mark.slow),
    pytest.param({"stage": 2, "fsdp": 4}, {**ONCE, **RECOMPUTE}, marks=pytest.mark.slow),
    pytest.param({"stage": 2, "fsdp": 2, "tensor": 2}, ONCE, marks=pytest.mark.slow),
    pytest.param({"stage": 2, "data": 2, "fsdp": 2}, REDUCED_ONCE, marks=[pytest.mark.slow, RUNS_REDUCED_ONCE]),
    pytest.param({"stage": 2, "fsdp": 2, "tensor": 2}, {**REDUCED_ONCE, "train.grad_accum": 2}, marks=[pytest.mark.slow, RUNS_REDUCED_ONCE]),
    pytest.param({"stage": 2, "fsdp": 4}, {**ONCE, **CIRCULAR}, marks=pytest.mark.slow),
    pytest.param({"stage": 2, "fsdp": 4}, {**REDUCED_ONCE, **CIRCULAR}, marks=[pytest.mark.slow, RUNS_REDUCED_ONCE]),
])
def test_gathering_once_matches_one_device(mesh, overrides, one_device, devices, tmp_path):  # noqa: F811
    loss, grads, _ = loss_and_grads(on_mesh(llama, mesh, tmp_path, **overrides), devices)
    ref_loss, ref_grads, _ = one_device
    assert_close(loss, ref_loss)
    assert_close(grads, ref_grads)


@pytest.mark.slow  # two compilations
def test_a_padded_stack_gathered_once_matches_the_per_iteration_gather(devices, tmp_path):
    """3 layers on 2 stages (one empty slot, run on zeros): the same loss and gradients."""
    runs = [loss_and_grads(on_mesh(llama, {"stage": 2, "fsdp": 4}, tmp_path / name, **{"model.n_layers": 3}, **extra),
                           devices) for name, extra in (("per_iteration", {}), ("once", ONCE))]
    assert_close(runs[1][0], runs[0][0])
    assert_close(runs[1][1], runs[0][1])


@pytest.mark.slow  # about a minute each on 2 cores
@pytest.mark.parametrize("moe_impl", ["capacity", "dropless"])
def test_mixtral_experts_gathered_once_match_one_device(moe_impl, devices, tmp_path):
    """stage=2 x expert=2 x fsdp=2: the experts' weights keep their `expert` split and are gathered
    over fsdp only, the dense weights over fsdp and expert; under dropless they enter the expert
    exchange's shard_map (experts.py) gathered."""
    ref = mixtral(**SINGLE, **{"train.per_device_batch_size": 8, "train.grad_accum": 2,
                               "output_dir": str(tmp_path / "one")})
    ref_loss, ref_grads, _ = loss_and_grads(ref, devices[:1])
    loss, grads, _ = loss_and_grads(on_mesh(mixtral, {"stage": 2, "expert": 2, "fsdp": 2}, tmp_path / "pp", **ONCE,
                                            **{"model.moe_impl": moe_impl}), devices)
    assert_close(loss, ref_loss)
    assert_close(grads, ref_grads)


@pytest.mark.slow  # fp8 steps compiled twice
@pytest.mark.parametrize("schedule", [{}, RECOMPUTE])
def test_fp8_delayed_scaling_with_weights_gathered_once_trains_like_per_iteration(schedule, devices, tmp_path):
    """Three fp8 steps: losses, delayed-scaling state and weights as the per-iteration gather's."""
    fp8 = {"precision.policy": "fp8", "precision.fp8_scaling": "delayed", **schedule}
    runs = [Trainer(on_mesh(llama, {"stage": 2, "fsdp": 4}, tmp_path / name, **fp8, **extra), devices=devices,
                    log=lambda *_: None) for name, extra in (("per_iteration", {}), ("once", ONCE))]
    for _ in range(3):
        per_iteration, once = (float(r.step()["loss"]) for r in runs)
        assert_close(once, per_iteration)
    assert_close(*(jax.tree_util.tree_map(np.asarray, r.state.fp8) for r in runs[::-1]))
    assert_close(*(jax.tree_util.tree_map(np.asarray, r.state.params) for r in runs[::-1]))


def _fsdp_bytes(report, kind: str) -> float:
    return sum(row["bytes"] for row in report.comm["rows"] if row["kind"] == kind and row["axes"] == "fsdp")


def _analysed(**overrides):
    """stage=2 x fsdp=4, 4 layers (2 a stage), 4 microbatches, remat full, fp32, compiled."""
    cfg = small_config(**{"mesh.ici.stage": 2, "mesh.ici.fsdp": 4, "model.n_layers": 4, "model.remat": "full",
                          "train.per_device_batch_size": 2, "pipeline.microbatches": 4, **overrides})
    cfg.model.attention = "xla"
    return compile_lib.analyse(cfg, "mi355x", 8, comm=True)


LAYER = 64 * 64 + 2 * 64 * 32 + 64 * 64 + 3 * 64 * 128  # q, k, v, o, gate, up, down
STAGE_GATHER = 3 / 4 * 2 * LAYER * 4  # a stage's 2 layers in fp32; each device receives the 3 shards it lacks
HEAD_TABLE_GATHER = 3 / 4 * 64 * 128 * 4  # the LM head's [d, vocab], gathered (and reduce-scattered) once
# What each stage looks its tokens up in and with (pipeline.embedding.embedded_per_stage): the embedding
# table [vocab, d], gathered over fsdp like the head's, and the batch's 16 x 32 int32 token ids,
# of which each device holds its fsdp shard.
EMBED_TABLE_GATHER = HEAD_TABLE_GATHER
TOKEN_IDS_GATHER = 3 / 4 * 16 * 32 * 4
ITERATIONS = 4 + 2 - 1  # M + S - 1


def _assert_gathered_once(report):
    """The stage's weights gathered once, the LM head's and the embedding's tables and the token ids."""
    gathered = _fsdp_bytes(report, "all-gather")
    assert gathered == pytest.approx(STAGE_GATHER + HEAD_TABLE_GATHER + EMBED_TABLE_GATHER + TOKEN_IDS_GATHER,
                                     rel=1e-9)


@RUNS_REDUCED_ONCE
@pytest.mark.parametrize("schedule", [{}, pytest.param(RECOMPUTE, marks=pytest.mark.slow)])
def test_the_stage_weights_and_their_gradient_cross_fsdp_once_a_step(schedule):
    """gradient_reduce="once": the compiled step's fsdp traffic for the stage is one gather and
    one reduce-scatter of its weights a step, its minimum (the head's table too, once each)."""
    report = _analysed(**REDUCED_ONCE, **schedule)
    _assert_gathered_once(report)
    assert _fsdp_bytes(report, "reduce-scatter") == pytest.approx(STAGE_GATHER + HEAD_TABLE_GATHER, rel=1e-9)
    least = {t["term"]: t["cpu_bytes"] for t in report.comm["minimum"]["terms"]}
    assert least["layer weights"] == pytest.approx(2 * STAGE_GATHER)  # one gather, one reduce-scatter
    # memory: the stage's two layers held whole in fp32 for the step, and each device's own gradient sum
    terms = report.memory.analytic_activation_terms_bytes
    assert terms["gathered stage weights"] == terms["unreduced stage gradient"] == 2 * LAYER * 4


@pytest.mark.slow  # CI budget (~30 s): two more compiles
def test_gathering_once_saves_all_but_one_of_the_per_iteration_gathers():
    """Per iteration the loop gathers each of the stage's layers twice (forward, remat's
    recompute) in each of its M + S - 1 iterations: weight_gather="once" saves g (M + S - 1) - 1 =
    9 of the 10 stage gathers and nothing else; the gradient stays reduce-scattered in every
    iteration (M + S - 1 times the stage's, and the head's once) unless gradient_reduce="once"."""
    per_iteration, once = _analysed(), _analysed(**ONCE)
    saved = _fsdp_bytes(per_iteration, "all-gather") - _fsdp_bytes(once, "all-gather")
    assert saved == pytest.approx((2 * ITERATIONS - 1) * STAGE_GATHER, rel=1e-9)
    _assert_gathered_once(once)
    assert _fsdp_bytes(once, "reduce-scatter") == _fsdp_bytes(per_iteration, "reduce-scatter")
    assert _fsdp_bytes(once, "reduce-scatter") == pytest.approx(ITERATIONS * STAGE_GATHER + HEAD_TABLE_GATHER, rel=1e-9)
    least = {t["term"]: t["cpu_bytes"] for t in once.comm["minimum"]["terms"]}
    assert least["layer weights"] == pytest.approx((1 + 4) * STAGE_GATHER)  # one gather, M reduce-scatters
    assert least == {**{t["term"]: t["cpu_bytes"] for t in per_iteration.comm["minimum"]["terms"]},
                     "layer weights": least["layer weights"]}
    assert "gathered stage weights" not in per_iteration.memory.analytic_activation_terms_bytes
    assert "unreduced stage gradient" not in once.memory.analytic_activation_terms_bytes


def test_the_minimum_gathers_once_per_accumulated_micro_batch():
    """comm_minimum under weight_gather="once": A_head (train.grad_accum) gathers of the stage's
    weights, whatever M, in the parameters' 4 bytes on the GPU too; their gradient reduce-scattered
    once per microbatch (A_head x M), or A_head times under gradient_reduce="once"."""
    cfg = small_config(**{"model.n_layers": 4, "train.grad_accum": 2, "precision.policy": "bf16"})
    P_l = 64 * 64 + 2 * 64 * 32 + 64 * 64 + 3 * 64 * 128

    def layer_term(**pipeline):
        least = comm_minimum.minimum(cfg.model, cfg.train, "bf16", {"stage": 2, "fsdp": 4}, microbatches=8,
                                     weight_gather="once", **pipeline)
        return {t["term"]: t for t in least["terms"]}["layer weights"]
    for reduces, term in ((2 * 8, layer_term()), (2, layer_term(gradient_reduce="once"))):
        assert term["cpu_bytes"] == term["gpu_bytes"] == pytest.approx(2 * (2 * 4 + reduces * 4) * 3 / 4 * P_l)
