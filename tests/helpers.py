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


def assert_close(got, want, scale=1e-5, rtol=1e-5, err_msg=""):
    """`got` equals the reference `want` (arrays, scalars or matching pytrees) to within
    `scale * max|want|` per element (per leaf of a tree), plus `rtol * |want|`.

    fp32 results of differently ordered sums (chunked vs full, sharded vs single device,
    accumulated vs one batch) differ by a few ulps of the LARGEST terms summed, so an element near
    zero can be off by 1e-3 of itself: the error is absolute at the scale of the tensor, never an
    absolute 1e-7 picked on one CPU. A 1e-3 relative error still fails (tests/test_helpers.py)."""
    flat_got = jax.tree_util.tree_leaves_with_path(got)
    flat_want = jax.tree_util.tree_leaves(want)
    assert len(flat_got) == len(flat_want), (len(flat_got), len(flat_want))
    for (path, x), y in zip(flat_got, flat_want):
        x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
        atol = scale * float(np.max(np.abs(y), initial=0.0))
        np.testing.assert_allclose(x, y, atol=atol, rtol=rtol, err_msg=f"{err_msg}{jax.tree_util.keystr(path)}")
