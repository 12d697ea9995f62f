"""The gated MLPs' activations (model.mlp_activation), as hidden = f(gate, up), for the dense MLP
and every expert computation alike.

- "silu":         SwiGLU, silu(gate) * up (Llama, Mistral, Qwen, Mixtral).
- "gelu_tanh":    GeGLU with tanh GELU (Gemma).
- "clamped_silu": gpt-oss's SwiGLU: the gate clipped above and the up projection both ways at
                  CLAMP_LIMIT, the gate's sigmoid sharpened by SIGMOID_ALPHA, and one added to up:
                  (clip(up) + 1) * g * sigmoid(alpha * g), g = min(gate, limit).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import linen as nn

Array = jax.Array

# gpt-oss's published swiglu_limit and swiglu_alpha (transformers' GptOssConfig defaults); a
# checkpoint with others is refused on import (convert/hf_config.py).
CLAMP_LIMIT = 7.0
SIGMOID_ALPHA = 1.702


def _clamped_silu(gate: Array, up: Array) -> Array:
    gate = jnp.minimum(gate, CLAMP_LIMIT)
    up = jnp.clip(up, -CLAMP_LIMIT, CLAMP_LIMIT)
    return (up + 1) * (gate * jax.nn.sigmoid(gate * SIGMOID_ALPHA))


GATED = {
    "silu": lambda gate, up: nn.silu(gate) * up,
    "gelu_tanh": lambda gate, up: nn.gelu(gate, approximate=True) * up,
    "clamped_silu": _clamped_silu,
}


def gated(name: str, gate: Array, up: Array) -> Array:
    """model.mlp_activation `name` of the gate and up projections' outputs."""
    return GATED[name](gate, up)


def gated_grads(name: str, gate: Array, up: Array, d_hidden: Array) -> tuple[Array, Array]:
    """(d_gate, d_up) of gated(name, gate, up) given d_hidden, for hand-written backward passes
    (models/blocked_experts.py). SwiGLU's by its closed form, as that loop has always computed it;
    the others by JAX's own derivative of the forward."""
    if name == "silu":
        sigmoid_g = jax.nn.sigmoid(gate)
        return d_hidden * up * sigmoid_g * (1 + gate * (1 - sigmoid_g)), d_hidden * nn.silu(gate)
    _, pullback = jax.vjp(GATED[name], gate, up)
    return pullback(d_hidden.astype(jnp.result_type(gate)))
