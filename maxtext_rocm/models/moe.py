"""Mixture of experts: a router, SwiGLU experts, and one switch between three ways to compute them.

Routing is Mixtral's and Qwen3-MoE's: a linear router, a softmax over `n_experts`, the top
`experts_per_token` kept and (model.moe_renormalize, both families' default) their weights
renormalised to sum to one; or gpt-oss's (model.moe_router="topk_softmax"): the top logits, then a
softmax over those alone. Each token's output is the weighted sum of its chosen experts' gated MLP
outputs (SwiGLU, or model.mlp_activation's; with model.moe_bias, gpt-oss's biases on the router
and on every expert projection). `model.moe_impl` chooses how that sum is computed:

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
import math
from typing import Callable, Mapping, NamedTuple

import jax
import jax.numpy as jnp
from flax import linen as nn

from maxtext_rocm.config.choices import feed_forward_dim
from maxtext_rocm.models.blocked_experts import blocked_groups, blocked_swiglu, dropless_block, take_rows
from maxtext_rocm.models.activations import gated
from maxtext_rocm.models.layers import Dense
from maxtext_rocm.numerics.precision import Policy, without_fp8

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
BIAS_AXES = ("exp", "mlp")  # gpt-oss's gate and up biases, split as their outputs
DOWN_BIAS_AXES = ("exp", None)  # added outside the experts (expert_bias), so never split like their d_model
# Capacity buffers [batch, experts, slots, features]: the all-to-all moves tokens from the batch
# sharding to the expert sharding.
BUFFER_AXES = ("activation_exp_batch", "activation_exp", None)


# ----------------------------------------------------------------------------------------------
# Routing and its auxiliary losses


def route(logits: Array, k: int, renormalize: bool = True, kind: str = "softmax_topk") -> tuple[Array, Array, Array]:
    """(probabilities [..., E], weights [..., k], experts [..., k]) from router logits.

    Softmax over all experts, then the top k; with `renormalize` (model.moe_renormalize) the k
    weights rescaled to sum to one (Mixtral's `softmax(topk(logits))` is the same thing;
    Qwen3-MoE's norm_topk_prob), else kept as the softmax gave them. `kind` "topk_softmax"
    (model.moe_router, gpt-oss): the top k logits, then a softmax over them; the probabilities
    over all experts are returned all the same, for the load-balancing loss.
    """
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    if kind == "topk_softmax":  # the same experts as softmax_topk picks (softmax is monotone)
        chosen, experts = top_k_of_each(logits.astype(jnp.float32), k)
        return probs, jax.nn.softmax(chosen, axis=-1), experts
    weights, experts = top_k_of_each(probs, k)
    if renormalize:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return probs, weights, experts


def top_k_of_each(values: Array, k: int) -> tuple[Array, Array]:
    """`jax.lax.top_k(values, k)` along the last axis, the same values, indices and gradient,
    from a stable sort.

    XLA's partitioner splits its TopK only along the sorted axis: with the batch sharded it
    gathered every device's router probabilities to each device and ran the top-k of all tokens
    everywhere, an all-gather per layer (docs/figures.md, "Qwen3 plans"). A sort is partitioned
    along its other axes, so each device sorts only its own tokens' experts.
    """
    axis = values.ndim - 1
    positions = jax.lax.broadcasted_iota(jnp.int32, values.shape, axis)
    # top_k orders floats totally (-0 below +0, NaNs at the ends by sign) where sort's comparator
    # takes -0 for +0: integer keys in IEEE total order, complemented so the largest come first;
    # the sort's stability puts equal values in index order, as top_k does.
    bits = jax.lax.bitcast_convert_type(values, jnp.dtype(f"int{values.dtype.itemsize * 8}"))
    total_order = bits ^ ((bits >> (bits.dtype.itemsize * 8 - 1)) & jnp.iinfo(bits.dtype).max)
    _, order = jax.lax.sort((~total_order, positions), dimension=axis, is_stable=True, num_keys=1)
    chosen = order[..., :k]
    return jnp.take_along_axis(values, chosen, axis=axis), chosen


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


def _dots(dots: Mapping | None) -> dict:
    """The dot_general of each expert weight: the given ones (the policy's) or XLA's."""
    return {name: (dots or {}).get(name, jax.lax.dot_general) for name in ("gate", "up", "down")}


def _per_expert(dot, buffers: Array, weight: Array) -> Array:
    """[b, E, c, i] x [E, i, o] -> [b, E, c, o], the expert axis as a dot batch axis."""
    out = dot(buffers, weight, (((3,), (1,)), ((1,), (0,))))  # [E, b, c, o]
    return jnp.swapaxes(out, 0, 1)


def _biased(hidden: Array, bias: Array | None, shape: tuple[int, ...]) -> Array:
    """A projection's output plus its experts' bias [E, f] reshaped to broadcast (None: no bias)."""
    return hidden if bias is None else hidden + bias.reshape(shape).astype(hidden.dtype)


def dense_experts(x: Array, weights: Array, experts: Array, gate: Array, up: Array, down: Array,
                  dots: Mapping | None = None, *, activation: str = "silu", gate_bias: Array | None = None,
                  up_bias: Array | None = None) -> Array:
    """Every expert on every token; unchosen experts weigh zero. gate, up: [E, d, f]; down: [E, f, d];
    gate_bias, up_bias: [E, f] or None (the down projection's bias is the caller's: expert_bias)."""
    dot = _dots(dots)
    n_experts = gate.shape[0]
    # [b, s, E]: each token's routing weight on each expert, zero where not chosen.
    combine = jnp.einsum("bske,bsk->bse", jax.nn.one_hot(experts, n_experts, dtype=x.dtype),
                         weights.astype(x.dtype))
    to_hidden = (((2,), (1,)), ((), ()))  # bsd,edf->bsef
    per_expert = (1, 1, n_experts, -1)
    hidden = gated(activation, _biased(dot["gate"](x, gate, to_hidden), gate_bias, per_expert),
                   _biased(dot["up"](x, up, to_hidden), up_bias, per_expert))
    # Weighing the hidden units first lets one dot contract both the experts and the MLP axis.
    return dot["down"](hidden * combine[..., None], down, (((2, 3), (0, 1)), ((), ())))  # bsef,efd->bsd


class ExpertSort(NamedTuple):
    """The (token, choice) rows of a batch sorted by expert, and what it takes to undo it."""

    rows: Array  # [T*k, d]: the rows, expert by expert (token order within an expert)
    group_sizes: Array  # [E]: the rows each expert has, in expert order
    row_expert: Array  # [T*k]: each sorted row's expert
    unsort: Callable[[Array], Array]  # rows in this order [T*k, f] -> [batch, seq, k, f]
    row_weights: Array | None  # [T*k, 1]: each row's router weight, where the sort was given them


def sort_by_expert(x: Array, experts: Array, n_experts: int, weights: Array | None = None) -> ExpertSort:
    """The (token, choice) rows of `x` [batch, seq, d] sorted by expert, stable. With `weights`
    [batch, seq, k] (the router's), each row's weight too; without, `row_weights` is None."""
    batch, seq, d = x.shape
    k = experts.shape[-1]
    flat = experts.reshape(-1)  # [T*k], token-major
    order = jnp.argsort(flat, stable=True)  # sorted row -> its (token, choice) pair
    position = jnp.argsort(order)  # (token, choice) pair -> its sorted row
    # Compare-and-sum rather than bincount, whose scatter-add is the one scatter left otherwise.
    group_sizes = jnp.sum(flat[:, None] == jnp.arange(n_experts), axis=0, dtype=jnp.int32)
    rows = take_rows(x.reshape(-1, d), order // k, position.reshape(-1, k))  # [T*k, d]

    def unsort(out: Array) -> Array:  # carries this sort's order and its inverse, `position`
        return take_rows(out, position, order[:, None]).reshape(batch, seq, k, out.shape[-1])

    row_expert = flat[order]
    row_weights = None if weights is None else take_rows(weights.reshape(-1, 1), order, position.reshape(-1, 1))
    return ExpertSort(rows, group_sizes, row_expert, unsort, row_weights)


def grouped_swiglu(rows: Array, group_sizes: Array, gate: Array, up: Array, down: Array,
                   block: int = 0, row_expert: Array | None = None, *, activation: str = "silu",
                   gate_bias: Array | None = None, up_bias: Array | None = None) -> Array:
    """SwiGLU experts over rows grouped by expert (`group_sizes[e]` consecutive rows each, in
    expert order; rows past their sum are ignored and come out as don't-care values).
    `block=0`: grouped GEMMs (`jax.lax.ragged_dot`). `block>0` (the CPU, where ragged_dot becomes
    a masked dense dot over every expert): each expert's rows padded to whole blocks of `block`
    rows and a loop runs each block through its expert (`blocked_swiglu`); exact all the same.
    `row_expert`: each row's expert where the caller has it already (the sort does).
    `activation`: model.mlp_activation; `gate_bias`, `up_bias` [E, f]: gpt-oss's, or None."""
    if not block:
        if gate_bias is not None and row_expert is None:  # rows past the groups: the last expert's, unused
            ends = jnp.cumsum(group_sizes)
            row_expert = jnp.minimum(jnp.searchsorted(ends, jnp.arange(rows.shape[0]), side="right",
                                                      method="compare_all"), gate.shape[0] - 1)

        def projected(weight, bias):
            out = jax.lax.ragged_dot(rows, weight, group_sizes)
            return out if bias is None else out + jnp.take(bias, row_expert, axis=0).astype(out.dtype)

        hidden = gated(activation, projected(gate, gate_bias), projected(up, up_bias))
        return jax.lax.ragged_dot(hidden, down, group_sizes)
    grouped = blocked_groups(group_sizes, rows.shape[0], block, row_expert)
    return grouped.unpad(blocked_swiglu(grouped.pad(rows), grouped.block_expert, grouped.n_used,
                                        gate, up, down, gate_bias, up_bias, block, activation))


def dropless_experts(x: Array, weights: Array, experts: Array, gate: Array, up: Array, down: Array,
                     block: int = 0, **ffn) -> Array:
    """Each (token, choice) pair through its expert, rows sorted by expert, then `grouped_swiglu`.
    Every move of rows between layouts is a gather, forward and backward (`take_rows`). This is
    the whole layer on one device; under expert parallelism maxtext_rocm/parallel/experts.py runs
    the same pieces with the rows exchanged between devices in between. `ffn`: grouped_swiglu's
    activation and biases."""
    by_expert = sort_by_expert(x, experts, gate.shape[0])
    out = by_expert.unsort(grouped_swiglu(by_expert.rows, by_expert.group_sizes, gate, up, down, block,
                                          by_expert.row_expert, **ffn))
    return jnp.einsum("bskd,bsk->bsd", out, weights.astype(x.dtype))


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
                     capacity: int, dots: Mapping | None = None, *, activation: str = "silu",
                     gate_bias: Array | None = None, up_bias: Array | None = None) -> Array:
    """Fixed-capacity expert buffers; choices beyond an expert's `capacity` are dropped.

    Tokens move into and out of the buffers by gathers along the sequence, not GShard's one-hot
    dispatch/combine einsums: those build [batch, seq, experts, capacity] tensors (42M entries per
    sequence for Mixtral at 4K tokens) and were slower on the CPU (docs/figures.md, "Pipeline and
    expert code").
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
    per_expert = (1, n_experts, 1, -1)
    hidden = gated(activation, _biased(_per_expert(dot["gate"], buffers, gate), gate_bias, per_expert),
                   _biased(_per_expert(dot["up"], buffers, up), up_bias, per_expert))
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
    (`dropless_block`). "capacity" is faster on the CPU (docs/figures.md, "Mixture of experts on
    the CPU") but drops the choices past an expert's capacity, which changes the model: only when
    asked for. Called by the resolve step (maxtext_rocm/resolve.py); the model receives its answer."""
    del backend  # the same answer everywhere; kept so callers may say which backend they mean
    return "dropless" if name == "auto" else name


# ----------------------------------------------------------------------------------------------
# The layer


def expert_bias(weights: Array, experts: Array, down_bias: Array) -> Array:
    """The down projections' biases [E, d] (gpt-oss) weighted as their experts' outputs are:
    sum_k weight_k * bias[expert_k], added after the experts, so no expert path carries them."""
    return jnp.einsum("bsk,bskd->bsd", weights.astype(jnp.float32), jnp.take(down_bias, experts, axis=0).astype(jnp.float32))


class MoE(nn.Module):
    """Router + gated experts, computed by `model.moe_impl`; sows the router losses."""

    cfg: "ml_collections.FrozenConfigDict"  # noqa: F821 - cfg.model
    policy: Policy
    # Computes the dropless layer across devices (maxtext_rocm/parallel/experts.py) with
    # dropless_experts' signature; None: on this device alone. The model never sees the mesh.
    expert_exchange: Callable | None = None

    @nn.compact
    def __call__(self, x: Array) -> Array:
        m = self.cfg
        n_experts, d, f = m.n_experts, m.d_model, feed_forward_dim(m)
        # The router runs in fp32 whatever the policy: its softmax and top-k decide where tokens
        # go, and bf16 logits would flip near-ties. It is d_model x n_experts, so this is free.
        router_policy = dataclasses.replace(without_fp8(self.policy), compute_dtype=jnp.float32)
        logits = Dense((d,), (n_experts,), ("embed", None), router_policy, name="router")(x)
        if m.moe_bias:
            logits = logits + self.param("router_bias", nn.with_logical_partitioning(nn.initializers.zeros, (None,)),
                                         (n_experts,), self.policy.param_dtype).astype(jnp.float32)
        probs, weights, experts = route(logits, m.experts_per_token, m.moe_renormalize, m.moe_router)
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
        ffn = {"activation": m.mlp_activation}
        if not m.moe_bias:
            return self.expert_outputs(x, weights, experts, gate, up, down, ffn)

        def bias(name, shape, axes):
            value = self.param(name, nn.with_logical_partitioning(nn.initializers.zeros, axes), shape,
                               self.policy.param_dtype)
            return value.astype(self.policy.compute_dtype)

        ffn.update(gate_bias=bias("gate_bias", (n_experts, f), BIAS_AXES), up_bias=bias("up_bias", (n_experts, f), BIAS_AXES))
        out = self.expert_outputs(x, weights, experts, gate, up, down, ffn)
        down_bias = bias("down_bias", (n_experts, d), DOWN_BIAS_AXES)
        return (out.astype(jnp.float32) + expert_bias(weights, experts, down_bias)).astype(out.dtype)

    def expert_outputs(self, x: Array, weights: Array, experts: Array, gate: Array, up: Array, down: Array,
                ffn: dict) -> Array:
        """The chosen experts' weighted outputs, by model.moe_impl; `ffn`: the activation and the
        gate and up projections' biases (grouped_swiglu's keywords)."""
        m = self.cfg
        n_experts = m.n_experts

        implementation = m.moe_impl
        if implementation == "auto":
            raise ValueError("model.moe_impl='auto' reached the model: the config was not resolved "
                             "(maxtext_rocm.resolve.resolve() was skipped)")
        if implementation == "dropless":  # ragged_dot has no fp8 form: the grouped GEMM stays bf16
            if self.expert_exchange is not None:
                return self.expert_exchange(x, weights, experts, gate, up, down, **ffn)
            block = dropless_block(x.shape[0] * x.shape[1] * m.experts_per_token, n_experts)
            return dropless_experts(x, weights, experts, gate, up, down, block, **ffn)
        # The policy's dot (fp8 under the fp8 policy) for each expert weight, one scale per weight.
        dots = ({name: self.policy.dot_general_cls(name=f"{name}_dot") for name in ("gate", "up", "down")}
                if self.policy.dot_general_cls else dict.fromkeys(("gate", "up", "down"), self.policy.dot_general))
        if implementation == "dense":
            return dense_experts(x, weights, experts, gate, up, down, dots, **ffn)
        capacity = expert_capacity(x.shape[1], n_experts, m.experts_per_token, m.moe_capacity_factor)
        return capacity_experts(x, weights, experts, gate, up, down, capacity, dots, **ffn)
