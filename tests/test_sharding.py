"""On 8 fake CPU devices, sharded meshes compute the same loss and gradients as one device."""

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from conftest import small_config
from helpers import assert_close, assert_trees_close, loss_and_grads
from maxtext_rocm.resolve import Target, resolve

SINGLE = {f"mesh.ici.{a}": 1 for a in ("data", "fsdp", "expert", "sequence", "tensor")}


@pytest.fixture(scope="module")
def single_device_reference(tmp_path_factory):
    cfg = small_config(**SINGLE, **{"train.per_device_batch_size": 8,
                                    "output_dir": str(tmp_path_factory.mktemp("one"))})
    loss, grads, trainer = loss_and_grads(cfg, jax.devices()[:1])
    params = jax.tree_util.tree_map(np.asarray, trainer.state.params)
    return loss, grads, params


@pytest.mark.parametrize("mesh", [
    {"fsdp": 8},
    {"fsdp": 4, "tensor": 2},
    {"data": 2, "fsdp": 2, "tensor": 2},
    {"fsdp": 4, "sequence": 2},
    {"fsdp": 2, "sequence": 2, "tensor": 2},  # the head loss split over tokens and vocabulary at once
])
def test_mesh_matches_single_device(mesh, single_device_reference, devices, tmp_path):
    overrides = dict(SINGLE, **{f"mesh.ici.{a}": s for a, s in mesh.items()})
    cfg = small_config(**overrides, **{"output_dir": str(tmp_path)})
    loss, grads, trainer = loss_and_grads(cfg, devices)
    ref_loss, ref_grads, ref_params = single_device_reference

    # Same initial parameters whatever the sharding, and they really are sharded.
    assert_trees_close(jax.tree_util.tree_map(np.asarray, trainer.state.params), ref_params, atol=0)
    embedding = trainer.state.params["embed"]["embedding"]
    assert embedding.sharding.spec != P() and not embedding.sharding.is_fully_replicated
    assert dict(trainer.mesh.shape) == {a: mesh.get(a, 1) for a in trainer.mesh.axis_names}

    assert_close(loss, ref_loss)
    assert_close(grads, ref_grads)


def test_tensor_parallel_shards_heads_and_mlp(devices, tmp_path):
    cfg = small_config(**dict(SINGLE, **{"mesh.ici.fsdp": 4, "mesh.ici.tensor": 2, "output_dir": str(tmp_path)}))
    _, _, trainer = loss_and_grads(cfg, devices)
    layers = trainer.state.params["layers"]
    fsdp = ("fsdp", "sequence", "expert")  # the embed axis is FSDP-sharded over all three
    # Scanned kernels carry a leading "layers" axis, over `stage` (of size 1 here: no pipeline).
    assert layers["attention"]["q"]["kernel"].sharding.spec == P("stage", fsdp, "tensor", None)
    assert layers["mlp"]["down"]["kernel"].sharding.spec == P("stage", "tensor", fsdp)
    assert trainer.state.params["lm_head"]["kernel"].sharding.spec == P(fsdp, "tensor")
    adam_mu = trainer.state.opt_state[1][0].mu["lm_head"]["kernel"]
    assert adam_mu.sharding.spec == P(fsdp, "tensor"), "optimizer state must follow the parameters"


def test_fused_projections_change_nothing_but_the_dots(tmp_path):
    """model.fuse_projections: the same parameters and the same loss and gradients fused or not;
    "auto" fuses only where a tensor axis makes it save collectives."""
    from maxtext_rocm.parallel import sharding

    runs = {}
    for fuse in ("on", "off"):
        cfg = small_config(**SINGLE, **{"model.fuse_projections": fuse, "precision.policy": "fp32",
                                        "output_dir": str(tmp_path / fuse)})
        runs[fuse] = loss_and_grads(cfg, jax.devices()[:1])
    (loss_on, grads_on, run_on), (loss_off, grads_off, run_off) = runs["on"], runs["off"]
    assert jax.tree_util.tree_structure(run_on.state.params) == jax.tree_util.tree_structure(run_off.state.params)
    assert_close(loss_on, loss_off)
    assert_close(grads_on, grads_off)
    for tensor, want in ((1, "off"), (2, "on")):
        cfg = small_config(**dict(SINGLE, **{"mesh.ici.fsdp": 8 // tensor, "mesh.ici.tensor": tensor}))
        cfg = resolve(cfg, sharding.make_mesh(cfg.mesh, jax.devices()), Target.of_device(jax.devices()[0]))
        assert cfg.model.fuse_projections == want
