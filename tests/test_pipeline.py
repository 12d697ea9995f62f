"""Pipeline parallelism (maxtext_rocm/parallel/pipeline.py) on 8 fake devices: the loss and the
gradients equal one device's, the stages really hold their layers and talk by collective-permute,
checkpoints cross stage counts, and bad pipeline settings stop before anything compiles."""

import jax
import numpy as np
import pytest

from maxtext_rocm import config as config_lib
from maxtext_rocm.parallel import pipeline
from maxtext_rocm.train import Trainer

from conftest import small_config
from helpers import assert_close, assert_trees_close, loss_and_grads

SINGLE = {f"mesh.ici.{a}": 1 for a in config_lib.MESH_AXES}
# Four layers so that four stages hold one each; "full" remat: the layers inside a stage are
# rematerialised as they are without a pipeline.
LAYERS = {"model.n_layers": 4, "model.remat": "full"}


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

    # The same parameter tree and values as one device; the layer axis split over the stages.
    assert_trees_close(jax.tree_util.tree_map(np.asarray, trainer.state.params), ref_params, atol=0)
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


def test_pipeline_trains_three_steps_like_one_device(devices, tmp_path):
    """Three optimizer steps: losses and parameters stay with one device's."""
    one = Trainer(llama(**SINGLE, **{"train.per_device_batch_size": 8, "output_dir": str(tmp_path / "one")}),
                  devices=devices[:1], log=lambda *_: None)
    piped = Trainer(on_mesh(llama, {"stage": 2, "fsdp": 4}, tmp_path / "pp"), devices=devices, log=lambda *_: None)
    for _ in range(3):
        assert_close(float(piped.step()["loss"]), float(one.step()["loss"]))
    assert_close(jax.tree_util.tree_map(np.asarray, piped.state.params),
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
    saved = jax.tree_util.tree_map(np.asarray, trainer.state.params)
    next_loss = float(trainer.step()["loss"])

    one = on_mesh(llama, {"fsdp": 8}, tmp_path, **{"checkpoint.every": 2, "train.steps": 4})
    resumed = Trainer(one, devices=devices, log=lambda *_: None)
    assert resumed.step_count == 2 and resumed.mesh.shape["stage"] == 1
    assert_trees_close(jax.tree_util.tree_map(np.asarray, resumed.state.params), saved, atol=0)
    assert_close(float(resumed.step()["loss"]), next_loss)


@pytest.mark.parametrize("overrides, message", [
    ({"model.n_layers": 3}, r"model.n_layers=3 does not divide into mesh stage=2 x pipeline.repeats=1"),
    ({"pipeline.microbatches": 3}, r"pipeline.microbatches=3 does not divide the step's 8 sequences"),
    ({"pipeline.microbatches": 8}, r"pipeline.microbatches=8 does not divide .* over the 4 batch shards"),
    ({"pipeline.schedule": "1f1b"}, r"pipeline.schedule='1f1b' is not valid; choose one of 'gpipe'"),
    ({"pipeline.repeats": 2}, r"pipeline.repeats=2 needs a circular schedule"),
    ({"model.scan_layers": False}, r"set model.scan_layers=True"),
    ({"precision.policy": "fp8"}, r"delayed scaling is not supported under a pipeline"),
])
def test_bad_pipeline_settings_are_one_sentence_before_compiling(overrides, message):
    cfg = llama(**dict(SINGLE, **{"mesh.ici.stage": 2, "mesh.ici.fsdp": 4}), **overrides)
    with pytest.raises(config_lib.ConfigError, match=message):
        config_lib.validate(cfg, device_count=8)


def test_context_parallelism_is_refused_under_a_pipeline_for_now():
    cfg = llama(**dict(SINGLE, **{"mesh.ici.stage": 2, "mesh.ici.fsdp": 2, "mesh.ici.sequence": 2}))
    with pytest.raises(config_lib.ConfigError, match=r"mesh sequence=2 \(context parallelism\) with mesh stage=2"):
        config_lib.validate(cfg, device_count=8)


def test_dropless_experts_are_refused_under_a_pipeline_for_now():
    cfg = mixtral(**dict(SINGLE, **{"mesh.ici.stage": 2, "mesh.ici.fsdp": 4}), **{"model.moe_impl": "auto"})
    message = r"model.moe_impl='auto' \(the dropless expert exchange\) is not supported under a pipeline"
    with pytest.raises(config_lib.ConfigError, match=message):
        config_lib.validate(cfg, device_count=8)
