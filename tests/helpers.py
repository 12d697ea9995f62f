"""Shared by the numerical tests: a run's initial state and the loss and gradients of a batch."""

import importlib
import os
import sys
import threading
import types

import jax
import numpy as np
from flax import linen as nn

from maxtext_rocm import config as config_lib
from maxtext_rocm.trainer import launch
from maxtext_rocm.parallel import sharding
from maxtext_rocm.data import batch_spec
from maxtext_rocm.parallel import context
from maxtext_rocm.trainer.step import gradients
from maxtext_rocm.trainer.preflight import check_run
from maxtext_rocm.resolve import Target, resolve


def script_module(name: str):
    """scripts/NAME.py imported as a module (scripts/ is not a package)."""
    scripts = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts")
    sys.path.insert(0, scripts)
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(scripts)


def initial_run(cfg, devices) -> types.SimpleNamespace:
    """A run at initialisation, made as the Trainer makes it (launch.py's model, state layout and
    data sources) without compiling the train step, which the numerical tests never run:
    .cfg (resolved: maxtext_rocm/resolve.py), .mesh, .model, .state, .batch(step) (a sharded device batch), .sharding_rules() (for tracing)
    and .storage_order (a pipeline's storage <-> model order converter, or None: launch.stored_state)."""
    check_run(cfg, len(devices), 1)
    mesh = sharding.make_mesh(cfg.mesh, devices)
    cfg = resolve(cfg, mesh, Target.of_device(devices[0]))
    model = launch.model_for_mesh(cfg, launch.run_policy(cfg, devices[0]), mesh)
    layout = launch.stored_state(cfg, model, mesh)
    state = jax.jit(lambda k: nn.meta.unbox(layout.init(k)), out_shardings=layout.sharding)(layout.key)
    global_batch = config_lib.global_batch_size(cfg, len(devices))
    data, _ = launch.data_sources(cfg, global_batch, None)
    batch_layout = context.mesh_layout(cfg.model, mesh)  # the Trainer's layout over `sequence`
    batch_sharding, dtypes = sharding.batch_sharding(mesh), batch_layout.batch_dtypes(batch_spec(cfg.data))

    def batch(step):
        return launch.place_batch(data.batch(step), batch_layout, batch_sharding, dtypes, global_batch)

    return types.SimpleNamespace(cfg=cfg, mesh=mesh, model=model, state=state, batch=batch, layout=batch_layout,
                                 storage_order=layout.storage_order,
                                 sharding_rules=lambda: sharding.rules_context(mesh))


def loss_and_grads(cfg, devices, step=0):
    """(loss, gradients as host numpy, the run of `initial_run` with the step's summed metrics as
    .sums) of batch `step` at initialisation, with the config's accumulation and z-loss. The
    gradients are in the model's layer order whatever order a pipeline stores the stack in."""
    run = initial_run(cfg, devices)
    grad_fn = jax.jit(lambda p, b: gradients(p, run.model, b, cfg.train.grad_accum, cfg.train.z_loss_weight))
    run.grad_fn = grad_fn  # called again with arrays like these, it reuses the compiled program
    with run.sharding_rules():
        grads, _, run.sums = grad_fn(run.state.params, run.batch(step))
    if run.storage_order is not None:
        run.stored_grads = jax.tree_util.tree_map(np.asarray, grads)  # storage order, empty slots included
        grads = run.storage_order.params_to_canonical(grads)
    return float(run.sums["loss"]), jax.tree_util.tree_map(np.asarray, grads), run


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


class KeyValueStore:
    """In process, the two calls of JAX's coordination-service key-value store that the stop
    agreement uses (runtime/preemption.py): a blocking get waits until the key is set."""

    def __init__(self, strict: bool = True):
        self.data, self.cond, self.strict = {}, threading.Condition(), strict

    def key_value_set(self, key, value, allow_overwrite=False):
        with self.cond:
            assert not self.strict or allow_overwrite or key not in self.data, key
            self.data[key] = value
            self.cond.notify_all()

    def blocking_key_value_get(self, key, timeout_ms):
        with self.cond:
            if not self.cond.wait_for(lambda: key in self.data, timeout_ms / 1000):
                raise TimeoutError(key)
            return self.data[key]


def temporaries_bytes(cfg, devices) -> int:
    """The compiled gradient program's temporaries per device (compile only, nothing runs)."""
    from maxtext_rocm.trainer.step import gradients

    run = initial_run(cfg, devices)
    fn = jax.jit(lambda p, b: gradients(p, run.model, b, cfg.train.grad_accum, cfg.train.z_loss_weight))
    with run.sharding_rules():
        compiled = fn.lower(run.state.params, run.batch(0)).compile()
    return compiled.memory_analysis().temp_size_in_bytes

