"""pipeline.schedule="1f1b" (maxtext_rocm/parallel/pipeline_1f1b.py) on 8 fake devices: the
schedule that runs the loss inside the pipeline gives one device's loss and gradients, composes
like GPipe (tensor, experts, accumulation, remat, fp8 delayed state, padded stacks, weights
gathered once), and keeps at most 2S - 1 microbatches' layer residuals per stage where GPipe's
autodiff keeps every iteration's."""

import jax
import numpy as np
import pytest

from maxtext_rocm.train import Trainer

from helpers import assert_close, initial_run, loss_and_grads
from test_pipeline import SINGLE, llama, mixtral, on_mesh, one_device  # noqa: F401 - a fixture

ONE_F_ONE_B = {"pipeline.schedule": "1f1b"}


@pytest.mark.parametrize("mesh", [
    {"stage": 4, "fsdp": 2},
    {"stage": 2, "fsdp": 2, "tensor": 2},
])
def test_1f1b_matches_one_device(mesh, one_device, devices, tmp_path):  # noqa: F811
    """M = 2 x S microbatches by default (8 sequences over the batch shards)."""
    cfg = on_mesh(llama, mesh, tmp_path, **ONE_F_ONE_B)
    loss, grads, _ = loss_and_grads(cfg, devices)
    assert cfg.pipeline.microbatches >= mesh["stage"]
    ref_loss, ref_grads, _ = one_device
    assert_close(loss, ref_loss)
    assert_close(grads, ref_grads)


@pytest.mark.slow  # a compilation each
@pytest.mark.parametrize("mesh, overrides", [
    ({"stage": 2, "fsdp": 2, "tensor": 2}, {"train.grad_accum": 2}),
    ({"stage": 2, "fsdp": 4}, {"model.remat": "minimal"}),
    ({"stage": 2, "fsdp": 4}, {"model.remat": "save_dots"}),
    ({"stage": 4, "fsdp": 2}, {"model.remat": "none", "pipeline.microbatches": 2}),  # fewer than the stages
    ({"stage": 2, "fsdp": 4}, {"pipeline.weight_gather": "once"}),
    ({"stage": 2, "fsdp": 4}, {"model.tie_embeddings": True}),
])
def test_1f1b_composes_with_accumulation_remat_and_gathered_weights(mesh, overrides, devices, tmp_path):
    ref = llama(**SINGLE, **{k: v for k, v in overrides.items() if k.startswith("model.")},
                **{"train.per_device_batch_size": 8, "output_dir": str(tmp_path / "one")})
    ref_loss, ref_grads, _ = loss_and_grads(ref, devices[:1])
    loss, grads, _ = loss_and_grads(on_mesh(llama, mesh, tmp_path / "pp", **ONE_F_ONE_B, **overrides), devices)
    assert_close(loss, ref_loss)
    assert_close(grads, ref_grads)


@pytest.mark.slow  # a compilation each
@pytest.mark.parametrize("mesh, overrides", [
    ({"stage": 2, "sequence": 2, "fsdp": 2}, {"model.context_parallel": "all_gather"}),
    ({"stage": 2, "sequence": 2, "fsdp": 2}, {"model.context_parallel": "ring"}),
    ({"stage": 2, "data": 2, "fsdp": 2}, {}),
])
def test_1f1b_composes_with_context_parallelism_and_data(mesh, overrides, one_device, devices, tmp_path):  # noqa: F811
    """The tail runs manual over `stage` and the batch axes (data, fsdp); `sequence` stays GSPMD's
    there, and the loss's own shard_map splits the tokens over it."""
    loss, grads, _ = loss_and_grads(on_mesh(llama, mesh, tmp_path, **ONE_F_ONE_B, **overrides), devices)
    ref_loss, ref_grads, _ = one_device
    assert_close(loss, ref_loss)
    assert_close(grads, ref_grads)


@pytest.mark.slow  # about a minute on 2 cores
@pytest.mark.parametrize("overrides", [{}, {"model.moe_impl": "dropless"}])
def test_1f1b_mixtral_with_expert_parallelism_matches_one_device(overrides, devices, tmp_path):
    """stage=2 x expert=2 x fsdp=2; the router losses' cotangents reach each microbatch's backward.
    The reference accumulates 2 micro-batches, as the pipeline's router losses are per microbatch."""
    ref = mixtral(**SINGLE, **{"train.per_device_batch_size": 8, "train.grad_accum": 2,
                               "output_dir": str(tmp_path / "one")}, **overrides)
    ref_loss, ref_grads, ref_run = loss_and_grads(ref, devices[:1])
    cfg = on_mesh(mixtral, {"stage": 2, "expert": 2, "fsdp": 2}, tmp_path / "pp", **ONE_F_ONE_B, **overrides)
    loss, grads, run = loss_and_grads(cfg, devices)
    assert cfg.pipeline.microbatches == 2
    assert_close(loss, ref_loss)
    assert_close(grads, ref_grads)
    assert_close(float(run.sums["moe_aux_loss"]), float(ref_run.sums["moe_aux_loss"]))


@pytest.mark.slow  # a second model compiled for the reference
def test_1f1b_on_a_stack_that_does_not_divide_matches_one_device(devices, tmp_path):
    three = {"model.n_layers": 3}
    ref_loss, ref_grads, _ = loss_and_grads(
        llama(**SINGLE, **three, **{"train.per_device_batch_size": 8, "output_dir": str(tmp_path / "one")}), devices[:1])
    loss, grads, run = loss_and_grads(on_mesh(llama, {"stage": 2, "fsdp": 4}, tmp_path / "pp", **three, **ONE_F_ONE_B),
                                      devices)
    assert_close(loss, ref_loss)
    assert_close(grads, ref_grads)
    for g in jax.tree_util.tree_leaves(run.stored_grads["layers"]):  # the empty slot learns nothing
        assert not np.any(g[3])


@pytest.mark.slow  # fp8 steps compiled twice
def test_1f1b_fp8_delayed_scaling_trains_like_gpipe(devices, tmp_path):
    """The fp8 state's updates come back from each microbatch's backward and merge over the real
    microbatches as under GPipe: two steps give GPipe's losses, state and weights. (A third step's
    amax histories part by up to 12% on the first stage: the loss's head runs per microbatch here,
    whose matmuls XLA blocks differently, and the last bits of the gradients it sends back decide
    fp8 roundings; the fp32 tests hold the schedule to one device at 1e-5.)"""
    fp8 = {"precision.policy": "fp8", "precision.fp8_scaling": "delayed"}
    runs = [Trainer(on_mesh(llama, {"stage": 2, "fsdp": 4}, tmp_path / name, **fp8, **extra), devices=devices,
                    log=lambda *_: None) for name, extra in (("gpipe", {}), ("1f1b", ONE_F_ONE_B))]
    for _ in range(2):
        gpipe, one_f_one_b = (float(r.step()["loss"]) for r in runs)
        assert_close(one_f_one_b, gpipe)
    fp8_states = [jax.tree_util.tree_map(np.asarray, r.state.fp8) for r in runs]
    assert_close(fp8_states[1], fp8_states[0])
    # Adam's update is the gradient's sign where it is small: a bf16 rounding in the head's
    # gradient, summed per microbatch here, moves such a weight by up to lr (4e-5 of 0.3 here).
    assert_close(*(jax.tree_util.tree_map(np.asarray, r.state.params) for r in runs[::-1]), scale=1e-3)


def _temp_bytes(cfg, devices) -> int:
    """The compiled gradient program's temporaries per device (compile only, nothing runs)."""
    from maxtext_rocm.trainer.step import gradients

    run = initial_run(cfg, devices)
    fn = jax.jit(lambda p, b: gradients(p, run.model, b, cfg.train.grad_accum, cfg.train.z_loss_weight))
    with run.sharding_rules():
        compiled = fn.lower(run.state.params, run.batch(0)).compile()
    return compiled.memory_analysis().temp_size_in_bytes


@pytest.mark.slow  # four compilations
@pytest.mark.parametrize("remat, seq_len", [("none", 32), ("full", 256)])
def test_1f1b_keeps_at_most_2s_minus_1_microbatches_where_gpipe_keeps_every_iteration(remat, seq_len, devices,
                                                                                       tmp_path):
    """stage=2 x fsdp=4, 8 layers, one sequence per batch shard per microbatch: from 2 to 8
    microbatches GPipe's temporaries grow with M + S - 1 iterations' residuals; 1f1b's slots stop
    at 2S - 1 = 3, so past them only the stage inputs and their cotangents grow (one activation
    per microbatch, not a stage's residuals). Under remat "full" a layer keeps only its input, so
    the sequences are longer for the residuals to outweigh the rest."""
    temp = {}
    for schedule in ("gpipe", "1f1b"):
        for micro in (2, 8):
            cfg = on_mesh(llama, {"stage": 2, "fsdp": 4}, tmp_path / f"{schedule}{micro}", **{
                "model.n_layers": 8, "model.remat": remat, "pipeline.schedule": schedule, "train.seq_len": seq_len,
                "pipeline.microbatches": micro, "train.per_device_batch_size": micro // 2})
            temp[schedule, micro] = _temp_bytes(cfg, devices)
    gpipe_growth, one_f_one_b_growth = (temp[s, 8] - temp[s, 2] for s in ("gpipe", "1f1b"))
    assert one_f_one_b_growth < 0.5 * gpipe_growth, temp
    if remat == "none":  # under "full" the rest (attention's scores, the head) dominates at this size
        assert temp["1f1b", 8] < 0.75 * temp["gpipe", 8], temp
