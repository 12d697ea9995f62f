"""Model families. `build_model(cfg.model, policy)` returns the Flax module for a config.

Every function here takes a resolved config (maxtext_rocm/resolve.py; maxtext_rocm.api resolves a
loaded one): the model decides no "auto" itself."""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import flax.core
import ml_collections

from flax import linen as nn

from maxtext_rocm.config.choices import MOE_FAMILIES
from maxtext_rocm.models.llama import Decoder, LlamaBlock
from maxtext_rocm.models.mixtral import MixtralBlock
from maxtext_rocm.numerics.precision import Policy, policy_from_config


def block_of(family: str) -> type[nn.Module]:
    """The block of `family` (model.family): a mixture of experts for MOE_FAMILIES, else dense.
    Every other difference between families is a layer option of cfg.model (qk_norm, qkv_bias, ...)."""
    return MixtralBlock if family in MOE_FAMILIES else LlamaBlock



def build_model(model_cfg, policy: Policy, decode: bool = False, expert_exchange=None, layer_stack=None,
                context_attention=None) -> Decoder:
    """`decode=True`: the same parameters, with a KV cache for generation (maxtext_rocm/generate.py).
    `expert_exchange`: how a dropless MoE layer runs across devices, from
    maxtext_rocm/parallel/experts.py (None: on one device, or a dense model).
    `layer_stack`: how the scanned layers run across devices, from maxtext_rocm/parallel/pipeline/
    (None: in order on every device).
    `context_attention`: attention over a sequence-split batch, from maxtext_rocm/parallel/context.py
    (None: without a `sequence` axis).
    `model_cfg` is resolved (maxtext_rocm/resolve.py): the model decides no "auto" itself."""
    if model_cfg.fuse_projections == "auto":
        raise ValueError("model.fuse_projections='auto' reached the model: the config was not resolved "
                         "(maxtext_rocm.resolve.resolve() was skipped)")
    frozen = ml_collections.FrozenConfigDict(model_cfg)
    return Decoder(frozen, policy, block=block_of(frozen.family), decode=decode, expert_exchange=expert_exchange,
                   layer_stack=layer_stack, context_attention=context_attention)


@functools.lru_cache(maxsize=8)
def _jitted_apply(model_cfg: ml_collections.FrozenConfigDict, policy: Policy):
    model = build_model(model_cfg, policy)
    # Every other collection mutable: state the params do not carry (fp8 scales, router losses)
    # starts fresh and is dropped.
    others = flax.core.DenyList("params")
    return jax.jit(lambda params, tokens: model.apply({"params": params}, tokens, mutable=others)[0])


def forward(cfg, params, tokens) -> jax.Array:
    """Logits [batch, seq, vocab] of `tokens` [batch, seq] for `cfg`'s model under its precision
    policy (cfg.precision.policy; "fp32" for reference numbers). No mesh is needed: on one device
    the logical sharding constraints do nothing. `params` as `from_hf` or `restore_params` give them.
    A mixture of experts runs `model.moe_impl` as training would (its default is the exact
    "dropless"; only an explicit "capacity" drops tokens)."""
    params = nn.meta.unbox(params)
    if set(params) == {"params"}:  # a {"params": ...} variables dict
        params = params["params"]
    apply = _jitted_apply(ml_collections.FrozenConfigDict(cfg.model), policy_from_config(cfg.precision))
    return apply(params, jnp.asarray(tokens, jnp.int32))


def abstract_params(cfg):
    """Parameter shapes (boxed with their logical axes) without allocating anything."""
    model = build_model(cfg.model, policy_from_config(cfg.precision))
    tokens = jax.ShapeDtypeStruct((1, 8), jnp.int32)
    return jax.eval_shape(model.init, jax.random.key(0), tokens)["params"]


def count_params(cfg) -> int:
    """The number of parameters of `cfg`'s model, computed from shapes only."""
    leaves = jax.tree_util.tree_leaves(abstract_params(cfg))
    return sum(math.prod(leaf.shape) for leaf in leaves)


def count_active_params(cfg) -> int:
    """The parameters one token passes through, computed from shapes only.

    An expert weight (one with an "exp" axis) counts experts_per_token / n_experts of its size;
    everything else, embedding included, counts whole (Mixtral's published "active" figures).
    """
    m = cfg.model
    boxes = jax.tree_util.tree_leaves(abstract_params(cfg), is_leaf=lambda x: isinstance(x, nn.Partitioned))
    total = 0
    for box in boxes:
        size = math.prod(box.value.shape)
        total += size * m.experts_per_token // m.n_experts if "exp" in box.names else size
    return total
