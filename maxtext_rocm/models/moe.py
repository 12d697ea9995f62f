"""Mixture of experts: a router, SwiGLU experts, and one switch between three ways to compute them.

Routing is Mixtral's: a linear router, a softmax over `n_experts`, the top `experts_per_token`
kept and their weights renormalised to sum to one. Each token's output is the weighted sum of its
chosen experts' SwiGLU outputs. `model.moe_impl` chooses how that sum is computed:

- "dropless": (token, choice) pairs sorted by expert, then `jax.lax.ragged_dot` (a grouped GEMM)
  runs each expert on exactly its tokens. Exact; the right path on GPUs. On the CPU, where
  ragged_dot becomes a masked dense dot over every expert, each expert's rows are padded to
  whole blocks instead and a loop runs each block through its expert.
- "capacity": each expert takes at most `capacity` tokens of each sequence into a fixed-size buffer
  (Switch/GShard style); choices past it are dropped, i.e. contribute nothing. Static shapes, so
  XLA derives the expert-parallel all-to-all from the buffers' shardings.
- "dense": every expert runs on every token and the unchosen ones get weight zero. Exact and
  simple; E/k times the expert FLOPs. The reference the tests compare the others to.
- "auto" (the default): "dropless" everywhere, so the default never drops a token.

Under expert parallelism the dropless layer exchanges token rows between devices
(maxtext_rocm/parallel/experts.py, handed to the layer as `expert_exchange`).

The router's auxiliary losses (load balancing, z-loss) are sown into the `AUX_LOSSES` collection;
`router_losses` averages them over layers for the objective in step.py. Models stay pure: the
expert dimension is the logical axis "exp", mapped to a mesh axis by sharding.py alone.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Callable, Mapping

import jax
import jax.numpy as jnp
from flax import linen as nn

from maxtext_rocm.models.layers import Dense
from maxtext_rocm import varying
from maxtext_rocm.precision import Policy, without_fp8

Array = jax.Array

# The Flax collection the router losses are sown into (one value per layer). The decoder stack
# stacks it over scanned layers; the step applies the model with it mutable to read the losses.
AUX_LOSSES = "aux_losses"
# Router loss name -> the model config key that weighs it in the objective.
ROUTER_LOSS_WEIGHTS = {"moe_aux_loss": "moe_aux_loss_weight", "moe_z_loss": "moe_router_z_loss_weight"}

# Expert weights: experts over "exp", then their own d_model axis "exp_embed" (FSDP-sharded like
# "embed" but never over the mesh axis that already splits the experts), then "mlp" (tensor).
GATE_UP_AXES = ("exp", "exp_embed", "mlp")
DOWN_AXES = ("exp", "mlp", "exp_embed")
# Capacity buffers [batch, experts, slots, features]: the all-to-all moves tokens from the batch
# sharding to the expert sharding.
BUFFER_AXES = ("activation_exp_batch", "activation_exp", None)


# ----------------------------------------------------------------------------------------------
# Routing and its auxiliary losses


def route(logits: Array, k: int) -> tuple[Array, Array, Array]:
    """(probabilities [..., E], weights [..., k], experts [..., k]) from router logits.

    Softmax over all experts, top-k, and the k weights renormalised to sum to one (Mixtral's
    `softmax(topk(logits))` is the same thing).
    """
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    weights, experts = jax.lax.top_k(probs, k)
    return probs, weights / jnp.sum(weights, axis=-1, keepdims=True), experts


def load_balancing_loss(probs: Array, experts: Array) -> Array:
    """Switch Transformer's load-balancing loss as Mixtral (Hugging Face, MaxText) scales it.

    n_experts * sum_e f_e * P_e, where f_e is the fraction of tokens that chose expert e among
    their top k (the f_e sum to k) and P_e the mean router probability of e. Perfect balance gives
    k, so a weight taken from either code base means the same here.
    """
    n_experts = probs.shape[-1]
    chosen = jnp.sum(jax.nn.one_hot(experts, n_experts, dtype=jnp.float32), axis=-2)
    fraction = jnp.mean(chosen.reshape(-1, n_experts), axis=0)
    mean_prob = jnp.mean(probs.reshape(-1, n_experts), axis=0)
    return n_experts * jnp.sum(fraction * mean_prob)


def router_z_loss(logits: Array) -> Array:
    """ST-MoE's router z-loss: mean squared log-partition, which keeps router logits small."""
    return jnp.mean(jnp.square(jax.nn.logsumexp(logits.astype(jnp.float32), axis=-1)))


def router_losses(aux: Mapping) -> dict[str, Array]:
    """Each router loss sown into the `AUX_LOSSES` collection, averaged over layers.

    `aux` is what `model.apply(..., mutable=[AUX_LOSSES])` returns next to the logits; a dense
    model sows nothing and gets zeros, so the step needs no branch on the model family.
    """
    found: dict[str, list[Array]] = {name: [] for name in ROUTER_LOSS_WEIGHTS}
    for path, leaf in jax.tree_util.tree_leaves_with_path(aux):
        # Sown values sit at .../<name>/(value,): the last dictionary key names the loss.
        name = [entry.key for entry in path if isinstance(entry, jax.tree_util.DictKey)][-1]
        found[name].append(jnp.ravel(leaf))
    return {name: jnp.mean(jnp.concatenate(values)) if values else jnp.zeros((), jnp.float32)
            for name, values in found.items()}


def weighted_router_loss(losses: Mapping[str, Array], model_cfg) -> Array:
    """The router losses' share of the objective, weighted by their model config keys."""
    return sum(model_cfg[ROUTER_LOSS_WEIGHTS[name]] * value for name, value in losses.items())


# ----------------------------------------------------------------------------------------------
# Expert computation: x [batch, seq, d], weights and experts [batch, seq, k] -> [batch, seq, d]


def _swiglu(gate: Array, up: Array) -> Array:
    return nn.silu(gate) * up


def _dots(dots: Mapping | None) -> dict:
    """The dot_general of each expert weight: the given ones (the policy's) or XLA's."""
    return {name: (dots or {}).get(name, jax.lax.dot_general) for name in ("gate", "up", "down")}


def _per_expert(dot, buffers: Array, weight: Array) -> Array:
    """[b, E, c, i] x [E, i, o] -> [b, E, c, o], the expert axis as a dot batch axis."""
    out = dot(buffers, weight, (((3,), (1,)), ((1,), (0,))))  # [E, b, c, o]
    return jnp.swapaxes(out, 0, 1)


def dense_experts(x: Array, weights: Array, experts: Array, gate: Array, up: Array, down: Array,
                  dots: Mapping | None = None) -> Array:
    """Every expert on every token; unchosen experts weigh zero. gate, up: [E, d, f]; down: [E, f, d]."""
    dot = _dots(dots)
    n_experts = gate.shape[0]
    # [b, s, E]: each token's renormalised weight on each expert, zero where not chosen.
    combine = jnp.einsum("bske,bsk->bse", jax.nn.one_hot(experts, n_experts, dtype=x.dtype),
                         weights.astype(x.dtype))
    to_hidden = (((2,), (1,)), ((), ()))  # bsd,edf->bsef
    hidden = _swiglu(dot["gate"](x, gate, to_hidden), dot["up"](x, up, to_hidden))
    # Weighing the hidden units first lets one dot contract both the experts and the MLP axis.
    return dot["down"](hidden * combine[..., None], down, (((2, 3), (0, 1)), ((), ())))  # bsef,efd->bsd


def sort_by_expert(x: Array, experts: Array, n_experts: int):
    """The (token, choice) rows of `x` [batch, seq, d] sorted by expert (stable, so token order
    within an expert), with what it takes to undo it: (rows [T*k, d], group sizes [E], each
    row's expert [T*k], `unsort` mapping rows in this order back to [batch, seq, k, d])."""
    batch, seq, d = x.shape
    k = experts.shape[-1]
    flat = experts.reshape(-1)  # [T*k], token-major
    order = jnp.argsort(flat, stable=True)  # sorted row -> its (token, choice) pair
    position = jnp.argsort(order)  # (token, choice) pair -> its sorted row
    # Compare-and-sum rather than bincount, whose scatter-add is the one scatter left otherwise.
    group_sizes = jnp.sum(flat[:, None] == jnp.arange(n_experts), axis=0, dtype=jnp.int32)
    rows = take_rows(x.reshape(-1, d), order // k, position.reshape(-1, k))  # [T*k, d]

    def unsort(out: Array) -> Array:
        return take_rows(out, position, order[:, None]).reshape(batch, seq, k, out.shape[-1])

    return rows, group_sizes, flat[order], unsort


def grouped_swiglu(rows: Array, group_sizes: Array, gate: Array, up: Array, down: Array,
                   block: int = 0, row_expert: Array | None = None) -> Array:
    """SwiGLU experts over rows grouped by expert (`group_sizes[e]` consecutive rows each, in
    expert order; rows past their sum are ignored and come out as don't-care values).
    `block=0`: grouped GEMMs (`jax.lax.ragged_dot`). `block>0` (the CPU, where ragged_dot becomes
    a masked dense dot over every expert): each expert's rows padded to whole blocks of `block`
    rows and a loop runs each block through its expert (`blocked_swiglu`); exact all the same.
    `row_expert`: each row's expert where the caller has it already (the sort does)."""
    if not block:
        hidden = _swiglu(jax.lax.ragged_dot(rows, gate, group_sizes), jax.lax.ragged_dot(rows, up, group_sizes))
        return jax.lax.ragged_dot(hidden, down, group_sizes)
    grouped = _blocked_groups(group_sizes, rows.shape[0], block, row_expert)
    return grouped.unpad(blocked_swiglu(grouped.pad(rows), grouped.block_expert, grouped.n_used,
                                        gate, up, down, block))


def dropless_experts(x: Array, weights: Array, experts: Array, gate: Array, up: Array, down: Array,
                     block: int = 0) -> Array:
    """Each (token, choice) pair through its expert, rows sorted by expert, then `grouped_swiglu`.
    Every move of rows between layouts is a gather, forward and backward (`take_rows`). This is
    the whole layer on one device; under expert parallelism maxtext_rocm/parallel/experts.py runs
    the same pieces with the rows exchanged between devices in between."""
    rows, group_sizes, row_expert, unsort = sort_by_expert(x, experts, gate.shape[0])
    out = unsort(grouped_swiglu(rows, group_sizes, gate, up, down, block, row_expert))
    return jnp.einsum("bskd,bsk->bsd", out, weights.astype(x.dtype))


@jax.custom_vjp
def take_rows(x: Array, index: Array, sources: Array) -> Array:
    """x[index] over rows (an index out of range gives a row of zeros) where the inverse is known:
    `sources[r]` lists the rows of the result that row r of x went to, out of range for none.
    The gradient is then the same kind of gather the other way round, each row's cotangents
    summed in fp32. JAX's own transpose of a gather is a scatter-add, whose accumulation order a
    GPU leaves to atomics: not reproducible from run to run."""
    return jnp.take(x, index, axis=0, mode="fill", fill_value=0)


def _take_rows_fwd(x, index, sources):
    return take_rows(x, index, sources), sources


def _take_rows_bwd(sources, d_out):
    d_x = jnp.take(d_out, sources.reshape(-1), axis=0, mode="fill", fill_value=0)
    d_x = d_x.reshape(*sources.shape, *d_out.shape[1:])
    if sources.shape[1] > 1:
        d_x = jnp.sum(d_x, axis=1, dtype=jnp.float32).astype(d_out.dtype)
    else:
        d_x = d_x[:, 0]
    return d_x, None, None


take_rows.defvjp(_take_rows_fwd, _take_rows_bwd)


@dataclasses.dataclass(frozen=True)
class _BlockedGroups:
    """Expert-sorted rows laid out so that each `block` rows belong to one expert."""

    dest: Array  # [rows]: each sorted row's place in the padded layout
    source: Array  # [n_padded]: the sorted row at each place, out of range (n rows) for padding
    block_expert: Array  # [padded rows / block]: the expert of each block
    n_used: Array  # how many leading blocks hold rows (the rest is the static bound's slack)

    def pad(self, rows: Array) -> Array:
        return take_rows(rows, self.source, self.dest[:, None])

    def unpad(self, padded: Array) -> Array:
        return take_rows(padded, self.dest, self.source[:, None])


def _blocked_groups(group_sizes: Array, n_rows: int, block: int, row_expert: Array | None = None) -> _BlockedGroups:
    """The padded layout of `n_rows` expert-sorted rows with these group sizes: at most block - 1
    rows of padding per expert. Rows past sum(group_sizes) (an exchange buffer's slack) get no
    place: they are dropped by `pad` and come back as zeros from `unpad`."""
    n_experts = group_sizes.shape[0]
    padded_sizes = (group_sizes + block - 1) // block * block
    padded_ends, ends = jnp.cumsum(padded_sizes), jnp.cumsum(group_sizes)
    padded_starts, starts = padded_ends - padded_sizes, ends - group_sizes
    n_padded = -(-n_rows // block) * block + n_experts * block  # a static bound on sum(padded_sizes)
    row = jnp.arange(n_rows)
    if row_expert is None:
        row_expert = jnp.minimum(jnp.searchsorted(ends, row, side="right", method="compare_all"), n_experts - 1)
    dest = jnp.where(row < ends[-1], padded_starts[row_expert] + row - starts[row_expert], n_padded)
    # A few dozen blocks against a handful of experts: comparing all pairs is one small kernel,
    # where the default binary search is a loop.
    block_expert = jnp.minimum(jnp.searchsorted(padded_ends, jnp.arange(0, n_padded, block), side="right",
                                                method="compare_all"), n_experts - 1)
    # Each place's row, computed from the layout rather than scattered from `dest`: a place holds
    # the rank-th row of its block's expert if that expert has that many rows (past the last
    # expert's blocks the clamped expert has none that far).
    place_expert = jnp.repeat(block_expert, block)
    rank = jnp.arange(n_padded) - padded_starts[place_expert]
    source = jnp.where(rank < group_sizes[place_expert], starts[place_expert] + rank, n_rows)
    return _BlockedGroups(dest, source, block_expert, padded_ends[-1] // block)


def _row_block(a: Array, i: Array, block: int) -> Array:
    return jax.lax.dynamic_slice_in_dim(a, i * block, block)


def _dot_f32(a: Array, b: Array) -> Array:
    """a @ b accumulated and returned in fp32. The blocked loop runs on the CPU only, whose bf16
    dots are fast only with an fp32 result (see precision.f32_accumulating_dot_general)."""
    return jnp.dot(a, b, preferred_element_type=jnp.float32)


def _add_at(acc: Array, e: Array, delta: Array) -> Array:
    """acc[e] += delta, written as an in-place update of the loop's accumulator."""
    current = jax.lax.dynamic_index_in_dim(acc, e, keepdims=False)
    return jax.lax.dynamic_update_index_in_dim(acc, current + delta, e, 0)


@functools.partial(jax.custom_vjp, nondiff_argnums=(6,))
def blocked_swiglu(padded: Array, block_expert: Array, n_used: Array, gate: Array, up: Array,
                   down: Array, block: int) -> Array:
    """SwiGLU experts over rows laid out in blocks of one expert each: [n_padded, d] -> [n_padded, d].

    A loop over the `n_used` blocks in use, each block through its own expert's weights indexed in
    place: neither a copy of the weights per block nor the blocks of padding that the static bound
    allows are ever made. The backward pass (below) loops the same way, adding each block's weight
    gradients into its expert's fp32 accumulator.
    """

    def body(i, out):
        e, rows = block_expert[i], _row_block(padded, i, block)
        hidden = _swiglu(_dot_f32(rows, gate[e]), _dot_f32(rows, up[e])).astype(rows.dtype)
        return jax.lax.dynamic_update_slice_in_dim(out, _dot_f32(hidden, down[e]).astype(out.dtype), i * block, 0)

    return jax.lax.fori_loop(0, n_used, body, varying.varying_like(jnp.zeros_like(padded), padded, gate, up, down))


def _blocked_swiglu_fwd(padded, block_expert, n_used, gate, up, down, block):
    out = blocked_swiglu(padded, block_expert, n_used, gate, up, down, block)
    return out, (padded, block_expert, n_used, gate, up, down)


def _blocked_swiglu_bwd(block, residuals, d_out):
    padded, block_expert, n_used, gate, up, down = residuals
    f32 = jnp.float32

    def body(i, carry):
        d_rows, d_gate, d_up, d_down = carry
        e, rows, dy = block_expert[i], _row_block(padded, i, block), _row_block(d_out, i, block)
        g, u = _dot_f32(rows, gate[e]), _dot_f32(rows, up[e])  # recomputed, not stored
        silu_g = nn.silu(g)
        d_down = _add_at(d_down, e, _dot_f32((silu_g * u).astype(dy.dtype).T, dy))
        dh = _dot_f32(dy, down[e].T)
        sigmoid_g = jax.nn.sigmoid(g)
        dg = (dh * u * sigmoid_g * (1 + g * (1 - sigmoid_g))).astype(rows.dtype)  # silu'(g)
        du = (dh * silu_g).astype(rows.dtype)
        d_gate = _add_at(d_gate, e, _dot_f32(rows.T, dg))
        d_up = _add_at(d_up, e, _dot_f32(rows.T, du))
        dx = (_dot_f32(dg, gate[e].T) + _dot_f32(du, up[e].T)).astype(d_rows.dtype)
        return jax.lax.dynamic_update_slice_in_dim(d_rows, dx, i * block, 0), d_gate, d_up, d_down

    zeros = tuple(varying.varying_like(z, padded, d_out, gate, up, down) for z in
                  (jnp.zeros_like(padded), *(jnp.zeros(w.shape, f32) for w in (gate, up, down))))
    d_rows, d_gate, d_up, d_down = jax.lax.fori_loop(0, n_used, body, zeros)
    return (varying.summed_like(d_rows, padded), None, None, varying.summed_like(d_gate.astype(gate.dtype), gate),
            varying.summed_like(d_up.astype(up.dtype), up), varying.summed_like(d_down.astype(down.dtype), down))


blocked_swiglu.defvjp(_blocked_swiglu_fwd, _blocked_swiglu_bwd)


def dropless_block(n_rows: int, n_experts: int, backend: str | None = None) -> int:
    """The CPU's block size for dropless_experts (0 elsewhere: ragged_dot): a power of two near half
    an even share of the rows, 8 to 128, so padding stays small against the rows themselves."""
    if (backend or jax.default_backend()) != "cpu":
        return 0
    share = max(1, n_rows // (2 * n_experts))
    return int(min(128, max(8, 2 ** int(math.log2(share)))))


def expert_capacity(seq_len: int, n_experts: int, k: int, factor: float) -> int:
    """Slots per expert per sequence: `factor` times an even share of the seq_len * k choices.

    Never more than seq_len, since a token chooses an expert at most once.
    """
    return max(1, min(seq_len, math.ceil(factor * seq_len * k / n_experts)))


def capacity_slots(experts: Array, n_experts: int) -> Array:
    """The buffer slot [b, s, k] each (token, choice) takes in its expert, before any dropping.

    Slots fill in token order, a token's first choice before its second: whether a token is
    dropped then depends only on the tokens before it, so dropping never leaks the future.
    """
    batch, seq, k = experts.shape
    chosen = jax.nn.one_hot(experts, n_experts, dtype=jnp.int32).reshape(batch, seq * k, n_experts)
    slots = (jnp.cumsum(chosen, axis=1) - 1) * chosen
    return jnp.sum(slots, axis=-1).reshape(batch, seq, k)


def capacity_experts(x: Array, weights: Array, experts: Array, gate: Array, up: Array, down: Array,
                     capacity: int, dots: Mapping | None = None) -> Array:
    """Fixed-capacity expert buffers; choices beyond an expert's `capacity` are dropped.

    Tokens move into and out of the buffers by gathers along the sequence, not GShard's one-hot
    dispatch/combine einsums: those build [batch, seq, experts, capacity] tensors (42M entries per
    sequence for Mixtral at 4K tokens) and cost 1.35x more time on the CPU at tiny_mixtral's size.
    """
    batch, seq, d = x.shape
    n_experts, k = gate.shape[0], experts.shape[-1]
    n_rows = n_experts * capacity
    slots = capacity_slots(experts, n_experts)
    # The buffer row [0, E * C) of each (token, choice); a dropped one gets row E * C, which reads
    # a row of zeros in both directions.
    rows = jnp.where(slots < capacity, experts * capacity + slots, n_rows)  # [b, s, k]
    token_ids = jnp.broadcast_to(jnp.arange(seq, dtype=jnp.int32)[:, None], (seq, k))
    # The token in each buffer row (an empty row holds token `seq`, the zero row): kept rows are
    # unique, dropped choices all land on the spare row, which is cut off.
    owners = jax.vmap(lambda r: jnp.full((n_rows + 1,), seq, jnp.int32).at[r].set(token_ids))(rows)[:, :n_rows]
    padded = jnp.pad(x, ((0, 0), (0, 1), (0, 0)))
    buffers = jnp.take_along_axis(padded, owners[..., None], axis=1).reshape(batch, n_experts, capacity, d)

    buffers = nn.with_logical_constraint(buffers, BUFFER_AXES + ("activation_embed",))
    dot = _dots(dots)
    hidden = _swiglu(_per_expert(dot["gate"], buffers, gate), _per_expert(dot["up"], buffers, up))
    hidden = nn.with_logical_constraint(hidden, BUFFER_AXES + ("activation_mlp",))
    out = _per_expert(dot["down"], hidden, down)
    out = nn.with_logical_constraint(out, BUFFER_AXES + ("activation_embed",))
    # Back to the batch sharding (the return all-to-all), then each choice reads its row.
    out = out.reshape(batch, n_rows, d)
    out = nn.with_logical_constraint(out, ("activation_batch", None, "activation_embed"))
    out = jnp.pad(out, ((0, 0), (0, 1), (0, 0)))
    chosen = jnp.take_along_axis(out, rows.reshape(batch, seq * k)[..., None], axis=1)
    return jnp.einsum("bskd,bsk->bsd", chosen.reshape(batch, seq, k, d), weights.astype(x.dtype))


def resolve_implementation(name: str, backend: str | None = None) -> str:
    """`model.moe_impl`, with "auto" replaced by "dropless" on every backend: the default never
    drops a token. On GPUs ragged_dot is a grouped GEMM; on the CPU the blocked loop runs instead
    (`dropless_block`). "capacity" is faster on the CPU (reference comparison's size, bf16: 765
    tokens/s against 566 dropless, scripts/compare_reference.py) but drops the choices past an
    expert's capacity, which changes the model: only when asked for."""
    del backend  # the same answer everywhere; kept so callers may say which backend they mean
    return "dropless" if name == "auto" else name


# ----------------------------------------------------------------------------------------------
# The layer


class MoE(nn.Module):
    """Router + SwiGLU experts, computed by `model.moe_impl`; sows the router losses."""

    cfg: "ml_collections.FrozenConfigDict"  # noqa: F821 - cfg.model
    policy: Policy
    # Computes the dropless layer across devices (maxtext_rocm/parallel/experts.py) with
    # dropless_experts' signature; None: on this device alone. The model never sees the mesh.
    expert_exchange: Callable | None = None

    @nn.compact
    def __call__(self, x: Array) -> Array:
        m = self.cfg
        n_experts, d, f = m.n_experts, m.d_model, m.mlp_dim
        # The router runs in fp32 whatever the policy: its softmax and top-k decide where tokens
        # go, and bf16 logits would flip near-ties. It is d_model x n_experts, so this is free.
        router_policy = dataclasses.replace(without_fp8(self.policy), compute_dtype=jnp.float32)
        logits = Dense((d,), (n_experts,), ("embed", None), router_policy, name="router")(x)
        probs, weights, experts = route(logits, m.experts_per_token)
        self.sow(AUX_LOSSES, "moe_aux_loss", load_balancing_loss(probs, experts))
        self.sow(AUX_LOSSES, "moe_z_loss", router_z_loss(logits))

        # Fan-in scaled per expert: axis 0 (experts) is a batch axis, not a fan.
        init = nn.initializers.variance_scaling(1.0, "fan_in", "truncated_normal",
                                                in_axis=1, out_axis=2, batch_axis=(0,))

        def kernel(name, shape, axes):
            value = self.param(name, nn.with_logical_partitioning(init, axes), shape, self.policy.param_dtype)
            return value.astype(self.policy.compute_dtype)

        gate = kernel("gate", (n_experts, d, f), GATE_UP_AXES)
        up = kernel("up", (n_experts, d, f), GATE_UP_AXES)
        down = kernel("down", (n_experts, f, d), DOWN_AXES)
        x = x.astype(self.policy.compute_dtype)

        implementation = resolve_implementation(m.moe_impl)
        if implementation == "dropless":  # ragged_dot has no fp8 form: the grouped GEMM stays bf16
            if self.expert_exchange is not None:
                return self.expert_exchange(x, weights, experts, gate, up, down)
            block = dropless_block(x.shape[0] * x.shape[1] * m.experts_per_token, n_experts)
            return dropless_experts(x, weights, experts, gate, up, down, block)
        # The policy's dot (fp8 under the fp8 policy) for each expert weight, one scale per weight.
        dots = ({name: self.policy.dot_general_cls(name=f"{name}_dot") for name in ("gate", "up", "down")}
                if self.policy.dot_general_cls else dict.fromkeys(("gate", "up", "down"), self.policy.dot_general))
        if implementation == "dense":
            return dense_experts(x, weights, experts, gate, up, down, dots)
        capacity = expert_capacity(x.shape[1], n_experts, m.experts_per_token, m.moe_capacity_factor)
        return capacity_experts(x, weights, experts, gate, up, down, capacity, dots)
