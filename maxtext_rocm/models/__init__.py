"""Model families. `build_model(cfg.model, policy)` returns the Flax module for a config."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import ml_collections

from maxtext_rocm.models.llama import Decoder, LlamaBlock
from maxtext_rocm.precision import Policy, policy_from_config

BLOCKS = {"llama": LlamaBlock}


def build_model(model_cfg, policy: Policy) -> Decoder:
    frozen = ml_collections.FrozenConfigDict(model_cfg)
    return Decoder(frozen, policy, block=BLOCKS[frozen.family])


def abstract_params(cfg):
    """Parameter shapes (boxed with their logical axes) without allocating anything."""
    model = build_model(cfg.model, policy_from_config(cfg.precision))
    tokens = jax.ShapeDtypeStruct((1, 8), jnp.int32)
    return jax.eval_shape(model.init, jax.random.key(0), tokens)["params"]


def count_params(cfg) -> int:
    """The number of parameters of `cfg`'s model, computed from shapes only."""
    leaves = jax.tree_util.tree_leaves(abstract_params(cfg))
    return sum(math.prod(leaf.shape) for leaf in leaves)
