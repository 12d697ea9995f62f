"""The schedules whose backward is written by hand, pipeline.schedule="gpipe_recompute"
(maxtext_rocm/parallel/pipeline/gpipe_recompute.py) and "1f1b" (pipeline/one_f_one_b.py), on 8 fake devices:
each gives one device's loss and gradients and composes like GPipe (tensor, experts, accumulation,
remat, fp8 delayed state, padded stacks); gpipe_recompute keeps one microbatch's layer residuals
per stage where GPipe's autodiff keeps every iteration's (the compiled programs' memory; 1f1b's:
tests/test_pipeline_1f1b.py)."""

import jax
import numpy as np
import pytest

from maxtext_rocm.train import Trainer

from helpers import assert_close, loss_and_grads, temporaries_bytes
from test_pipeline import SINGLE, llama, mixtral, on_mesh, one_device  # noqa: F401 - a fixture

RECOMPUTE = {"pipeline.schedule": "gpipe_recompute"}
ONE_F_ONE_B = {"pipeline.schedule": "1f1b"}
HAND_WRITTEN = [pytest.param(RECOMPUTE, id="gpipe_recompute"), pytest.param(ONE_F_ONE_B, id="1f1b")]


@pytest.mark.parametrize("schedule", HAND_WRITTEN)
@pytest.mark.parametrize("mesh", [
    {"stage": 4, "fsdp": 2},
    pytest.param({"stage": 2, "fsdp": 2, "tensor": 2}, marks=pytest.mark.slow),
])
def test_hand_written_backwards_match_one_device(mesh, schedule, one_device, devices, tmp_path):  # noqa: F811
    """M = 2 x S microbatches by default (8 sequences over the batch shards)."""
    cfg = on_mesh(llama, mesh, tmp_path, **schedule)
    loss, grads, run = loss_and_grads(cfg, devices)
    assert run.cfg.pipeline.microbatches >= mesh["stage"]  # as resolved for the mesh
    ref_loss, ref_grads, _ = one_device
    assert_close(loss, ref_loss)
    assert_close(grads, ref_grads)


@pytest.mark.slow  # a compilation each
@pytest.mark.parametrize("mesh, overrides", [
    ({"stage": 2, "fsdp": 2, "tensor": 2}, {"train.grad_accum": 2}),
    ({"stage": 2, "fsdp": 4}, {"model.remat": "minimal"}),
    ({"stage": 2, "fsdp": 4}, {"model.remat": "save_dots"}),
    ({"stage": 4, "fsdp": 2}, {"model.remat": "none", "pipeline.microbatches": 2}),  # fewer than the stages
])
@pytest.mark.parametrize("schedule", HAND_WRITTEN)
def test_hand_written_backwards_compose_with_accumulation_and_remat(mesh, overrides, schedule, one_device, devices,  # noqa: F811
                                                                     tmp_path):
    loss, grads, _ = loss_and_grads(on_mesh(llama, mesh, tmp_path, **schedule, **overrides), devices)
    ref_loss, ref_grads, _ = one_device
    assert_close(loss, ref_loss)
    assert_close(grads, ref_grads)


@pytest.mark.slow  # about a minute on 2 cores
@pytest.mark.parametrize("overrides", [{}, {"model.moe_impl": "dropless"}])
@pytest.mark.parametrize("schedule", HAND_WRITTEN)
def test_hand_written_backwards_mixtral_with_expert_parallelism_matches_one_device(overrides, schedule, devices,
                                                                                   tmp_path):
    """stage=2 x expert=2 x fsdp=2; the router losses' cotangents reach each microbatch's backward.
    The reference accumulates 2 micro-batches, as the pipeline's router losses are per microbatch."""
    ref = mixtral(**SINGLE, **{"train.per_device_batch_size": 8, "train.grad_accum": 2,
                               "output_dir": str(tmp_path / "one")}, **overrides)
    ref_loss, ref_grads, ref_run = loss_and_grads(ref, devices[:1])
    cfg = on_mesh(mixtral, {"stage": 2, "expert": 2, "fsdp": 2}, tmp_path / "pp", **schedule, **overrides)
    loss, grads, run = loss_and_grads(cfg, devices)
    assert run.cfg.pipeline.microbatches == 2
    assert_close(loss, ref_loss)
    assert_close(grads, ref_grads)
    assert_close(float(run.sums["moe_aux_loss"]), float(ref_run.sums["moe_aux_loss"]))


@pytest.mark.slow  # a second model compiled for the reference
@pytest.mark.parametrize("schedule", HAND_WRITTEN)
def test_hand_written_backwards_on_a_stack_that_does_not_divide_match_one_device(schedule, devices, tmp_path):
    three = {"model.n_layers": 3}
    ref_loss, ref_grads, _ = loss_and_grads(
        llama(**SINGLE, **three, **{"train.per_device_batch_size": 8, "output_dir": str(tmp_path / "one")}), devices[:1])
    loss, grads, run = loss_and_grads(on_mesh(llama, {"stage": 2, "fsdp": 4}, tmp_path / "pp", **three, **schedule),
                                      devices)
    assert_close(loss, ref_loss)
    assert_close(grads, ref_grads)
    for g in jax.tree_util.tree_leaves(run.stored_grads["layers"]):  # the empty slot learns nothing
        assert not np.any(g[3])


@pytest.mark.slow  # fp8 steps compiled twice
@pytest.mark.parametrize("schedule, steps, weights_scale", [
    pytest.param(RECOMPUTE, 3, 1e-5, id="gpipe_recompute"),
    # 1f1b runs the loss's head per microbatch, whose matmuls XLA blocks differently: the last bits
    # of the gradients it sends back decide fp8 roundings, and a third step's amax histories part
    # by up to 12% on the first stage. Adam's update is the gradient's sign where it is small, so a
    # bf16 rounding in the head's gradient moves such a weight by up to lr (4e-5 of 0.3 here).
    pytest.param(ONE_F_ONE_B, 2, 1e-3, id="1f1b"),
])
def test_hand_written_backwards_fp8_delayed_scaling_trains_like_gpipe(schedule, steps, weights_scale, devices,
                                                                       tmp_path):
    """The fp8 state's updates come back per iteration from the hand-written backward and merge
    over the real microbatches as under GPipe: the steps give GPipe's losses, state and weights."""
    fp8 = {"precision.policy": "fp8", "precision.fp8_scaling": "delayed"}
    runs = [Trainer(on_mesh(llama, {"stage": 2, "fsdp": 4}, tmp_path / name, **fp8, **extra), devices=devices,
                    log=lambda *_: None) for name, extra in (("gpipe", {}), ("hand_written", schedule))]
    for _ in range(steps):
        gpipe, hand_written = (float(r.step()["loss"]) for r in runs)
        assert_close(hand_written, gpipe)
    fp8_states = [jax.tree_util.tree_map(np.asarray, r.state.fp8) for r in runs]
    assert_close(fp8_states[1], fp8_states[0])
    assert_close(*(jax.tree_util.tree_map(np.asarray, r.params_in_model_order()) for r in runs[::-1]),
                 scale=weights_scale)


@pytest.mark.slow  # four compilations
def test_gpipe_recompute_temporaries_stay_flat_in_the_microbatches_where_gpipes_grow(devices, tmp_path):
    """stage=2 x fsdp=4, 8 layers, remat none, one sequence per batch shard per microbatch: from 2 to
    8 microbatches GPipe's saved activations grow with M (every iteration's residuals), gpipe_recompute's
    stay one microbatch's residuals per stage plus a stage input per microbatch."""
    temp = {}
    for schedule in ("gpipe", "gpipe_recompute"):
        for micro in (2, 8):
            cfg = on_mesh(llama, {"stage": 2, "fsdp": 4}, tmp_path / f"{schedule}{micro}", **{
                "model.n_layers": 8, "model.remat": "none", "pipeline.schedule": schedule,
                "pipeline.microbatches": micro, "train.per_device_batch_size": micro // 2})
            temp[schedule, micro] = temporaries_bytes(cfg, devices)
    gpipe_growth, one_f_one_b_growth = (temp[s, 8] - temp[s, 2] for s in ("gpipe", "gpipe_recompute"))
    assert temp["gpipe", 8] > 1.8 * temp["gpipe", 2], temp
    assert one_f_one_b_growth < 0.25 * gpipe_growth, temp
    assert temp["gpipe_recompute", 8] < 0.6 * temp["gpipe", 8], temp
