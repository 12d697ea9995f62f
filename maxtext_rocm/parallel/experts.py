"""Expert parallelism for the dropless mixture of experts: each token row travels to the device
that holds its expert, and back.

Under `mesh.*.expert = P` a device holds E/P of the E experts. GSPMD cannot express the dropless
layer's data-dependent row counts, so it left every device computing on every global row (an
all-reduce of all tokens per layer, no all-to-all). Here the layer runs under `shard_map` over the
whole mesh, each device on its own tokens:

1. route locally, sort the (token, choice) rows by expert (models/moe.py, `sort_by_expert`);
2. exchange the row counts (an all-gather of E integers per device), from which every device
   computes the same plan (`exchange_plan`): which slice of its rows goes to which device, and
   where on the receiver it lands, so that the received rows are already grouped by local expert;
3. dispatch: a ragged all-to-all over the `expert` axis sends each slice once;
4. the local experts on their rows (`grouped_swiglu`: ragged_dot on GPUs, blocks on the CPU);
5. each output row weighed by its router weight (dispatched with the row), then combine: the
   ragged all-to-all back, unsort, sum over the token's choices. Under `tensor` each device
   holds a slice of every expert's hidden units, so the combined output is summed over `tensor`.

Each expert's d_model axis stays FSDP-sharded over the other FSDP axes (`exp_embed`) and is
all-gathered here, which the gradient turns into the reduce-scatter of ZeRO-3.

`jax.lax.ragged_all_to_all` is what GPUs run; XLA:CPU cannot execute it (UNIMPLEMENTED in jax
0.10.2), so the CPU runs `padded_ragged_all_to_all`: the same arguments and semantics through a
fixed-size all-to-all of worst-case buffers (each slice padded to all of a device's rows). Both
consume the one plan, so what the CPU tests check is what a GPU runs, except for the primitive.
The padding makes the CPU's exchange move P times the rows it must: it is for correctness on the
CPU, not speed; `python -m maxtext_rocm.compile` builds the GPU program for GPU targets.
"""

from __future__ import annotations

import functools
import math
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec

from maxtext_rocm.numerics import varying
from maxtext_rocm.parallel import sharding
from maxtext_rocm.models import blocked_experts, moe

Array = jax.Array


# ----------------------------------------------------------------------------------------------
# The plan: who sends which rows where (shared by the GPU's and the CPU's exchange)


class ExchangePlan(NamedTuple):
    """The ragged all-to-alls' arguments for this device, per slice (one (device, expert) pair)."""

    # dispatch: my rows -> the experts' devices
    input_offsets: Array  # [E]: where each slice starts in my sorted rows
    send_sizes: Array  # [E]: its rows
    output_offsets: Array  # [E]: where it lands on its expert's device
    recv_sizes: Array  # [E]: the rows I receive from each (sender, local expert)
    # combine: the experts' outputs -> back to the rows' own devices
    back_input_offsets: Array  # [E]: where each received slice sits in my expert rows
    back_output_offsets: Array  # [E]: where it lands back on its sender
    local_group_sizes: Array  # [E / n_shards]: the rows each of my experts gets in all


def exchange_plan(group_sizes: Array, n_shards: int, me: Array, axis: str) -> ExchangePlan:
    """Arguments of the dispatch and combine ragged all-to-alls for this device.

    `group_sizes` [E]: this device's rows per (global) expert, its rows sorted by expert; expert
    e lives on device e // (E / n_shards) of `axis`. A slice is one (device, expert) pair, so each
    call has E slices, E / n_shards per peer. On the receiver, rows land grouped by its local
    expert and, within an expert, by sender: exactly the layout `grouped_swiglu` takes.
    """
    n_experts = group_sizes.shape[0]
    local = n_experts // n_shards
    counts = jax.lax.all_gather(group_sizes, axis)  # [src, E]: rows src sends to each expert
    per_dest = counts.reshape(n_shards, n_shards, local)  # [src, dst, local expert]
    received = jnp.sum(per_dest, axis=0)  # [dst, local expert]: rows each expert gets in all
    expert_start = jnp.cumsum(received, axis=1) - received  # where each expert's rows begin on dst
    # Where src's rows for (dst, local expert) begin on dst: after the expert's rows from lower srcs.
    chunk_start = expert_start[None] + jnp.cumsum(per_dest, axis=0) - per_dest  # [src, dst, local]
    sender_offsets = jnp.cumsum(counts, axis=1) - counts  # [src, E]: a slice's start in src's rows
    mine = functools.partial(jax.lax.dynamic_index_in_dim, index=me, keepdims=False)
    to_me = mine(jnp.swapaxes(per_dest, 0, 1))  # [src, local]: rows each src sends me, per expert
    return ExchangePlan(
        input_offsets=sender_offsets_of(group_sizes),
        send_sizes=group_sizes,
        output_offsets=mine(chunk_start).reshape(-1),
        recv_sizes=to_me.reshape(-1),
        back_input_offsets=mine(jnp.swapaxes(chunk_start, 0, 1)).reshape(-1),
        back_output_offsets=jax.lax.dynamic_slice_in_dim(sender_offsets, me * local, local, axis=1).reshape(-1),
        local_group_sizes=mine(received))


def sender_offsets_of(group_sizes: Array) -> Array:
    return jnp.cumsum(group_sizes) - group_sizes


def dispatch(rows, plan: ExchangePlan, buffer_rows: int, exchange: Callable, axis: str) -> Array:
    """This device's expert-sorted rows to their experts' devices; returns [buffer_rows, d], the
    rows of this device's experts grouped by expert (then don't-care rows)."""
    out = varying.varying_like(jnp.zeros((buffer_rows, rows.shape[1]), rows.dtype), rows)
    return exchange(rows, out, plan.input_offsets, plan.send_sizes, plan.output_offsets, plan.recv_sizes,
                    axis_name=axis)


def combine(expert_rows, plan: ExchangePlan, n_rows: int, exchange: Callable, axis: str) -> Array:
    """The experts' output rows back to the devices (and the sorted places) they came from."""
    out = varying.varying_like(jnp.zeros((n_rows, expert_rows.shape[1]), expert_rows.dtype), expert_rows)
    return exchange(expert_rows, out, plan.back_input_offsets, plan.recv_sizes, plan.back_output_offsets,
                    plan.send_sizes, axis_name=axis)


# ----------------------------------------------------------------------------------------------
# The CPU's ragged all-to-all


@functools.partial(jax.custom_vjp, nondiff_argnums=(6,))
def _padded_exchange(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, axis_name):
    rows = operand.shape[0]
    n_slices = input_offsets.shape[0]
    # Pack: slice i padded to `rows` rows (a slice is never longer than the operand).
    j = jnp.arange(rows)
    take = jnp.where(j[None] < send_sizes[:, None], input_offsets[:, None] + j[None], rows)  # [N, rows]
    packed = jnp.take(operand, take.reshape(-1), axis=0, mode="fill", fill_value=0)
    packed = packed.reshape(n_slices, rows, *operand.shape[1:])
    # Slice i goes to peer i // (N / peers); peer p's slices for me arrive as block p.
    received = jax.lax.all_to_all(packed, axis_name, 0, 0, tiled=True)
    offsets = jax.lax.all_to_all(output_offsets, axis_name, 0, 0, tiled=True)
    # Place: output row o comes from the received slice that covers it, if one does.
    o = jnp.arange(output.shape[0])
    covers = (o[:, None] >= offsets[None]) & (o[:, None] < (offsets + recv_sizes)[None])  # [out, N]
    slice_of = jnp.argmax(covers, axis=1)
    covered = jnp.any(covers, axis=1)
    flat = jnp.where(covered, slice_of * rows + o - offsets[slice_of], n_slices * rows)
    placed = jnp.take(received.reshape(n_slices * rows, *operand.shape[1:]), flat, axis=0,
                      mode="fill", fill_value=0)
    covered = covered.reshape(-1, *(1,) * (operand.ndim - 1))
    return jnp.where(covered, placed, output)


def _padded_exchange_fwd(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, axis_name):
    out = _padded_exchange(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, axis_name)
    return out, (operand.shape, input_offsets, send_sizes, output_offsets, recv_sizes)


def _padded_exchange_bwd(axis_name, residuals, d_out):
    # The transpose is the exchange the other way round, as jax.lax.ragged_all_to_all's is:
    # each received slice goes back to where it was taken from.
    operand_shape, input_offsets, send_sizes, output_offsets, recv_sizes = residuals
    where_received = jax.lax.all_to_all(output_offsets, axis_name, 0, 0, tiled=True)
    where_taken = jax.lax.all_to_all(input_offsets, axis_name, 0, 0, tiled=True)
    d_operand = _padded_exchange(d_out, jnp.zeros(operand_shape, d_out.dtype), where_received, recv_sizes,
                                 where_taken, send_sizes, axis_name)
    o = jnp.arange(d_out.shape[0])
    covered = jnp.any((o[:, None] >= where_received[None]) & (o[:, None] < (where_received + recv_sizes)[None]),
                      axis=1).reshape(-1, *(1,) * (d_out.ndim - 1))
    return d_operand, jnp.where(covered, 0, d_out), None, None, None, None


_padded_exchange.defvjp(_padded_exchange_fwd, _padded_exchange_bwd)


def padded_ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, *,
                             axis_name):
    """`jax.lax.ragged_all_to_all`'s semantics (and gradient) from a fixed-size all-to-all: every
    slice travels padded to the operand's length. For XLA:CPU, which cannot run the ragged one."""
    return _padded_exchange(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, axis_name)


# ----------------------------------------------------------------------------------------------
# The layer under shard_map


def expert_exchange(model_cfg, mesh: Mesh, backend: str | None = None) -> Callable | None:
    """The dropless MoE layer across `mesh` (models/moe.py's `expert_exchange`), or None where a
    device computes alone (one device, or a model without experts). `backend`: the platform the
    program is for ("gpu" from `python -m maxtext_rocm.compile` on a CPU), default the mesh's own."""
    if model_cfg.n_experts <= 1 or (mesh.size == 1 and backend is None):
        return None
    backend = backend or mesh.devices.flat[0].platform
    return functools.partial(_expert_parallel_dropless, mesh=mesh, backend=backend)


def _expert_parallel_dropless(x, weights, experts, gate, up, down, *, mesh: Mesh, backend: str, activation: str = "silu",
                              gate_bias=None, up_bias=None):
    axes = functools.partial(sharding.present_axes, mesh)
    batch_axes, length_axes = axes("activation_batch"), axes("activation_length")
    expert_axis, fsdp_axes, tensor_axes = axes("exp"), axes("exp_embed"), axes("mlp")
    tokens = PartitionSpec(batch_axes, length_axes, None)
    gate_up = PartitionSpec(expert_axis, fsdp_axes, tensor_axes)
    down_spec = PartitionSpec(expert_axis, tensor_axes, fsdp_axes)
    n_shards = math.prod(mesh.shape[a] for a in expert_axis)
    exchange = jax.lax.ragged_all_to_all if backend != "cpu" else padded_ragged_all_to_all
    if x.shape[0] % math.prod(mesh.shape[a] for a in batch_axes) or \
            x.shape[1] % math.prod(mesh.shape[a] for a in length_axes):
        # A batch the mesh cannot split (the parameters' init traces one sequence): the same
        # values computed without the exchange.
        block = blocked_experts.dropless_block(x.shape[0] * x.shape[1] * experts.shape[-1], gate.shape[0], backend)
        return moe.dropless_experts(x, weights, experts, gate, up, down, block, activation=activation,
                                    gate_bias=gate_bias, up_bias=up_bias)
    biases = () if gate_bias is None else (gate_bias, up_bias)  # gpt-oss's, split as the experts' outputs

    def local(x, weights, experts, gate, up, down, *biases):
        ffn = dict(zip(("gate_bias", "up_bias"), biases), activation=activation)
        # The tokens, the same on every tensor shard, meet a slice of the hidden units there: typed
        # as varying over `tensor` here, their gradient is summed over it here too, once per token.
        if tensor_axes:
            x = jax.lax.pcast(x, tensor_axes, to="varying")
        if fsdp_axes:  # ZeRO-3: this layer's expert weights whole in d_model (bf16 under bf16)
            gate, up = (jax.lax.all_gather(w, fsdp_axes, axis=1, tiled=True) for w in (gate, up))
            down = jax.lax.all_gather(down, fsdp_axes, axis=2, tiled=True)
        n_experts = gate.shape[0] * n_shards
        by_expert = moe.sort_by_expert(x, experts, n_experts, weights.astype(jnp.float32))
        n_rows = by_expert.rows.shape[0]
        block = blocked_experts.dropless_block(n_rows, n_experts, backend)
        if n_shards > 1:
            plan = exchange_plan(by_expert.group_sizes, n_shards, jax.lax.axis_index(expert_axis), expert_axis)
            # Every row of every peer may choose this device's experts: the exact bound.
            buffer_rows = n_shards * n_rows
            expert_rows = dispatch(by_expert.rows, plan, buffer_rows, exchange, expert_axis)
            # Each row's router weight travels with it (one fp32 scalar) and is applied on the
            # expert's device: what the combine returns is then summed linearly, so the backward
            # needs nothing of it and the recomputation under remat leaves the combine out (5
            # exchanges of rows per layer and step instead of 6; the weights' gradient comes
            # back as a scalar per row through the dispatch's transpose).
            expert_weights = dispatch(by_expert.row_weights, plan, buffer_rows, exchange, expert_axis)
            out = moe.grouped_swiglu(expert_rows, plan.local_group_sizes, gate, up, down, block, **ffn)
            out = combine((out * expert_weights).astype(out.dtype), plan, n_rows, exchange, expert_axis)
        else:
            out = moe.grouped_swiglu(by_expert.rows, by_expert.group_sizes, gate, up, down, block,
                                     by_expert.row_expert, **ffn)
            out = (out * by_expert.row_weights).astype(out.dtype)
        y = jnp.sum(by_expert.unsort(out), axis=2, dtype=jnp.float32).astype(x.dtype)
        # Each tensor shard holds a slice of every expert's hidden units: partial sums.
        return jax.lax.psum(y, tensor_axes) if tensor_axes else y

    bias_specs = (PartitionSpec(expert_axis, tensor_axes),) * len(biases)
    return jax.shard_map(local, mesh=mesh, in_specs=(tokens, tokens, tokens, gate_up, gate_up, down_spec, *bias_specs),
                         out_specs=tokens, check_vma=varying.check_vma(mesh))(x, weights, experts, gate, up, down,
                                                                              *biases)

