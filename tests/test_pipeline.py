"""Pipeline parallelism (maxtext_rocm/parallel/pipeline/) on 8 fake devices: the loss and the
gradients equal one device's under both schedules and with stacks that do not divide into the
stages, the stages really hold their layers and talk by collective-permute, checkpoints cross
stage counts and layer orders, and bad pipeline settings stop before anything compiles."""

import jax
import numpy as np
import pytest

from maxtext_rocm import config as config_lib
from maxtext_rocm.parallel import context, experts, pipeline
from maxtext_rocm.parallel.pipeline import layout as pipeline_layout
from maxtext_rocm.train import Trainer
from maxtext_rocm.trainer.preflight import check_run

from conftest import small_config
from helpers import assert_close, assert_trees_close, loss_and_grads

SINGLE = {f"mesh.ici.{a}": 1 for a in config_lib.MESH_AXES}
# Four layers so that four stages hold one each; "full" remat: the layers inside a stage are
# rematerialised as they are without a pipeline.
LAYERS = {"model.n_layers": 4, "model.remat": "full"}
CIRCULAR = {"pipeline.schedule": "circular", "pipeline.repeats": 2}


def llama(**overrides):
    return small_config(**{**LAYERS, **overrides})


def mixtral(**overrides):
    return small_config(**{**LAYERS, "model.family": "mixtral", "model.n_experts": 4, "model.experts_per_token": 2,
                           "model.mlp_dim": 32, "model.moe_impl": "capacity",
                           "model.moe_capacity_factor": 2.0, **overrides})  # E/k: nothing drops


def on_mesh(make, mesh, tmp_path, **overrides):
    return make(**dict(SINGLE, **{f"mesh.ici.{a}": s for a, s in mesh.items()}), output_dir=str(tmp_path), **overrides)


@pytest.fixture(scope="module")
def one_device(tmp_path_factory):
    cfg = llama(**SINGLE, **{"train.per_device_batch_size": 8, "output_dir": str(tmp_path_factory.mktemp("one"))})
    loss, grads, trainer = loss_and_grads(cfg, jax.devices()[:1])
    return loss, grads, jax.tree_util.tree_map(np.asarray, trainer.state.params)


@pytest.mark.parametrize("mesh", [
    {"stage": 2, "fsdp": 4},
    {"stage": 4, "fsdp": 2},
    {"stage": 2, "fsdp": 2, "tensor": 2},
])
def test_pipeline_matches_one_device(mesh, one_device, devices, tmp_path):
    cfg = on_mesh(llama, mesh, tmp_path)
    loss, grads, trainer = loss_and_grads(cfg, devices)
    ref_loss, ref_grads, ref_params = one_device

    # The same parameter tree and values as one device in model order; the layer axis split over
    # the stages, the untied table stored on the first stage (pipeline/layout.py).
    in_model_order = trainer.storage_order.params_to_canonical(trainer.state.params)
    assert_trees_close(jax.tree_util.tree_map(np.asarray, in_model_order), ref_params, atol=0)
    table = trainer.state.params["embed"]["embedding"]
    assert table.shape == (mesh["stage"], *ref_params["embed"]["embedding"].shape) and table.sharding.spec[0] == "stage"
    q = trainer.state.params["layers"]["attention"]["q"]["kernel"]
    assert q.sharding.spec[0] == "stage"
    assert q.addressable_shards[0].data.shape[0] == cfg.model.n_layers // mesh["stage"]
    assert_close(loss, ref_loss)
    assert_close(grads, ref_grads)


@pytest.mark.slow  # four more compilations of the same check
@pytest.mark.parametrize("mesh, overrides", [
    ({"stage": 2, "fsdp": 2, "tensor": 2}, {"train.grad_accum": 2}),  # a pipeline per accumulated micro-batch
    ({"stage": 2, "fsdp": 4}, {"model.remat": "minimal"}),
    ({"stage": 2, "fsdp": 4}, {"model.remat": "save_dots"}),
    ({"stage": 4, "fsdp": 2}, {"model.remat": "none", "pipeline.microbatches": 2}),
])
def test_pipeline_composes_with_accumulation_and_remat(mesh, overrides, one_device, devices, tmp_path):
    loss, grads, _ = loss_and_grads(on_mesh(llama, mesh, tmp_path, **overrides), devices)
    ref_loss, ref_grads, _ = one_device
    assert_close(loss, ref_loss)
    assert_close(grads, ref_grads)


def test_stages_exchange_activations_by_collective_permute(devices, tmp_path):
    cfg = on_mesh(llama, {"stage": 2, "fsdp": 4}, tmp_path, **{"pipeline.microbatches": 4, "train.per_device_batch_size": 2})
    trainer = Trainer(cfg, devices=devices, log=lambda *_: None)
    assert "collective-permute" in trainer.compiled_step.as_text()
    first = trainer.describe().splitlines()[0]
    assert "pipeline gpipe: 2 stages, 4 microbatches, bubble 20.0% = (S-1)/(M+S-1)" in first
    assert pipeline.bubble_fraction("gpipe", 4, 12) == pytest.approx(3 / 15)


def test_without_the_fused_loss_every_stage_runs_the_head_and_matches_one_device(one_device, devices, tmp_path):
    """model.loss_chunk_len=0: the loss is not the fused one the tail runs, so the last stage's
    outputs go to every stage (pipeline.transfers.from_stage) and the head stays replicated over `stage`."""
    loss, grads, run = loss_and_grads(on_mesh(llama, {"stage": 2, "fsdp": 4}, tmp_path, **{"model.loss_chunk_len": 0}),
                                      devices)
    assert not run.model.layer_stack.runs_the_loss and run.state.params["lm_head"]["kernel"].ndim == 2
    ref_loss, ref_grads, _ = one_device
    assert_close(loss, ref_loss)
    assert_close(grads, ref_grads)


@pytest.mark.parametrize("schedule", [{}, *(pytest.param({"pipeline.schedule": name}, marks=pytest.mark.slow)
                                          for name in ("gpipe_recompute", "1f1b"))])
def test_evaluation_on_a_pipeline_matches_one_device(schedule, devices, tmp_path):
    """The eval step runs the tail on the last stage without its backward (the custom_vjp's
    primal): the same eval loss as one device's."""
    common = {"train.eval_every": 100, "train.eval_steps": 2, "train.per_device_batch_size": 8}
    one = Trainer(llama(**SINGLE, **common, **{"output_dir": str(tmp_path / "one")}), devices=devices[:1],
                  log=lambda *_: None)
    piped = Trainer(on_mesh(llama, {"stage": 2, "fsdp": 4}, tmp_path / "pp", **schedule,
                            **{**common, "train.per_device_batch_size": 1}), devices=devices,
                    log=lambda *_: None)
    assert piped.model.layer_stack.runs_the_loss
    assert_close(piped.evaluate()["eval_loss"], one.evaluate()["eval_loss"])


def test_pipeline_trains_three_steps_like_one_device(devices, tmp_path):
    """Three optimizer steps: losses and parameters stay with one device's."""
    one = Trainer(llama(**SINGLE, **{"train.per_device_batch_size": 8, "output_dir": str(tmp_path / "one")}),
                  devices=devices[:1], log=lambda *_: None)
    piped = Trainer(on_mesh(llama, {"stage": 2, "fsdp": 4}, tmp_path / "pp"), devices=devices, log=lambda *_: None)
    for _ in range(3):
        assert_close(float(piped.step()["loss"]), float(one.step()["loss"]))
    assert_close(jax.tree_util.tree_map(np.asarray, piped.params_in_model_order()),
                 jax.tree_util.tree_map(np.asarray, one.state.params))


@pytest.mark.slow  # about a minute on 2 cores
def test_mixtral_pipeline_with_expert_parallelism_matches_one_device(devices, tmp_path):
    """stage=2 x expert=2 x fsdp=2, experts split inside each stage (GSPMD's capacity layout). The
    router losses are per pipeline microbatch, as one device's train.grad_accum = microbatches
    computes them."""
    ref = mixtral(**SINGLE, **{"train.per_device_batch_size": 8, "train.grad_accum": 2,
                               "output_dir": str(tmp_path / "one")})
    ref_loss, ref_grads, _ = loss_and_grads(ref, devices[:1])
    cfg = on_mesh(mixtral, {"stage": 2, "expert": 2, "fsdp": 2}, tmp_path / "pp")
    loss, grads, _ = loss_and_grads(cfg, devices)
    assert_close(loss, ref_loss)
    assert_close(grads, ref_grads)


def test_checkpoint_from_four_stages_resumes_on_one(devices, tmp_path):
    four = on_mesh(llama, {"stage": 4, "fsdp": 2}, tmp_path, **{"checkpoint.every": 2, "train.steps": 4})
    trainer = Trainer(four, devices=devices, log=lambda *_: None)
    trainer.run(2)
    saved = jax.tree_util.tree_map(np.asarray, trainer.params_in_model_order())
    next_loss = float(trainer.step()["loss"])

    one = on_mesh(llama, {"fsdp": 8}, tmp_path, **{"checkpoint.every": 2, "train.steps": 4})
    resumed = Trainer(one, devices=devices, log=lambda *_: None)
    assert resumed.step_count == 2 and resumed.mesh.shape["stage"] == 1
    assert_trees_close(jax.tree_util.tree_map(np.asarray, resumed.state.params), saved, atol=0)
    assert_close(float(resumed.step()["loss"]), next_loss)


@pytest.mark.parametrize("mesh", [
    {"stage": 2, "fsdp": 4},
    pytest.param({"stage": 2, "fsdp": 2, "tensor": 2}, marks=pytest.mark.slow),
])
def test_circular_schedule_matches_one_device(mesh, one_device, devices, tmp_path):
    """Two virtual stages per device: device s runs model layers s and s + 2, stored as its own
    contiguous block, and the tree in model order is one device's."""
    cfg = on_mesh(llama, mesh, tmp_path, **CIRCULAR)
    loss, grads, run = loss_and_grads(cfg, devices)
    ref_loss, ref_grads, ref_params = one_device

    in_model_order = jax.tree_util.tree_map(np.asarray, run.storage_order.params_to_canonical(run.state.params))
    assert_trees_close(in_model_order, ref_params, atol=0)
    stored = run.state.params["layers"]["attention"]["q"]["kernel"]
    first_device = stored.addressable_shards[0]
    assert stored.sharding.spec[0] == "stage" and first_device.index[0] == slice(0, 2)
    ref_q = ref_params["layers"]["attention"]["q"]["kernel"]
    np.testing.assert_array_equal(np.asarray(first_device.data), ref_q[[0, 2]][(slice(None), *first_device.index[1:])])
    assert_close(loss, ref_loss)
    assert_close(grads, ref_grads)


TIED = {"model.tie_embeddings": True}


@pytest.fixture(scope="module")
def one_device_tied(tmp_path_factory):
    cfg = llama(**SINGLE, **TIED, **{"train.per_device_batch_size": 8, "output_dir": str(tmp_path_factory.mktemp("tied"))})
    return loss_and_grads(cfg, jax.devices()[:1])[:2]


@pytest.mark.parametrize("schedule", [
    {},
    pytest.param({"pipeline.schedule": "gpipe_recompute"}, marks=pytest.mark.slow),
    pytest.param(CIRCULAR, marks=pytest.mark.slow),
])
def test_tied_embeddings_under_a_pipeline_match_one_device(schedule, one_device_tied, devices, tmp_path):
    """The stages look the tokens up themselves (pipeline.embedding.embedded_per_stage) through the table
    that is also the LM head: its gradient sums the lookup's (stage 0's copy) and the head's."""
    loss, grads, _ = loss_and_grads(on_mesh(llama, {"stage": 2, "fsdp": 4}, tmp_path, **TIED, **schedule), devices)
    ref_loss, ref_grads = one_device_tied
    assert "lm_head" not in grads
    assert_close(loss, ref_loss)
    assert_close(grads, ref_grads)


THREE = {"model.n_layers": 3}


@pytest.fixture(scope="module")
def three_layers_on_two_stages(tmp_path_factory):
    return loss_and_grads(on_mesh(llama, {"stage": 2, "fsdp": 4}, tmp_path_factory.mktemp("three"), **THREE),
                          jax.devices())


@pytest.mark.slow  # an eight-layer reference compiled for it
def test_circular_schedule_on_four_stages_matches_one_device(devices, tmp_path):
    """stage=4 x fsdp=2, two repeats: eight layers, device s runs layers s and s + 4."""
    eight = {"model.n_layers": 8}
    ref_loss, ref_grads, _ = loss_and_grads(llama(**SINGLE, **eight, **{"train.per_device_batch_size": 8,
                                                                     "output_dir": str(tmp_path / "one")}),
                                            devices[:1])
    cfg = on_mesh(llama, {"stage": 4, "fsdp": 2}, tmp_path / "pp", **eight, **CIRCULAR)
    loss, grads, run = loss_and_grads(cfg, devices)
    assert run.cfg.pipeline.microbatches >= 4
    assert_close(loss, ref_loss)
    assert_close(grads, ref_grads)


@pytest.mark.slow  # a second model compiled for the reference
def test_stack_that_does_not_divide_into_stages_matches_one_device(three_layers_on_two_stages, devices, tmp_path):
    ref_loss, ref_grads, _ = loss_and_grads(
        llama(**SINGLE, **THREE, **{"train.per_device_batch_size": 8, "output_dir": str(tmp_path)}), devices[:1])
    loss, grads, _ = three_layers_on_two_stages
    assert_close(loss, ref_loss)
    assert_close(grads, ref_grads)


def test_an_empty_slot_is_skipped_and_gets_no_gradient(three_layers_on_two_stages):
    """Three layers on two stages: the second holds an empty slot, which passes activations
    through and gets exactly zero gradient; the first line of the run states it."""
    loss, _, run = three_layers_on_two_stages
    assert run.storage_order.layout.layer_of_slot.tolist() == [0, 1, 2, -1]
    for path, g in jax.tree_util.tree_leaves_with_path(run.stored_grads["layers"]):
        assert g.shape[0] == 4 and not np.any(g[3]), jax.tree_util.keystr(path)
        assert np.any(g[2]), jax.tree_util.keystr(path)  # the real layer beside it does learn
    # Skipped, not merely zero (a zero Llama block happens to be the identity): filled with a
    # real layer's weights, it changes nothing and still gets no gradient.
    fill = jax.jit(lambda params: {**params, "layers": jax.tree_util.tree_map(lambda p: p.at[3].set(p[2] + 0.5),
                                                                             params["layers"])},
                   out_shardings=jax.tree_util.tree_map(lambda p: p.sharding, run.state.params))
    with run.sharding_rules():
        filled_grads, _, sums = run.grad_fn(fill(run.state.params), run.batch(0))
    assert float(sums["loss"]) == loss
    assert not any(np.any(np.asarray(g)[3]) for g in jax.tree_util.tree_leaves(filled_grads["layers"]))
    cfg = llama(**dict(SINGLE, **{"mesh.ici.stage": 8}), **{"model.n_layers": 126, "pipeline.microbatches": 8})
    text = pipeline.describe(cfg.pipeline, 8, 126)
    assert text.startswith("pipeline gpipe: 8 stages, 8 microbatches, bubble 46.7% = (S-1)/(M+S-1); "
                           "126 layers in 8 x 16 slots, 2 empty, idle 47.5% with them")


@pytest.mark.parametrize("layers, stages, repeats", [(4, 2, 2), (5, 2, 2), (126, 8, 1), (126, 8, 2), (7, 4, 1)])
def test_storage_order_puts_each_devices_chunks_in_its_block(layers, stages, repeats):
    layout = pipeline_layout.StackLayout(layers, stages, repeats)
    canonical = np.arange(1, layers + 1, dtype=np.float32)[:, None] * np.ones((1, 3), np.float32)
    stored = np.asarray(layout.to_storage(canonical))
    expected = np.where(layout.layer_of_slot[:, None] >= 0, layout.layer_of_slot[:, None] + 1, 0)
    np.testing.assert_array_equal(stored, expected * np.ones((1, 3)))
    np.testing.assert_array_equal(np.asarray(layout.to_canonical(stored)), canonical)
    per_chunk = layout.layer_of_slot.reshape(stages, repeats, -1)
    for s in range(stages):  # device s runs chunks s, s + S, ... of the model's order, each non-empty
        for r in range(repeats):
            chunk = [l for l in per_chunk[s, r] if l >= 0]
            assert chunk and chunk == list(range(chunk[0], chunk[0] + len(chunk)))
            assert chunk[0] == sum(len([l for l in per_chunk[v % stages, v // stages] if l >= 0])
                                   for v in range(r * stages + s))
    assert layout.empty == layout.slots - layers and layout.empty < stages * repeats


@pytest.mark.parametrize("overrides, message", [
    ({**CIRCULAR, "pipeline.repeats": 3}, r"model.n_layers=4 leaves some of mesh stage=2 x pipeline.repeats=3 "
                                           r"= 6 virtual stages without a layer; choose stage x repeats <= 4"),
    ({**CIRCULAR, "pipeline.microbatches": 1}, r"pipeline.microbatches=1 is fewer than mesh stage=2: a circular"),
    ({"pipeline.repeats": 0}, r"pipeline.repeats=0 is not valid; use a count >= 1"),
    ({"pipeline.microbatches": 3}, r"pipeline.microbatches=3 does not divide the step's 8 sequences"),
    ({"pipeline.microbatches": 8}, r"pipeline.microbatches=8 does not divide .* over the 4 batch shards"),
    ({"pipeline.schedule": "zero_bubble"}, r"pipeline.schedule='zero_bubble' is not valid; choose one of 'gpipe'"),
    ({"pipeline.schedule": "gpipe_recompute", "pipeline.repeats": 2}, r"pipeline.repeats=2 needs a schedule with virtual stages \(circular or 1f1b\), which "
                                                                   r"pipeline.schedule='gpipe_recompute' is not"),
    ({"pipeline.repeats": 2}, r"pipeline.repeats=2 needs a schedule with virtual stages \(circular or 1f1b\), "
                              r"which pipeline.schedule='gpipe' is not"),
    ({"model.scan_layers": False}, r"set model.scan_layers=True"),
    ({"pipeline.weight_gather": "per_step"}, r"pipeline.weight_gather='per_step' is not valid; choose one of "
                                             r"'per_iteration', 'once'"),
    ({"pipeline.gradient_reduce": "once"}, r"pipeline.gradient_reduce='once' needs the weights gathered once too; "
                                           r"set pipeline.weight_gather='once'"),
    ({"pipeline.gradient_reduce": "once", "pipeline.weight_gather": "once", "precision.policy": "fp8",
      "precision.fp8_scaling": "current"}, r"pipeline.gradient_reduce='once' does not run with precision.policy='fp8'"),
    ({"pipeline.gradient_reduce": "once", "pipeline.weight_gather": "once", "model.family": "mixtral",
      "model.n_experts": 4, "model.experts_per_token": 2}, r"does not run with model.n_experts=4 .*; set "
                                                           r"pipeline.gradient_reduce='per_iteration'"),
    ({"pipeline.schedule": "1f1b", "model.loss_chunk_len": 0}, r"pipeline.schedule='1f1b' does not run with "
                                                               r"model.loss_chunk_len=0 .*; use pipeline.schedule='gpipe'"),
    ({"pipeline.schedule": "1f1b", "precision.fp8_lm_head": True}, r"'1f1b' does not run with precision.fp8_lm_head"),
    ({"pipeline.schedule": "1f1b", "pipeline.weight_gather": "once", "pipeline.gradient_reduce": "once"},
     r"pipeline.schedule='1f1b' does not run with pipeline.gradient_reduce='once'"),
    ({"pipeline.schedule": "1f1b", "pipeline.repeats": 2, "pipeline.microbatches": 1},
     r"pipeline.microbatches=1 is not a multiple of mesh stage=2: interleaved 1F1B \(pipeline.repeats=2\) runs "
     r"the microbatches in groups of the stages; use a multiple of 2, or pipeline.repeats=1"),
])
def test_bad_pipeline_settings_are_one_sentence_before_compiling(overrides, message):
    cfg = llama(**dict(SINGLE, **{"mesh.ici.stage": 2, "mesh.ici.fsdp": 4}), **overrides)
    with pytest.raises(config_lib.ConfigError, match=message):
        check_run(cfg, device_count=8)


def test_gradient_reduce_once_is_refused_on_a_jax_whose_xla_aborts_it(monkeypatch):
    """jax 0.12.0.1's lowering of its nested shard_maps makes XLA abort the compile (config/checks.py)."""
    from maxtext_rocm.config import checks

    monkeypatch.setattr(checks, "installed_jax", lambda: (0, 12, 0))
    cfg = llama(**dict(SINGLE, **{"mesh.ici.stage": 2, "mesh.ici.fsdp": 4}), **{
        "pipeline.gradient_reduce": "once", "pipeline.weight_gather": "once"})
    with pytest.raises(config_lib.ConfigError, match=r"pipeline.gradient_reduce='once' does not run with jax "
                                                     r"0.12.0 .*; set pipeline.gradient_reduce='per_iteration'"):
        check_run(cfg, device_count=8)


@pytest.mark.parametrize("mode", [pytest.param("ring", marks=pytest.mark.slow), "all_gather"])
def test_context_parallelism_inside_the_stages_matches_one_device(mode, one_device, devices, tmp_path):
    """stage=2 x sequence=2 x fsdp=2: each stage's attention runs context.py's shard_map over
    `sequence` inside the stages' vmap (unchecked there: varying.check_vma)."""
    calls = []
    real = getattr(context, "_ring" if mode == "ring" else "_gathered")
    with pytest.MonkeyPatch.context() as patch:  # counts the sequence-sharded attention's uses
        patch.setattr(context, real.__name__, lambda *a, **k: calls.append(mode) or real(*a, **k))
        loss, grads, _ = loss_and_grads(on_mesh(llama, {"stage": 2, "sequence": 2, "fsdp": 2}, tmp_path,
                                                **{"model.context_parallel": mode}), devices)
    assert calls  # the context-parallel attention ran, not the fallback for unsplittable batches
    ref_loss, ref_grads, _ = one_device
    assert_close(loss, ref_loss)
    assert_close(grads, ref_grads)


@pytest.mark.slow  # about 30 s each on 2 cores
@pytest.mark.parametrize("mesh, overrides", [
    ({"stage": 2, "expert": 2, "fsdp": 2}, {}),
    # Two microbatches, as the reference accumulates: the router losses are per microbatch.
    ({"stage": 2, "expert": 2, "tensor": 2}, {**CIRCULAR, "pipeline.microbatches": 2}),
])
def test_mixtral_pipeline_with_the_dropless_expert_exchange_matches_one_device(mesh, overrides, devices, tmp_path):
    """moe_impl='dropless': experts.py's exchange (its CPU path, the padded all-to-all) over
    `expert` inside the stages' vmap (unchecked there: varying.check_vma), with gpipe and circular."""
    ref = mixtral(**SINGLE, **{"train.per_device_batch_size": 8, "train.grad_accum": 2,
                               "output_dir": str(tmp_path / "one")})
    ref_loss, ref_grads, _ = loss_and_grads(ref, devices[:1])
    calls = []
    real = experts.padded_ragged_all_to_all
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(experts, "padded_ragged_all_to_all", lambda *a, **k: calls.append(1) or real(*a, **k))
        loss, grads, _ = loss_and_grads(on_mesh(mixtral, mesh, tmp_path / "pp", **{"model.moe_impl": "dropless"},
                                                **overrides), devices)
    assert calls  # the exchange ran
    assert_close(loss, ref_loss)
    assert_close(grads, ref_grads)


@pytest.mark.slow  # about a minute on 2 cores
def test_mixtral_circular_pipeline_with_expert_parallelism_matches_one_device(devices, tmp_path):
    ref = mixtral(**SINGLE, **{"train.per_device_batch_size": 8, "train.grad_accum": 2,
                               "output_dir": str(tmp_path / "one")})
    ref_loss, ref_grads, _ = loss_and_grads(ref, devices[:1])
    loss, grads, _ = loss_and_grads(on_mesh(mixtral, {"stage": 2, "expert": 2, "fsdp": 2}, tmp_path / "pp", **CIRCULAR),
                                    devices)
    assert_close(loss, ref_loss)
    assert_close(grads, ref_grads)


@pytest.mark.slow  # three train steps compiled, on two sizes of stack
def test_padded_circular_pipeline_trains_three_steps_like_one_device_and_keeps_empty_slots_zero(devices, tmp_path):
    """Five layers on 2 stages x 2 repeats: 8 slots, 3 empty. Losses and parameters stay with one
    device's; the empty slots' parameters and optimizer moments stay exactly zero."""
    five = {"model.n_layers": 5}
    one = Trainer(llama(**SINGLE, **five, **{"train.per_device_batch_size": 16, "output_dir": str(tmp_path / "one")}),
                  devices=devices[:1], log=lambda *_: None)
    # 4 microbatches on 2 stages: each waits in the buffer between its rounds.
    piped = Trainer(on_mesh(llama, {"stage": 2, "fsdp": 4}, tmp_path / "pp", **five, **CIRCULAR, **{
        "pipeline.microbatches": 4, "train.per_device_batch_size": 2}), devices=devices, log=lambda *_: None)
    for _ in range(3):
        assert_close(float(piped.step()["loss"]), float(one.step()["loss"]))
    assert_close(jax.tree_util.tree_map(np.asarray, piped.params_in_model_order()),
                 jax.tree_util.tree_map(np.asarray, one.state.params))
    empty = piped.storage_order.layout.layer_of_slot < 0
    assert empty.sum() == 3
    flags = jax.tree_util.tree_leaves(piped.storage_order.flags)
    stored = [np.asarray(x) for x, is_layer in zip(jax.tree_util.tree_leaves(piped.state), flags) if is_layer]
    assert len(stored) == 3 * len(jax.tree_util.tree_leaves(piped.state.params["layers"]))  # params, mu, nu
    for x in stored:
        assert x.shape[0] == 8 and not np.any(x[empty]) and np.any(x[~empty])


@pytest.mark.slow  # three trainers compiled
def test_checkpoints_cross_between_one_device_order_and_circular_storage(devices, tmp_path):
    """stage=1 writes step 2, a circular pipeline resumes it (to the same next loss) and writes step
    4 in model order, and stage=1 resumes that: checkpoints never hold the storage order. A
    circular run started from those parameters (checkpoint.load_params_from) holds them."""
    steps = {"checkpoint.every": 2, "train.steps": 8}
    one = Trainer(on_mesh(llama, {"fsdp": 8}, tmp_path, **steps), devices=devices, log=lambda *_: None)
    one.run(2)
    saved = jax.tree_util.tree_map(np.asarray, one.state.params)
    next_loss = float(one.step()["loss"])

    circular = Trainer(on_mesh(llama, {"stage": 2, "fsdp": 4}, tmp_path, **steps, **CIRCULAR), devices=devices,
                       log=lambda *_: None)
    assert circular.step_count == 2 and circular.storage_order is not None
    assert_trees_close(jax.tree_util.tree_map(np.asarray, circular.params_in_model_order()), saved, atol=0)
    assert_close(float(circular.step()["loss"]), next_loss)
    circular.run(1)  # step 4, saved
    circular.checkpointer.wait()
    saved = jax.tree_util.tree_map(np.asarray, circular.params_in_model_order())
    next_loss = float(circular.step()["loss"])

    back = Trainer(on_mesh(llama, {"fsdp": 8}, tmp_path, **steps, **{"checkpoint.resume": "4"}), devices=devices,
                   log=lambda *_: None)
    assert back.step_count == 4
    assert_trees_close(jax.tree_util.tree_map(np.asarray, back.state.params), saved, atol=0)
    assert_close(float(back.step()["loss"]), next_loss)

    # checkpoint.load_params_from reads model order into the pipeline's storage order too.
    loaded = Trainer(on_mesh(llama, {"stage": 2, "fsdp": 4}, tmp_path / "fresh", **steps, **CIRCULAR, **{
        "checkpoint.load_params_from": str(tmp_path)}), devices=devices, log=lambda *_: None)
    assert loaded.step_count == 0
    assert_trees_close(jax.tree_util.tree_map(np.asarray, loaded.params_in_model_order()), saved, atol=0)


@pytest.mark.slow  # fp8 steps compiled twice
@pytest.mark.parametrize("overrides", [CIRCULAR, {"model.n_layers": 3},
                                       pytest.param({**CIRCULAR, "pipeline.schedule": "1f1b"}, id="interleaved_1f1b")])
def test_fp8_delayed_scaling_under_a_pipeline_trains_like_fsdp_accumulating(overrides, devices, tmp_path):
    """Each layer's amax history takes one entry a step, the largest over the real microbatches
    (as train.grad_accum = microbatches makes it without a pipeline): not the bubble's, not one per
    use. The reference is fsdp=4 without a pipeline: sharded fp8 itself already differs from one
    device by ~1e-4 of the loss (a quantization step), and the pipeline must add nothing to that."""
    fp8 = {"precision.policy": "fp8", "precision.fp8_scaling": "delayed"}
    layers = {"model.n_layers": overrides.get("model.n_layers", 4)}
    one = Trainer(on_mesh(llama, {"fsdp": 4}, tmp_path / "one", **fp8, **layers, **{
        "train.per_device_batch_size": 2, "train.grad_accum": 2}), devices=devices[:4], log=lambda *_: None)
    piped = Trainer(on_mesh(llama, {"stage": 2, "fsdp": 4}, tmp_path / "pp", **fp8, **overrides), devices=devices,
                    log=lambda *_: None)
    for _ in range(3):
        assert_close(float(piped.step()["loss"]), float(one.step()["loss"]))
    got = jax.tree_util.tree_leaves_with_path(jax.tree_util.tree_map(np.asarray, piped.state_in_model_order().fp8))
    want = jax.tree_util.tree_leaves(jax.tree_util.tree_map(np.asarray, one.state.fp8))
    histories = []
    for (path, x), y in zip(got, want):
        name = jax.tree_util.keystr(path)
        if "output_grad" in name:
            # Gradients pass through e5m2 (two mantissa bits): a 1e-7 difference upstream can move
            # one rounding a step and a downstream amax by up to ~15%; the forward's cannot.
            np.testing.assert_allclose(x, y, rtol=0.15, err_msg=name)
        else:
            assert_close(x, y, err_msg=name)
        if name.endswith("amax_history']") and "['layers']" in name:
            histories.append(x)
    assert histories and all(np.all(np.count_nonzero(h, axis=1) == 3) for h in histories)  # one per step


@pytest.mark.parametrize("stages, per_shard, expected", [(8, 64, 32), (8, 8, 8), (4, 48, 16), (2, 6, 6), (8, 6, 6), (4, 1, 1)])
def test_auto_microbatches_are_the_most_up_to_four_per_stage_that_split_the_shard(stages, per_shard, expected):
    from maxtext_rocm.config.checks import pipeline_microbatches

    auto = llama().pipeline
    assert pipeline_microbatches(auto, stages, per_shard) == expected
    auto.microbatches = 3  # an explicit count is taken as it is (the checks judge it)
    assert pipeline_microbatches(auto, stages, per_shard) == 3


@pytest.mark.parametrize("stages, per_shard, expected", [(4, 20, 4), (2, 6, 6), (4, 6, 6), (8, 48, 24)])
def test_auto_microbatches_for_interleaved_1f1b_are_whole_groups_of_stages_where_the_batch_allows(
        stages, per_shard, expected):
    """(4, 20): 4, not plain 1F1B's 10. (4, 6): no multiple of 4 splits 6 sequences, so the count is
    plain 1F1B's and the checks refuse it."""
    from maxtext_rocm.config.checks import pipeline_microbatches

    interleaved = llama(**{"pipeline.schedule": "1f1b", "pipeline.repeats": 2}).pipeline
    assert pipeline_microbatches(interleaved, stages, per_shard) == expected


def test_auto_microbatches_are_resolved_for_the_mesh_and_recorded(devices, tmp_path):
    from maxtext_rocm.parallel import sharding
    from maxtext_rocm.resolve import Target, resolve

    cfg = on_mesh(llama, {"stage": 2, "fsdp": 4}, tmp_path, **{"train.per_device_batch_size": 4})
    cfg = resolve(cfg, sharding.make_mesh(cfg.mesh, devices), Target.of_device(devices[0]))
    assert cfg.pipeline.microbatches == 8  # 32 sequences over 4 batch shards: 8 each, at most 4 x 2 stages
    assert pipeline.describe(cfg.pipeline, 2).startswith("pipeline gpipe: 2 stages, 8 microbatches, bubble 11.1%")
