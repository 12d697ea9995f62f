"""Layers that differ along the stack: each layer's attention kind (model.attention_kinds), and
what a kind decides: the window a query sees, the rope frequencies and YaRN's attention factor.

Sliding and full layers hold the same parameters, so every stack is one structure: the Decoder
scans one block over all n_layers, like Llama's, and where the kinds differ it hands each layer
its index as scanned data; the layer looks its kind up here and selects between the two kinds'
settings (exact: each is computed as it would be for a stack of one kind). A pipeline's stages
and a remainder of layers the unit does not divide therefore need nothing of their own: a
stage's slot passes the index of the layer it holds (parallel/pipeline/stages.py), and
compilation holds one layer, whatever the depth.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from maxtext_rocm.models.layers import rope_attention_factor, rope_inv_frequencies

Array = jax.Array


def layer_kinds(m) -> tuple[str, ...]:
    """Each layer's attention kind: model.attention_kinds repeated over n_layers (its remainder
    where the count does not divide), or every layer sliding under model.sliding_window, else full."""
    unit = tuple(m.attention_kinds) or (("sliding",) if m.sliding_window else ("full",))
    return tuple(unit[i % len(unit)] for i in range(m.n_layers))


def kinds_differ(m) -> bool:
    """Whether the stack's layers are of more than one kind: then each takes its index."""
    return len(set(layer_kinds(m))) > 1


class KindSettings(NamedTuple):
    """What a layer's kind decides: `window` (tokens a query sees, 0: all before it), the rope's
    `inv_freq` [head_dim / 2] and YaRN's `attention_factor` on the rotated q and k (None: no YaRN
    on this layer). Python values for a static kind; traced ones for a layer given by its index."""

    window: int | Array
    inv_freq: np.ndarray | Array
    attention_factor: float | Array | None


def kind_settings(m, kind: str) -> KindSettings:
    """The settings of a layer of `kind`: "full", "sliding", or "" (model.sliding_window's window,
    rope_theta's rope). A sliding layer takes model.rope_local_theta where given (Gemma 3's local
    layers, unscaled, without YaRN); every other takes rope_theta with rope_scaling or YaRN and
    the linear factor."""
    window = 0 if kind == "full" else (m.sliding_window or 0)
    if kind == "sliding" and m.rope_local_theta:
        return KindSettings(window, rope_inv_frequencies(m.head_dim, m.rope_local_theta, None), None)
    inv_freq = rope_inv_frequencies(m.head_dim, m.rope_theta, m.rope_scaling, m.rope_yarn) / m.rope_linear_factor
    return KindSettings(window, inv_freq, None if m.rope_yarn is None else rope_attention_factor(m.rope_yarn))


def is_sliding(m, layer: Array) -> Array:
    """Whether layer `layer` (a traced index, clipped into the stack) is sliding."""
    table = np.array([kind == "sliding" for kind in layer_kinds(m)])
    return jnp.asarray(table)[jnp.clip(layer, 0, m.n_layers - 1)]


def settings_of_layer(m, layer: Array) -> tuple[Array, KindSettings]:
    """(whether it is sliding, its KindSettings) for layer `layer`, a traced index: each setting
    the sliding kind's where it is sliding, the full kind's elsewhere."""
    sliding = is_sliding(m, layer)
    full, local = kind_settings(m, "full"), kind_settings(m, "sliding")
    window = jnp.where(sliding, local.window, full.window)
    inv_freq = (full.inv_freq if np.array_equal(full.inv_freq, local.inv_freq)
                else jnp.where(sliding, jnp.asarray(local.inv_freq), jnp.asarray(full.inv_freq)))
    factors = [1.0 if s.attention_factor is None else s.attention_factor for s in (local, full)]
    factor = None if full.attention_factor is None and local.attention_factor is None else (
        factors[0] if factors[0] == factors[1] else jnp.where(sliding, *factors))
    return sliding, KindSettings(window, inv_freq, factor)
