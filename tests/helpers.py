"""Shared by the numerical tests: build a Trainer and take the loss and gradients of a batch."""

import jax
import numpy as np

from maxtext_rocm.step import gradients
from maxtext_rocm.train import Trainer


def loss_and_grads(cfg, devices, step=0):
    """(loss, gradients as host numpy, trainer) of the trainer's batch `step` at initialisation."""
    trainer = Trainer(cfg, devices=devices, log=lambda *_: None)
    batch = trainer.device_batch(step)
    grad_fn = jax.jit(lambda p, b: gradients(p, trainer.model, b, cfg.train.grad_accum, cfg.train.z_loss_weight))
    with trainer.context():
        grads, _, sums = grad_fn(trainer.state.params, batch)
    return float(sums["loss"]), jax.tree_util.tree_map(np.asarray, grads), trainer


def assert_trees_close(a, b, atol, rtol=1e-5):
    flat_a = jax.tree_util.tree_leaves_with_path(a)
    flat_b = jax.tree_util.tree_leaves(b)
    assert len(flat_a) == len(flat_b)
    for (path, x), y in zip(flat_a, flat_b):
        np.testing.assert_allclose(x, y, atol=atol, rtol=rtol, err_msg=jax.tree_util.keystr(path))
