"""Mixture of experts: the three implementations agree, capacity drops what it should, the router
losses are right and reach the objective, expert-parallel meshes match one device, Mixtral presets
have their published sizes, and the tiny Mixtral learns."""

import json
import math

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest
from flax import linen as nn
from jax.sharding import PartitionSpec as P

from maxtext_rocm import config as config_lib
from maxtext_rocm.reporting import metrics
from maxtext_rocm.api import count_active_params, count_params
from maxtext_rocm.models import blocked_experts, build_model, moe
from maxtext_rocm.models.attention import attention_mask
from maxtext_rocm.numerics.precision import policy_from_config
from maxtext_rocm.resolve import resolve_here
from maxtext_rocm.trainer.step import summed_loss
from maxtext_rocm.train import Trainer
from maxtext_rocm.trainer.preflight import check_run

from conftest import small_config
from helpers import assert_close, loss_and_grads

SINGLE = {f"mesh.ici.{a}": 1 for a in ("data", "fsdp", "expert", "sequence", "tensor")}


def mixtral_config(**overrides):
    """small_config as a Mixtral: 8 experts, 2 per token, scanned and rematerialised layers."""
    return small_config(**{"model.family": "mixtral", "model.n_experts": 8, "model.experts_per_token": 2,
                           "model.mlp_dim": 32, "model.remat": "full", **overrides})


def moe_layer(impl, capacity_factor=1.25):
    cfg = resolve_here(mixtral_config(**{"model.moe_impl": impl, "model.moe_capacity_factor": capacity_factor}))
    return moe.MoE(ml_collections.FrozenConfigDict(cfg.model), policy_from_config(cfg.precision))


# ----------------------------------------------------------------------------------------------
# The implementations agree


def test_dropless_capacity_and_dense_agree_in_outputs_and_gradients():
    x = jax.random.normal(jax.random.key(1), (3, 24, 64), jnp.float32)
    params = moe_layer("dense").init(jax.random.key(0), x)["params"]

    def run(impl, factor=1.25):
        layer = moe_layer(impl, factor)

        def loss(p, x):
            out = layer.apply({"params": p}, x)
            return jnp.sum(jnp.sin(out)), out  # a nonlinear readout, so every output's gradient differs

        (_, out), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(params, x)
        return out, grads

    ref_out, ref_grads = run("dense")
    # factor E/k: every expert has a slot for every token, so nothing can drop.
    for impl, factor in (("dropless", 1.25), ("capacity", 8 / 2)):
        out, grads = run(impl, factor)
        assert_close(out, ref_out, err_msg=impl)
        assert_close(grads, ref_grads, err_msg=impl)
    assert float(jnp.max(jnp.abs(ref_out))) > 0.1  # not vacuously equal


@pytest.mark.parametrize("block, skewed", [(0, False), (1, True), (8, True), (64, False)])
def test_blocked_dropless_equals_dense(block, skewed):
    """The CPU's blocked layout (block > 0) and ragged_dot (block 0) against every expert on every
    token, outputs and gradients (inputs and weights); `skewed` routes everything to experts 1 and
    5, so the other experts get no rows and two get many blocks."""
    keys = jax.random.split(jax.random.key(3), 6)
    b, s, d, f, n_experts, k = 2, 24, 16, 24, 8, 2
    x = jax.random.normal(keys[0], (b, s, d))
    logits = jax.random.normal(keys[1], (b, s, n_experts))
    if skewed:
        logits = logits + 50.0 * jnp.isin(jnp.arange(n_experts), jnp.array([1, 5]))
    _, weights, experts = moe.route(logits, k)
    w = [jax.random.normal(keys[i], shape) / 4 for i, shape in
         zip(range(2, 5), ((n_experts, d, f), (n_experts, d, f), (n_experts, f, d)))]

    def readout(fn, x, *ws):
        return jnp.sum(jnp.sin(fn(x, weights, experts, *ws)))

    dropless = jax.jit(jax.value_and_grad(
        lambda *a: readout(lambda *b: moe.dropless_experts(*b, block=block), *a), argnums=(0, 1, 2, 3)))
    dense = jax.value_and_grad(lambda *a: readout(moe.dense_experts, *a), argnums=(0, 1, 2, 3))
    (value, grads), (ref_value, ref_grads) = dropless(x, *w), dense(x, *w)
    np.testing.assert_allclose(value, ref_value, rtol=1e-5)
    assert_close(grads, ref_grads)
    if skewed:
        assert float(jnp.abs(ref_grads[1][0]).max()) == 0.0  # expert 0 got no rows


def test_dropless_block_size():
    assert blocked_experts.dropless_block(8192, 8, "cpu") == 128
    assert blocked_experts.dropless_block(144, 8, "cpu") == 8
    assert blocked_experts.dropless_block(4, 8, "cpu") == 8
    assert blocked_experts.dropless_block(8192, 8, "gpu") == 0  # ragged_dot, a grouped GEMM


def test_take_rows_gradient_is_a_gather_equal_to_the_scatter_add():
    """take_rows' gradient (a gather through `sources`) against JAX's transpose of the same
    gather (a scatter-add): a row taken twice sums both cotangents, a row taken nowhere gets
    zero, an out-of-range index gives a zero row; bf16 included (the pair's sum rounds once)."""
    index = jnp.array([2, 0, 2, 5, 4])  # row 2 twice, rows 1 and 3 nowhere, 5 is out of range
    sources = jnp.array([[1, 5], [5, 5], [0, 2], [5, 5], [4, 5]])  # 5: no second place
    for dtype in (jnp.float32, jnp.bfloat16):
        x = jax.random.normal(jax.random.key(0), (5, 3), dtype)
        readout = jax.random.normal(jax.random.key(1), (5, 3), dtype)
        grad = jax.grad(lambda x: jnp.sum(blocked_experts.take_rows(x, index, sources) * readout).astype(jnp.float32))(x)
        expected = jnp.take(x, index, axis=0, mode="fill", fill_value=0)
        expected_grad = jax.grad(lambda x: jnp.sum(jnp.take(x, index, axis=0, mode="fill", fill_value=0)
                                                   * readout).astype(jnp.float32))(x)
        np.testing.assert_array_equal(blocked_experts.take_rows(x, index, sources), expected)
        np.testing.assert_array_equal(grad, expected_grad)
        np.testing.assert_array_equal(grad[1], 0.0)
        assert "scatter" not in str(jax.make_jaxpr(jax.grad(
            lambda x: jnp.sum(blocked_experts.take_rows(x, index, sources)).astype(jnp.float32)))(x))


@pytest.mark.parametrize("block", [0, 8])
def test_dropless_gradient_has_no_scatter(block):
    """Every move of rows in the dropless layer's gradient is a gather: no scatter-add, whose
    accumulation order GPUs do not fix (atomics)."""
    keys = jax.random.split(jax.random.key(4), 5)
    x = jax.random.normal(keys[0], (2, 16, 8))
    _, weights, experts = moe.route(jax.random.normal(keys[1], (2, 16, 4)), 2)
    w = [jax.random.normal(k, s) for k, s in zip(keys[2:], ((4, 8, 12), (4, 8, 12), (4, 12, 8)))]
    jaxpr = jax.make_jaxpr(jax.grad(lambda x, *w: jnp.sum(moe.dropless_experts(x, weights, experts, *w, block=block)),
                                    argnums=(0, 1, 2, 3)))(x, *w)
    assert "scatter" not in str(jaxpr)


def test_small_capacity_drops_exactly_the_later_choices():
    # One sequence of 6 tokens, 3 experts, top-2, with this routing (first choice, second choice):
    experts = jnp.array([[[0, 1], [0, 2], [1, 0], [0, 1], [2, 1], [1, 2]]])
    weights = jnp.full((1, 6, 2), 0.5)
    capacity = moe.expert_capacity(6, 3, 2, factor=0.5)  # ceil(0.5 * 6 * 2 / 3) = 2 slots
    assert capacity == 2
    # Slots fill in token order, first choice before second: expert 0 takes tokens 0 and 1, so
    # token 2's second choice and token 3's first are dropped; expert 1 takes tokens 0 and 2, so
    # tokens 3, 4 and 5 lose theirs; expert 2 takes tokens 1 and 4, so token 5's second is dropped.
    kept = np.array([[1, 1], [1, 1], [1, 0], [0, 0], [1, 0], [0, 0]], dtype=bool)
    slots = moe.capacity_slots(experts, 3)
    np.testing.assert_array_equal(slots[0] < capacity, kept)

    d, f = 8, 16
    keys = jax.random.split(jax.random.key(0), 4)
    x = jax.random.normal(keys[0], (1, 6, d))
    gate, up = (jax.random.normal(k, (3, d, f)) for k in keys[1:3])
    down = jax.random.normal(keys[3], (3, f, d))
    dropped = jax.jit(moe.capacity_experts, static_argnums=6)(x, weights, experts, gate, up, down, capacity)
    # The same computation with the dropped choices' weights set to zero and nothing dropped.
    dense = jax.jit(moe.dense_experts)
    expected = dense(x, weights * kept, experts, gate, up, down)
    assert_close(dropped, expected)
    np.testing.assert_array_equal(dropped[0, 3], 0.0)  # both choices dropped: no expert output
    assert np.abs(dropped[0, 2] - dense(x, weights, experts, gate, up, down)[0, 2]).max() > 1e-3


# ----------------------------------------------------------------------------------------------
# Routing and the router losses


def test_routing_renormalises_the_top_k():
    logits = jnp.log(jnp.array([[0.1, 0.6, 0.3]]))
    probs, weights, experts = moe.route(logits, 2)
    np.testing.assert_allclose(probs, [[0.1, 0.6, 0.3]], rtol=1e-6)
    np.testing.assert_array_equal(experts, [[1, 2]])
    np.testing.assert_allclose(weights, [[0.6 / 0.9, 0.3 / 0.9]], rtol=1e-6)


@pytest.mark.parametrize("shape, k, ties", [((2, 16, 8), 2, False), ((2, 9, 128), 8, False), ((3, 7, 8), 3, True)])
def test_top_k_of_each_is_lax_top_k_in_values_indices_and_gradient(shape, k, ties):
    """The router's sort-based top-k (partitioned along the tokens, where XLA's TopK gathers them)
    is jax.lax.top_k: the same values, the same indices with ties to the lower index, and the
    same gradient, bit for bit."""
    values = jax.random.normal(jax.random.key(k), shape)
    if ties:  # coarse values, signed zeros and a repeated first column: many exact ties
        values = jnp.round(values * 2) / 2
        values = values.at[..., 0].set(values[..., 1])
    expected, got = jax.lax.top_k(values, k), moe.top_k_of_each(values, k)
    np.testing.assert_array_equal(got[0], expected[0])
    np.testing.assert_array_equal(got[1], expected[1])
    readout = jax.random.normal(jax.random.key(0), expected[0].shape)
    grads = [jax.grad(lambda v: jnp.sum(top_k(v, k)[0] * readout))(values)
             for top_k in (jax.lax.top_k, moe.top_k_of_each)]
    np.testing.assert_array_equal(grads[1], grads[0])


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_top_k_of_each_orders_signed_zeros_infinities_and_nans_as_lax_top_k(dtype):
    """top_k orders floats totally: -0 below +0, a NaN above everything or, negative, below."""
    values = jnp.array([0.0, -0.0, jnp.nan, -jnp.nan, jnp.inf, -jnp.inf, 1.0, -1.0, 0.0, -0.0, jnp.nan], dtype)
    bits = jnp.int32 if dtype == jnp.float32 else jnp.int16
    for k in range(1, values.size + 1):
        expected, got = jax.lax.top_k(values, k), moe.top_k_of_each(values, k)
        np.testing.assert_array_equal(got[1], expected[1])
        np.testing.assert_array_equal(jax.lax.bitcast_convert_type(got[0], bits),
                                      jax.lax.bitcast_convert_type(expected[0], bits))


def test_load_balancing_loss_by_hand():
    probs = jnp.array([[0.9, 0.1], [0.8, 0.2], [0.3, 0.7], [0.6, 0.4]])
    experts = jnp.array([[0], [0], [1], [0]])  # top-1
    # f = (3/4, 1/4); P = (0.65, 0.35); 2 * (0.75 * 0.65 + 0.25 * 0.35) = 1.15
    assert float(moe.load_balancing_loss(probs, experts)) == pytest.approx(1.15, rel=1e-6)
    # Top-2 of 3 experts over 2 tokens: counts (2, 1, 1) / 2 tokens; perfectly uniform
    # probabilities give E * sum f_e / E = k = 2 whatever the counts.
    uniform = jnp.full((2, 3), 1 / 3)
    assert float(moe.load_balancing_loss(uniform, jnp.array([[0, 1], [0, 2]]))) == pytest.approx(2.0)
    logits = jnp.array([[0.0, jnp.log(3.0)]])
    assert float(moe.router_z_loss(logits)) == pytest.approx(math.log(4.0) ** 2, rel=1e-6)


def test_router_losses_reach_the_objective():
    cfg = mixtral_config(**{"model.moe_aux_loss_weight": 0.5, "model.moe_router_z_loss_weight": 0.25})
    batch = {"inputs": jax.random.randint(jax.random.key(0), (2, 32), 0, 128)}
    batch.update(targets=jnp.roll(batch["inputs"], -1, axis=1), weights=jnp.ones((2, 32)))
    cfg = resolve_here(cfg)
    model = build_model(cfg.model, policy_from_config(cfg.precision))
    params = nn.meta.unbox(jax.jit(model.init)(jax.random.key(1), batch["inputs"])["params"])
    objective, sums = jax.jit(lambda p, b: summed_loss(p, model, b, 0.0))(params, batch)
    # Sums hold each router loss (a mean over layers and tokens) times the tokens, like the
    # cross-entropy, so dividing by the token count gives the means the metrics report.
    aux, z = float(sums["moe_aux_loss"]) / 64, float(sums["moe_z_loss"]) / 64
    assert 1.5 < aux < 4.0  # near balance at init: about k = 2
    assert z > 1.0
    expected = float(sums["ce"]) + 0.5 * float(sums["moe_aux_loss"]) + 0.25 * float(sums["moe_z_loss"])
    assert float(objective) == pytest.approx(expected, rel=1e-6)


# ----------------------------------------------------------------------------------------------
# Expert parallelism: meshes on 8 fake devices match one device


# Capacity factor E/k: nothing is dropped, so one reference serves every implementation.
NO_DROPS = {"model.moe_capacity_factor": 4.0}


@pytest.fixture(scope="module")
def single_device_mixtral(tmp_path_factory):
    cfg = mixtral_config(**SINGLE, **NO_DROPS, **{"model.moe_impl": "capacity", "train.per_device_batch_size": 8,
                                                  "output_dir": str(tmp_path_factory.mktemp("one"))})
    loss, grads, _ = loss_and_grads(cfg, jax.devices()[:1])
    return loss, grads


@pytest.mark.parametrize("mesh, impl", [
    ({"expert": 8}, "capacity"),
    pytest.param({"expert": 4, "fsdp": 2}, "capacity", marks=pytest.mark.slow),  # CI budget: the others cover it
    ({"expert": 2, "tensor": 2, "fsdp": 2}, "capacity"),
    ({"expert": 4, "fsdp": 2}, "dropless"),  # rows exchanged between devices (parallel/experts.py)
    pytest.param({"expert": 2, "tensor": 2, "fsdp": 2}, "dropless", marks=pytest.mark.slow),  # layer-level in CI
])
def test_expert_parallel_mesh_matches_single_device(mesh, impl, single_device_mixtral, devices, tmp_path):
    overrides = dict(SINGLE, **{f"mesh.ici.{a}": s for a, s in mesh.items()})
    cfg = mixtral_config(**overrides, **NO_DROPS, **{"model.moe_impl": impl, "output_dir": str(tmp_path)})
    loss, grads, trainer = loss_and_grads(cfg, devices)
    ref_loss, ref_grads = single_device_mixtral

    # [layers, experts, d_model, mlp]: experts split over `expert`, d_model FSDP-sharded over the
    # other FSDP axes only, mlp over `tensor` (Linen names mesh axes of size 1 too).
    gate = trainer.state.params["layers"]["moe"]["gate"]
    assert gate.sharding.spec == P("stage", "expert", ("fsdp", "sequence"), "tensor")
    assert not gate.sharding.is_fully_replicated
    assert_close(loss, ref_loss)
    assert_close(grads, ref_grads)


def test_expert_count_must_divide_over_the_expert_axis():
    cfg = mixtral_config(**dict(SINGLE, **{"mesh.ici.expert": 8, "model.n_experts": 4}))
    with pytest.raises(config_lib.ConfigError, match="model.n_experts=4 does not divide"):
        check_run(cfg, device_count=8)
    dense = small_config(**dict(SINGLE, **{"mesh.ici.expert": 8}))  # dense: expert splits the batch
    check_run(dense, device_count=8)


# ----------------------------------------------------------------------------------------------
# Config, presets, FLOPs


@pytest.mark.parametrize("overrides, message", [
    ({"model.n_experts": 8}, "model.n_experts=8 has no effect on model.family='llama'"),
    ({"model.family": "mixtral", "model.n_experts": 1}, "model.n_experts=1 is not valid"),
    ({"model.family": "mixtral", "model.n_experts": 4, "model.experts_per_token": 5}, "model.experts_per_token=5"),
    ({"model.family": "mixtral", "model.n_experts": 4, "model.moe_impl": "ragged"}, "model.moe_impl='ragged'"),
    ({"model.family": "mixtral", "model.n_experts": 4, "model.moe_capacity_factor": 0.0}, "model.moe_capacity_factor"),
    ({"model.sliding_window": -1}, "model.sliding_window=-1"),
])
def test_bad_moe_keys_are_one_sentence_errors(overrides, message):
    with pytest.raises(config_lib.ConfigError, match=message.replace("(", r"\(")):
        config_lib.load("tiny_llama", overrides=overrides)


@pytest.mark.parametrize("preset, total, active", [
    ("mixtral_8x7b", 46.7e9, 12.9e9),
    ("mixtral_8x22b", 140.6e9, 39.2e9),
])
def test_mixtral_parameter_counts(preset, total, active):
    cfg = config_lib.load(preset)
    assert count_params(cfg) == pytest.approx(total, rel=0.005)
    assert count_active_params(cfg) == pytest.approx(active, rel=0.005)


def test_flops_count_active_parameters():
    cfg = config_lib.load("tiny_mixtral")
    m = cfg.model
    dense = cfg.copy_and_resolve_references()
    dense.model.update(family="llama", n_experts=1, experts_per_token=1, mlp_dim=2 * m.mlp_dim)
    # Two experts of mlp 384 per token cost one dense MLP of 768, plus the router.
    assert metrics.matmul_params(m) == metrics.matmul_params(dense.model) + m.n_layers * m.d_model * m.n_experts
    # Active matmul parameters are the active parameters minus the embedding gather and the norms.
    norms = (2 * m.n_layers + 1) * m.d_model
    assert metrics.matmul_params(m) == count_active_params(cfg) - m.vocab_size * m.d_model - norms
    # Llama keys stay harmless for a dense model.
    assert count_active_params(config_lib.load("tiny_llama")) == count_params(config_lib.load("tiny_llama"))


def test_auto_never_drops_tokens():
    assert moe.resolve_implementation("auto", "cpu") == "dropless"
    assert moe.resolve_implementation("auto", "gpu") == "dropless"
    assert moe.resolve_implementation("capacity", "gpu") == "capacity"


def test_sliding_window_mask():
    mask = np.asarray(attention_mask(5, None, sliding_window=2))[0, 0]
    expected = np.array([[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [0, 1, 1, 0, 0], [0, 0, 1, 1, 0], [0, 0, 0, 1, 1]], bool)
    np.testing.assert_array_equal(mask, expected)
    np.testing.assert_array_equal(np.asarray(attention_mask(5, None, 0)), np.asarray(attention_mask(5, None)))


# ----------------------------------------------------------------------------------------------
# Learning


@pytest.mark.slow  # CI budget (~60 s): tiny_llama's convergence run stays in the default run
def test_tiny_mixtral_loss_falls_on_embedded_corpus(devices, tmp_path):
    cfg = config_lib.load("tiny_mixtral", overrides=dict(
        SINGLE, **{"train.steps": 40, "train.per_device_batch_size": 4, "train.seq_len": 128,
                   "optimizer.warmup_steps": 10, "log.every": 10, "log.tensorboard": False,
                   "output_dir": str(tmp_path)}))
    trainer = Trainer(cfg, devices=devices[:1], log=lambda *_: None)
    trainer.run()
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    losses = [row["loss"] for row in rows]
    assert losses[0] > losses[-1] + 1.0, losses
    assert all(1.0 < row["moe_aux_loss"] < 4.0 for row in rows), rows  # logged, and near balance
