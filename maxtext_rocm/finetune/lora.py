"""LoRA: low-rank adapters beside a frozen base, as a dot strategy of the precision policy.

A targeted dense layer computes y = x W + (alpha / r) (x A) B with A [in, r] and B [r, out]. The
low-rank path runs inside the layer's dot (`LoraDot`, handed to the models as
`Policy.dot_general_cls`, the slot the fp8 dot uses), so models/ stays unaware of LoRA and of the
mesh, and neither W + (alpha / r) A B nor a gradient the size of W is ever made: the step
differentiates the adapters alone, and XLA drops the unused weight-gradient matmuls. The merged
weight exists only in exports (`merge`).

Variables: the base is the model's "params" collection, held in the compute dtype outside the
optimizer (TrainState.frozen); A and B live in the "adapters" collection (models.layers.ADAPTERS)
at the dot's path, `.../q/dot/{a,b}`, and are what the optimizer and the checkpoints see.
A takes W's input axes (and their sharding), B W's output axes; the rank axis is replicated.
Applied without the adapters collection the same model is the base alone (DPO's reference).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
from flax import linen as nn

from maxtext_rocm.models import moe
from maxtext_rocm.models.layers import ADAPTERS, Dense
from maxtext_rocm.numerics.fp8 import FP8_COLLECTION
from maxtext_rocm.numerics.precision import Policy

Array = jax.Array

# PEFT's initialisation of A (kaiming_uniform with a = sqrt(5)): uniform in +-1/sqrt(fan_in).
_A_INIT = nn.initializers.variance_scaling(1.0 / 3.0, "fan_in", "uniform")


class LoraDot(nn.Module):
    """Called like lax.dot_general by a Dense layer (models/layers.py). In a Dense named in
    `targets` it adds the scaled low-rank path; elsewhere (and with no adapters present) it is
    `inner_cls` (the fp8 dot) or `plain_dot`."""

    targets: tuple[str, ...]
    rank: int
    scale: float  # alpha / rank
    dropout: float
    plain_dot: Callable[..., Any]
    inner_cls: Callable[..., Any] | None = None

    @nn.compact
    def __call__(self, x: Array, kernel: Array, dimension_numbers, precision=None,
                 preferred_element_type=None) -> Array:
        if self.inner_cls:  # called as the layers call it
            y = self.inner_cls(name="base")(x, kernel, dimension_numbers)
        else:
            y = self.plain_dot(x, kernel, dimension_numbers, precision, preferred_element_type)
        layer = self.parent
        if not (isinstance(layer, Dense) and layer.name in self.targets):
            return y
        if not (self.is_initializing() or self.has_variable(ADAPTERS, "a")):
            return y  # applied without adapters: the base model
        n_in = len(layer.in_shape)
        in_axes, out_axes = tuple(layer.kernel_axes[:n_in]), tuple(layer.kernel_axes[n_in:])
        # Adapters are trained, so they stay in fp32 like every trained parameter.
        a = self.variable(ADAPTERS, "a", lambda: nn.with_logical_partitioning(_A_INIT, in_axes + (None,))(
            self.make_rng("params"), (*layer.in_shape, self.rank), jnp.float32)).value
        b = self.variable(ADAPTERS, "b", lambda: nn.with_logical_partitioning(nn.initializers.zeros, (None,) + out_axes)(
            None, (self.rank, *layer.out_shape), jnp.float32)).value
        if self.dropout > 0 and self.has_rng("dropout"):  # only the step passes a dropout key
            x = nn.Dropout(self.dropout, deterministic=False)(x, rng=self.make_rng("dropout"))
        x_contract = tuple(range(x.ndim - n_in, x.ndim))
        xa = self.plain_dot(x, a.astype(x.dtype), ((x_contract, tuple(range(n_in))), ((), ())))
        low_rank = self.plain_dot(xa, b.astype(x.dtype), (((xa.ndim - 1,), (0,)), ((), ())))
        return y + (low_rank * self.scale).astype(y.dtype)


def enabled(lora_cfg) -> bool:
    return lora_cfg.rank > 0


def scale(lora_cfg) -> float:
    return float(lora_cfg.alpha) / lora_cfg.rank


def policy_with_lora(policy: Policy, lora_cfg) -> Policy:
    """`policy` whose dense layers take `cfg.lora`'s adapters (unchanged when lora.rank is 0).
    Its plain dot and fp8 dot stay the base's: LoraDot calls them."""
    if not enabled(lora_cfg):
        return policy
    dot = functools.partial(LoraDot, targets=tuple(lora_cfg.targets), rank=int(lora_cfg.rank),
                            scale=scale(lora_cfg), dropout=float(lora_cfg.dropout),
                            plain_dot=policy.dot_general, inner_cls=policy.dot_general_cls)
    return dataclasses.replace(policy, dot_general_cls=dot)


def dropout_rate(policy: Policy) -> float:
    """The adapters' dropout under `policy` (0 without LoRA): the step passes a key only if > 0."""
    dot = policy.dot_general_cls
    if isinstance(dot, functools.partial) and dot.func is LoraDot:
        return dot.keywords["dropout"]
    return 0.0


def to_compute_dtype(base, dtype):
    """The frozen base in the compute dtype (boxes kept): it is read, never updated, so fp32
    master copies buy nothing, and the layers cast to this dtype anyway."""
    return jax.tree_util.tree_map(lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x, base)


def apply_model(model, params, batch: dict, *, frozen=None, fp8_state=None, dropout_key=None,
                return_hidden: bool = False, loss=None):
    """model.apply on a batch with the variables of a plain or a LoRA run (`frozen`: the base, then
    `params` are the adapters), its fp8 state and the adapters' dropout key; (output, aux
    collections with the MoE router losses). `loss`: a StackLoss, for a model whose layer stack
    runs it (the output is then (objective, sums))."""
    variables = model_variables(params, frozen)
    if fp8_state:
        variables[FP8_COLLECTION] = fp8_state
    return model.apply(variables, batch["inputs"], batch.get("positions"), batch.get("segment_ids"),
                       return_hidden=return_hidden, **({} if loss is None else {"loss": loss}),
                       mutable=[moe.AUX_LOSSES],
                       rngs=None if dropout_key is None else {"dropout": dropout_key})


def model_variables(params, frozen) -> dict:
    """The variables a model applies with: `params` alone, or under LoRA (`frozen` non-empty) the
    frozen base as "params" and `params`, the adapters, as "adapters"."""
    if frozen:
        return {"params": frozen, ADAPTERS: params}
    return {"params": params}


class Adapted(NamedTuple):
    """One adapted layer of an adapters tree: the path of its kernel in the base params, A, B."""
    kernel_path: tuple[str, ...]
    a: Any
    b: Any


def adapted_layers(adapters, path: tuple[str, ...] = ()) -> list[Adapted]:
    """Every adapted layer of `adapters` (A and B at `.../NAME/dot/{a,b}`; the kernel at
    `.../NAME/kernel`), in the tree's order."""
    if set(adapters) == {"a", "b"}:
        return [Adapted(path[:-1] + ("kernel",), adapters["a"], adapters["b"])]
    return [layer for name in adapters for layer in adapted_layers(adapters[name], path + (name,))]


def delta(a, b, kernel_shape: tuple[int, ...], scale_: float, xp=jnp):
    """scale * A B shaped like the kernel [*lead, *in, *out], for A [*lead, *in, r] and
    B [*lead, r, *out] (lead: the stacked layers' axis, when there is one). `xp`: numpy for
    exports on the host, jax.numpy for arrays on devices."""
    lead = a.ndim + b.ndim - 2 - len(kernel_shape)
    rank = a.shape[-1]
    a2 = a.reshape(*a.shape[:lead], -1, rank)
    b2 = b.reshape(*b.shape[:lead], rank, -1)
    product = xp.matmul(a2.astype(xp.float32), b2.astype(xp.float32)) * xp.float32(scale_)
    return product.reshape(kernel_shape)


def _leaf(tree, path):
    for name in path:
        tree = tree[name]
    return tree


def merge(base, adapters, lora_cfg, xp=jnp):
    """The base params with every adapted kernel replaced by W + (alpha / r) A B (in W's dtype):
    the model an export writes. A new tree; `base` is not changed."""
    merged = jax.tree_util.tree_map(lambda x: x, base)  # fresh containers, the same leaves

    def put(tree, path, value):
        for name in path[:-1]:
            tree = tree[name]
        tree[path[-1]] = value

    for layer in adapted_layers(adapters):
        kernel = _leaf(base, layer.kernel_path)
        value = kernel.astype(xp.float32) + delta(layer.a, layer.b, kernel.shape, scale(lora_cfg), xp)
        put(merged, layer.kernel_path, value.astype(kernel.dtype))
    return merged
