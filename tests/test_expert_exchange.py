"""Expert-parallel dropless MoE (maxtext_rocm/parallel/experts.py): the CPU's ragged all-to-all
has jax.lax.ragged_all_to_all's documented semantics and a true transpose, the exchange plan
delivers every row to its expert's device grouped by expert, and the layer under shard_map gives
one device's values and gradients on every mesh that splits the experts."""

import functools

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest
from flax import linen as nn
from jax.sharding import NamedSharding, PartitionSpec as P

from maxtext_rocm.parallel import sharding
from maxtext_rocm.models import moe
from maxtext_rocm.parallel import experts as ep

from test_moe import mixtral_config


def axis_mesh(devices, n):
    return jax.make_mesh((n,), ("x",), devices=devices[:n], axis_types=(jax.sharding.AxisType.Auto,))


def reference_ragged_all_to_all(operands, outputs, input_offsets, send_sizes, output_offsets, recv_sizes):
    """The pseudocode of jax.lax.ragged_all_to_all's docstring, over all devices at once (numpy)."""
    n_devices, n_slices = input_offsets.shape
    per_peer = n_slices // n_devices
    results = [o.copy() for o in outputs]
    for src in range(n_devices):
        for i in range(n_slices):
            dst = i // per_peer
            data = operands[src][input_offsets[src, i]:input_offsets[src, i] + send_sizes[src, i]]
            # The receiver's slice index for this sender: src * per_peer + i % per_peer.
            j = src * per_peer + i % per_peer
            assert recv_sizes[dst, j] == len(data)
            results[dst][output_offsets[src, i]:output_offsets[src, i] + len(data)] = data
    return results


def random_exchange(rng, n_devices, per_peer, rows, out_rows):
    """Ragged all-to-all arguments: each device sends contiguous slices of random sizes, and each
    receiver packs what it gets contiguously in sender order (the layout exchange_plan makes)."""
    n_slices = n_devices * per_peer
    send = np.zeros((n_devices, n_slices), np.int32)
    for src in range(n_devices):
        cuts = np.sort(rng.integers(0, rows + 1, n_slices - 1))
        send[src] = np.diff(np.concatenate([[0], cuts, [rows]]))
    input_offsets = np.cumsum(send, axis=1) - send
    recv = np.zeros_like(send)
    output_offsets = np.zeros_like(send)
    for dst in range(n_devices):
        at = 0
        for src in range(n_devices):
            for t in range(per_peer):
                i = dst * per_peer + t
                recv[dst, src * per_peer + t] = send[src, i]
                output_offsets[src, i] = at
                at += send[src, i]
        assert at <= out_rows
    return input_offsets, send, output_offsets, recv


@pytest.mark.parametrize("n_devices, per_peer", [(4, 1), (4, 2), (2, 3)])
def test_padded_ragged_all_to_all_has_the_documented_semantics(devices, n_devices, per_peer):
    rng = np.random.default_rng(n_devices * 10 + per_peer)
    rows, out_rows, d = 6, n_devices * 6, 3
    args = random_exchange(rng, n_devices, per_peer, rows, out_rows)
    operands = rng.normal(size=(n_devices, rows, d)).astype(np.float32)
    outputs = rng.normal(size=(n_devices, out_rows, d)).astype(np.float32)  # uncovered rows stay
    expected = np.concatenate(reference_ragged_all_to_all(operands, outputs, *args))

    mesh = axis_mesh(devices, n_devices)
    spec = P("x")
    exchange = jax.jit(jax.shard_map(
        lambda o, out, *a: ep.padded_ragged_all_to_all(o, out, *(v[0] for v in a), axis_name="x"),
        mesh=mesh, in_specs=(spec,) * 6, out_specs=spec))
    got = exchange(operands.reshape(-1, d), outputs.reshape(-1, d), *(jnp.asarray(a) for a in args))
    np.testing.assert_array_equal(np.asarray(got), expected)

    # Its gradient is its transpose: <A x, y> = <x, A^T y> for random x, y (A linear in the operand
    # and the output), which does not rely on how the backward pass is written.
    x = jnp.asarray(operands.reshape(-1, d))
    out = jnp.asarray(outputs.reshape(-1, d))
    y = jnp.asarray(rng.normal(size=(n_devices * out_rows, d)).astype(np.float32))
    a = tuple(jnp.asarray(v) for v in args)
    value, vjp = jax.vjp(lambda x, out: exchange(x, out, *a), x, out)
    d_x, d_out = vjp(y)
    lhs = float(jnp.sum(value * y))
    rhs = float(jnp.sum(x * d_x) + jnp.sum(out * d_out))
    assert abs(lhs - rhs) <= 1e-5 * max(1.0, abs(lhs))


def test_exchange_plan_delivers_rows_grouped_by_expert(devices):
    """Rows tagged with (device, expert, rank): after the dispatch each device holds exactly the
    rows of its experts, grouped by expert then sender, and the combine brings each row home."""
    n_devices, n_experts, rows = 4, 8, 12
    rng = np.random.default_rng(0)
    row_experts = np.sort(rng.integers(0, n_experts, (n_devices, rows)), axis=1)  # sorted, as the layer's
    group_sizes = np.stack([np.bincount(e, minlength=n_experts) for e in row_experts]).astype(np.int32)
    tags = np.stack([np.stack([np.full(rows, dev), row_experts[dev], np.arange(rows)], -1)
                     for dev in range(n_devices)]).astype(np.float32)  # [dev, rows, 3]

    def local(tags, sizes):
        plan = ep.exchange_plan(sizes[0], n_devices, jax.lax.axis_index("x"), "x")
        got = ep.dispatch(tags, plan, n_devices * rows, ep.padded_ragged_all_to_all, "x")
        back = ep.combine(got, plan, rows, ep.padded_ragged_all_to_all, "x")
        return got, back, plan.local_group_sizes[None]

    mesh = axis_mesh(devices, n_devices)
    got, back, local_sizes = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(P("x"), P("x")),
                                                   out_specs=(P("x"), P("x"), P("x"))))(
        tags.reshape(-1, 3), group_sizes)
    got = np.asarray(got).reshape(n_devices, n_devices * rows, 3)
    np.testing.assert_array_equal(np.asarray(back), tags.reshape(-1, 3))
    per_device = n_experts // n_devices
    for dev in range(n_devices):
        mine = [tuple(t) for src in range(n_devices) for t in tags[src]
                if t[1] // per_device == dev]
        expected = sorted(mine, key=lambda t: (t[1], t[0], t[2]))  # expert, then sender, then rank
        n = len(expected)
        assert [tuple(t) for t in got[dev, :n]] == expected
        np.testing.assert_array_equal(np.asarray(local_sizes)[dev],
                                      group_sizes[:, dev * per_device:(dev + 1) * per_device].sum(0))


def layer_inputs(n_experts=8, k=2, batch=8, seq=16, d=32, f=16, seed=0):
    keys = jax.random.split(jax.random.key(seed), 5)
    x = jax.random.normal(keys[0], (batch, seq, d))
    logits = jax.random.normal(keys[1], (batch, seq, n_experts)) * 2.0
    # Skewed routing: expert 0 is favoured, so devices receive unequal row counts.
    _, weights, chosen = moe.route(logits.at[..., 0].add(1.5), k)
    w = [jax.random.normal(key, shape) / np.sqrt(shape[1]) for key, shape in
         zip(keys[2:], ((n_experts, d, f), (n_experts, d, f), (n_experts, f, d)))]
    return x, weights, chosen, w


SLOW = pytest.mark.slow  # ~20-30 s each on 2 cores; CI keeps the mesh that uses every collective


@pytest.mark.parametrize("mesh_axes", [
    pytest.param({"expert": 8}, marks=SLOW),
    {"expert": 2, "tensor": 2, "fsdp": 2},
    pytest.param({"expert": 4, "sequence": 2}, marks=SLOW),
    pytest.param({"expert": 2, "data": 2, "fsdp": 2}, marks=SLOW),
])
def test_expert_parallel_layer_matches_one_device(devices, mesh_axes):
    cfg = mixtral_config(**{f"mesh.ici.{a}": mesh_axes.get(a, 1) for a in ("data", "fsdp", "expert", "sequence", "tensor")})
    mesh = sharding.make_mesh(cfg.mesh, devices)
    layer = ep.expert_exchange(ml_collections.FrozenConfigDict(cfg.model), mesh)
    x, weights, chosen, w = layer_inputs()
    readout = jax.random.normal(jax.random.key(9), x.shape)

    def objective(fn, x, weights, *w):
        return jnp.sum(fn(x, weights, chosen, *w) * readout)

    reference = jax.jit(jax.value_and_grad(functools.partial(objective, moe.dense_experts), argnums=(0, 1, 2, 3, 4)))
    ref_value, ref_grads = reference(x, weights, *w)

    def spec(*names):
        return NamedSharding(mesh, nn.logical_to_mesh_axes(names, sharding.LOGICAL_RULES))

    tokens = spec("activation_batch", "activation_length", None)
    in_shardings = (tokens, tokens, spec(*moe.GATE_UP_AXES), spec(*moe.GATE_UP_AXES), spec(*moe.DOWN_AXES))
    sharded = jax.jit(jax.value_and_grad(functools.partial(objective, layer), argnums=(0, 1, 2, 3, 4)),
                      in_shardings=in_shardings)
    with jax.set_mesh(mesh):
        value, grads = sharded(x, weights, *w)
    assert abs(float(value) - float(ref_value)) <= 1e-5 * abs(float(ref_value))
    for name, g, r in zip(("x", "weights", "gate", "up", "down"), grads, ref_grads):
        scale = float(jnp.max(jnp.abs(r)))
        np.testing.assert_allclose(np.asarray(g), np.asarray(r), atol=1e-5 * scale, rtol=1e-5, err_msg=name)


def test_gpu_program_exchanges_with_ragged_all_to_all(devices):
    """The program a GPU target gets (what python -m maxtext_rocm.compile builds) moves rows with ragged
    all-to-alls over `expert` and never gathers all tokens; the CPU's program uses the padded
    stand-in. Checked on the lowered StableHLO, since XLA:CPU cannot compile the ragged op."""
    cfg = mixtral_config(**{"mesh.ici.expert": 8})
    mesh = sharding.make_mesh(cfg.mesh, devices)
    x, weights, chosen, w = layer_inputs()
    texts = {}
    for backend in ("gpu", "cpu"):
        layer = ep.expert_exchange(ml_collections.FrozenConfigDict(cfg.model), mesh, backend)
        grad = jax.jit(jax.grad(lambda x, *w: jnp.sum(layer(x, weights, chosen, *w) ** 2), argnums=(0, 1, 2, 3)))
        with jax.set_mesh(mesh):
            texts[backend] = grad.lower(x, *w).as_text()
    # dispatch and combine, forward and backward
    assert texts["gpu"].count("ragged_all_to_all") >= 4
    assert "ragged_all_to_all" not in texts["cpu"] and "all_to_all" in texts["cpu"]
