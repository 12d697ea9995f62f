"""pipeline.schedule="1f1b" (maxtext_rocm/parallel/pipeline/one_f_one_b.py) on 8 fake devices, beside
what it shares with gpipe_recompute (tests/test_pipeline_recompute.py: one device's loss and
gradients on stage=4 x fsdp=2, tensor, Mixtral's experts, accumulation, remat, fp8, padded
stacks): the schedule that runs the loss inside the pipeline composes with weights gathered once,
tied embeddings, context parallelism and data, and keeps at most 2S - 1 microbatches' layer
residuals per stage where GPipe's autodiff keeps every iteration's."""

import jax
import numpy as np
import pytest

from helpers import assert_close, assert_trees_close, initial_run, loss_and_grads, temporaries_bytes
from maxtext_rocm.train import Trainer
from test_pipeline import SINGLE, llama, mixtral, on_mesh, one_device  # noqa: F401 - a fixture

ONE_F_ONE_B = {"pipeline.schedule": "1f1b"}


def test_1f1b_stores_the_table_on_the_first_stage_and_the_head_on_the_last(one_device, devices,  # noqa: F811
                                                                           tmp_path):
    """[S, ...] over `stage`, the owner's row the weight and the others zero, so each stage's
    gradient is its own and none is summed over `stage` (pipeline.layout.ends_on_their_stages): the
    gradients' other rows stay zero, and in model order the state is one device's."""
    loss, grads, run = loss_and_grads(on_mesh(llama, {"stage": 4, "fsdp": 2}, tmp_path, **ONE_F_ONE_B), devices)
    ref_loss, ref_grads, ref_params = one_device
    assert_close(loss, ref_loss)
    assert_close(grads, ref_grads)
    for name, owner in (("embed", 0), ("lm_head", 3)):
        (stored,) = jax.tree_util.tree_leaves(run.state.params[name])
        assert stored.shape[0] == 4 and stored.sharding.spec[0] == "stage"
        rows, gradient_rows = np.asarray(stored), np.asarray(jax.tree_util.tree_leaves(run.stored_grads[name])[0])
        others = [s for s in range(4) if s != owner]
        assert not np.any(rows[others]) and not np.any(gradient_rows[others]) and np.any(gradient_rows[owner])
    assert_trees_close(jax.tree_util.tree_map(np.asarray, run.storage_order.params_to_canonical(run.state.params)),
                       ref_params, atol=0)


def test_a_tied_table_stays_replicated_over_stage(devices, tmp_path):
    """A tied table is the tail's head too, read on the first stage and the last."""
    run = initial_run(on_mesh(llama, {"stage": 2, "fsdp": 4}, tmp_path, **ONE_F_ONE_B,
                              **{"model.tie_embeddings": True}), devices)
    (table,) = jax.tree_util.tree_leaves(run.state.params["embed"])
    assert table.ndim == 2 and "stage" not in jax.tree_util.tree_leaves(tuple(table.sharding.spec))
    assert run.storage_order is None  # 4 layers on 2 stages: model order throughout


@pytest.mark.slow  # three trainers compiled
@pytest.mark.parametrize("repeats", [1, 2])
def test_checkpoints_cross_between_model_order_and_the_ends_on_their_stages(repeats, devices, tmp_path):
    """A 1f1b run (table and head stored per stage, their moments too; interleaved, the layers in
    storage order too) writes step 2 in model order; fsdp=8 resumes it to 1f1b's next loss, writes
    step 4, and 1f1b resumes that."""
    steps = {"checkpoint.every": 2, "train.steps": 8}
    schedule = {**ONE_F_ONE_B, "pipeline.repeats": repeats}
    quiet = dict(devices=devices, log=lambda *_: None)
    piped = Trainer(on_mesh(llama, {"stage": 2, "fsdp": 4}, tmp_path, **steps, **schedule), **quiet)
    assert piped.storage_order is not None
    piped.run(2)
    next_loss = float(piped.step()["loss"])

    flat = Trainer(on_mesh(llama, {"fsdp": 8}, tmp_path, **steps), **quiet)
    assert flat.step_count == 2
    assert_close(float(flat.step()["loss"]), next_loss)
    flat.run(1)  # step 4, saved
    after = float(flat.step()["loss"])

    again = Trainer(on_mesh(llama, {"stage": 2, "fsdp": 4}, tmp_path, **steps, **schedule), **quiet)
    assert again.step_count == 4
    assert_close(float(again.step()["loss"]), after)


@pytest.mark.slow  # a compilation each
@pytest.mark.parametrize("mesh, overrides", [
    ({"stage": 2, "fsdp": 4}, {"pipeline.weight_gather": "once"}),
    ({"stage": 2, "fsdp": 4}, {"model.tie_embeddings": True}),  # the table is also the tail's head
    ({"stage": 2, "fsdp": 4}, {"model.tie_embeddings": True, "pipeline.repeats": 2}),
])
def test_1f1b_composes_with_gathered_weights_and_tied_embeddings(mesh, overrides, devices, tmp_path):
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
    ({"stage": 2, "sequence": 2, "fsdp": 2}, {"model.context_parallel": "ring", "pipeline.repeats": 2}),
    ({"stage": 2, "data": 2, "fsdp": 2}, {"pipeline.repeats": 2}),
])
def test_1f1b_composes_with_context_parallelism_and_data(mesh, overrides, one_device, devices, tmp_path):  # noqa: F811
    """The tail runs manual over `stage` and the batch axes (data, fsdp); `sequence` stays GSPMD's
    there, and the loss's own shard_map splits the tokens over it."""
    loss, grads, _ = loss_and_grads(on_mesh(llama, mesh, tmp_path, **ONE_F_ONE_B, **overrides), devices)
    ref_loss, ref_grads, _ = one_device
    assert_close(loss, ref_loss)
    assert_close(grads, ref_grads)


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
            temp[schedule, micro] = temporaries_bytes(cfg, devices)
    gpipe_growth, one_f_one_b_growth = (temp[s, 8] - temp[s, 2] for s in ("gpipe", "1f1b"))
    assert one_f_one_b_growth < 0.5 * gpipe_growth, temp
    if remat == "none":  # under "full" the rest (attention's scores, the head) dominates at this size
        assert temp["1f1b", 8] < 0.75 * temp["gpipe", 8], temp


INTERLEAVED = {"pipeline.schedule": "1f1b", "pipeline.repeats": 2}


@pytest.mark.parametrize("mesh, overrides", [
    ({"stage": 2, "fsdp": 4}, {}),  # 4 layers: device 0 runs layers 0 and 2, device 1 layers 1 and 3
    ({"stage": 4, "fsdp": 2}, {"model.n_layers": 8}),
    ({"stage": 2, "fsdp": 2, "tensor": 2}, {}),
    pytest.param({"stage": 2, "fsdp": 4}, {"model.n_layers": 5}, marks=pytest.mark.slow),  # 3 empty slots of 8
    pytest.param({"stage": 2, "fsdp": 4}, {"model.remat": "none", "pipeline.weight_gather": "once"},
                 marks=pytest.mark.slow),
    # 4 microbatches: two groups of the stages, the second's forwards beside the first's backwards
    pytest.param({"stage": 2, "fsdp": 4}, {"pipeline.microbatches": 4, "train.per_device_batch_size": 2},
                 marks=pytest.mark.slow),
])
def test_interleaved_1f1b_matches_one_device(mesh, overrides, devices, tmp_path):
    """pipeline.repeats=2 under 1f1b: each microbatch passes the devices twice, forward and back
    (parallel/pipeline/one_f_one_b_order.py)."""
    model = {k: v for k, v in overrides.items() if k.startswith("model.")}
    sequences = 8 * overrides.get("train.per_device_batch_size", 1)
    ref_loss, ref_grads, _ = loss_and_grads(llama(**SINGLE, **model, **{
        "train.per_device_batch_size": sequences, "output_dir": str(tmp_path / "one")}), devices[:1])
    cfg = on_mesh(llama, mesh, tmp_path / "pp", **INTERLEAVED, **overrides)
    loss, grads, run = loss_and_grads(cfg, devices)
    assert run.cfg.pipeline.microbatches % mesh["stage"] == 0
    assert_close(loss, ref_loss)
    assert_close(grads, ref_grads)
    if "model.n_layers" in overrides and overrides["model.n_layers"] % (2 * mesh["stage"]):
        empty = run.storage_order.layout.layer_of_slot < 0
        for g in jax.tree_util.tree_leaves(run.stored_grads["layers"]):  # the empty slots learn nothing
            assert not np.any(np.asarray(g)[empty])


@pytest.mark.slow  # about a minute on 2 cores
def test_interleaved_1f1b_mixtral_with_expert_parallelism_matches_one_device(devices, tmp_path):
    """stage=2 x expert=2 x fsdp=2, two repeats; the reference accumulates the 2 microbatches."""
    ref = mixtral(**SINGLE, **{"train.per_device_batch_size": 8, "train.grad_accum": 2,
                               "output_dir": str(tmp_path / "one")})
    ref_loss, ref_grads, ref_run = loss_and_grads(ref, devices[:1])
    cfg = on_mesh(mixtral, {"stage": 2, "expert": 2, "fsdp": 2}, tmp_path / "pp", **INTERLEAVED)
    loss, grads, run = loss_and_grads(cfg, devices)
    assert run.cfg.pipeline.microbatches == 2
    assert_close(loss, ref_loss)
    assert_close(grads, ref_grads)
    assert_close(float(run.sums["moe_aux_loss"]), float(ref_run.sums["moe_aux_loss"]))


@pytest.mark.parametrize("repeats", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_a_padded_stack_keeps_no_weights_per_slot(repeats, devices, tmp_path):
    """Layers that do not divide run a slot at a time (pipeline.stages.run_chunk); the slot's layer must
    take the scan's own slice of the weights, which the stage's pullback recognises as its input.
    A reshaped copy was kept as a residual in every microbatch slot: every layer's weights per
    slot (405B on 8 stages: 651 GiB of XLA buffers against an estimate of 200). With the weights
    4x the activations here, a padded stack's temporaries stay within 1% of an unpadded one's
    (measured 2026-12-03: 128 bytes more, its slots' reality flags; 1.28x, interleaved 1.47x, before)."""
    temp = {}
    for layers in (4 * repeats - 1, 4 * repeats):
        cfg = on_mesh(llama, {"stage": 2, "fsdp": 4}, tmp_path / str(layers), **ONE_F_ONE_B, **{
            "pipeline.repeats": repeats, "model.n_layers": layers, "model.mlp_dim": 512,
            "pipeline.microbatches": 2})
        temp[layers] = temporaries_bytes(cfg, devices)
    assert temp[4 * repeats - 1] <= 1.01 * temp[4 * repeats], temp
