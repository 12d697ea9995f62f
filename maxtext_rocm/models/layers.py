"""Building blocks shared by every model: RMSNorm, rotary embeddings, embeddings, dense layers.

Every parameter is created with logical axis names; `sharding.py` maps them to the mesh.
"""

from __future__ import annotations

import math
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import linen as nn

from maxtext_rocm.numerics.precision import Policy

Array = jax.Array
# The collection of trainable variables that a policy's dot strategy may add beside a frozen kernel
# (maxtext_rocm/finetune/lora.py): the scanned stack stacks it over layers like "params".
ADAPTERS = "adapters"


def kernel_init(in_axes: Sequence[int], out_axes: Sequence[int]):
    """Fan-in scaled truncated normal over possibly several input and output axes."""
    return nn.initializers.variance_scaling(
        1.0, "fan_in", "truncated_normal", in_axis=tuple(in_axes), out_axis=tuple(out_axes))


class Dense(nn.Module):
    """y = x @ W contracting the last `len(in_shape)` axes of x; W has shape in_shape + out_shape.

    The dot comes from the precision policy, so fp8 replaces it without touching the models.
    """

    in_shape: tuple[int, ...]
    out_shape: tuple[int, ...]
    kernel_axes: tuple[str, ...]
    policy: Policy

    @nn.compact
    def __call__(self, x: Array) -> Array:
        n_in, n_out = len(self.in_shape), len(self.out_shape)
        init = kernel_init(range(n_in), range(n_in, n_in + n_out))
        kernel = self.param(
            "kernel", nn.with_logical_partitioning(init, self.kernel_axes),
            self.in_shape + self.out_shape, self.policy.param_dtype)
        x, kernel = x.astype(self.policy.compute_dtype), kernel.astype(self.policy.compute_dtype)
        dot = self.policy.dot_general_cls(name="dot") if self.policy.dot_general_cls else self.policy.dot_general
        contract = (tuple(range(x.ndim - n_in, x.ndim)), tuple(range(n_in)))
        return dot(x, kernel, (contract, ((), ())))


class Kernel(nn.Module):
    """A Dense layer's weight alone, at the same path (NAME/kernel), for `fused_projections`."""

    in_shape: tuple[int, ...]
    out_shape: tuple[int, ...]
    kernel_axes: tuple[str, ...]
    policy: Policy

    @nn.compact
    def __call__(self) -> Array:
        n_in, n_out = len(self.in_shape), len(self.out_shape)
        init = kernel_init(range(n_in), range(n_in, n_in + n_out))
        return self.param("kernel", nn.with_logical_partitioning(init, self.kernel_axes),
                          self.in_shape + self.out_shape, self.policy.param_dtype)


def fused_projections(x: Array, kernels: Sequence[Array], axis: int, policy: Policy) -> Array:
    """x @ concat(kernels) as one dot over the last axis of x: the kernels ([in, *out] each) side
    by side along output axis `axis`, and so their outputs along that axis after x's leading ones. Under tensor parallelism the
    backward pass then sums x's gradient over the tensor shards once, not once per kernel.
    Concatenated along an axis that no mesh axis splits, so the weights stay where they are."""
    kernel = jnp.concatenate([k.astype(policy.compute_dtype) for k in kernels], axis=axis + 1)
    x = x.astype(policy.compute_dtype)
    return policy.dot_general(x, kernel, (((x.ndim - 1,), (0,)), ((), ())))


class RMSNorm(nn.Module):
    """Root-mean-square norm, computed in fp32 whatever the compute dtype. `unit_offset` (Gemma's
    model.norm_unit_offset): the scale applied is 1 + w, w stored zero-centred and initialised to 0."""

    eps: float
    policy: Policy
    unit_offset: bool = False

    @nn.compact
    def __call__(self, x: Array) -> Array:
        init = nn.initializers.zeros if self.unit_offset else nn.initializers.ones
        scale = self.param("scale", nn.with_logical_partitioning(init, ("norm",)), (x.shape[-1],),
                           self.policy.param_dtype).astype(jnp.float32)
        x32 = x.astype(jnp.float32)
        normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return (normed * (1.0 + scale if self.unit_offset else scale)).astype(self.policy.compute_dtype)


EMBED_TABLE_AXES = ("vocab", "embed")
HEAD_AXES = ("embed", "vocab")  # the untied LM head's kernel [d_model, vocab]


class Embed(nn.Module):
    """Token embedding table; `attend` reuses it as a tied LM head."""

    vocab_size: int
    d_model: int
    init_std: float
    policy: Policy
    scale: bool = False  # model.scale_embeddings: looked-up rows times sqrt(d_model) (Gemma)

    def setup(self):
        self.embedding = self.param(
            "embedding",
            nn.with_logical_partitioning(nn.initializers.normal(self.init_std), EMBED_TABLE_AXES),
            (self.vocab_size, self.d_model), self.policy.param_dtype)

    def __call__(self, tokens: Array) -> Array:
        rows = jnp.take(self.embedding, tokens, axis=0).astype(self.policy.compute_dtype)
        if not self.scale:
            return rows
        # sqrt(d_model) rounded to the compute dtype first, as transformers rounds it to the weights'
        return rows * jnp.asarray(math.sqrt(self.d_model), self.policy.compute_dtype)

    def attend(self, x: Array) -> Array:
        table = self.embedding.astype(self.policy.compute_dtype)
        return self.policy.dot_general(x.astype(self.policy.compute_dtype), table, (((2,), (1,)), ((), ())))


# ----------------------------------------------------------------------------------------------
# Rotary position embeddings


def rope_inv_frequencies(head_dim: int, theta: float, scaling=None, yarn=None) -> np.ndarray:
    """Inverse frequencies of the rotary embedding, with Llama 3.1's frequency scaling or YaRN's
    (`yarn`, model.rope_yarn: yarn_inv_frequencies).

    Llama 3.1 leaves high frequencies (wavelength < original_len / high_freq_factor) alone,
    divides low frequencies (wavelength > original_len / low_freq_factor) by `factor`, and
    interpolates smoothly in between.
    """
    if yarn is not None:
        return yarn_inv_frequencies(head_dim, theta, yarn)
    inv_freq = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))
    if scaling is None:
        return inv_freq.astype(np.float32)
    factor = scaling["factor"]
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    original = scaling["original_max_position"]
    wavelength = 2 * math.pi / inv_freq
    smooth = (original / wavelength - low) / (high - low)
    interpolated = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    scaled = np.where(wavelength > original / low, inv_freq / factor, inv_freq)
    is_medium = (wavelength <= original / low) & (wavelength >= original / high)
    return np.where(is_medium, interpolated, scaled).astype(np.float32)


def yarn_inv_frequencies(head_dim: int, theta: float, yarn) -> np.ndarray:
    """YaRN (Peng et al., 2023): dimensions that turn fewer than `beta_slow` times over the
    original context are interpolated (divided by `factor`), those turning more than `beta_fast`
    times kept, with a linear ramp between the two dimension bounds (rounded outwards unless
    `truncate` is false, as gpt-oss publishes it)."""
    dims = np.arange(0, head_dim, 2, dtype=np.float64) / head_dim
    extrapolated = 1.0 / theta ** dims
    original = yarn["original_max_position"]

    def dimension_of(rotations: float) -> float:  # the dimension that turns `rotations` times over `original`
        return head_dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dimension_of(yarn["beta_fast"]), dimension_of(yarn["beta_slow"])
    if yarn["truncate"]:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    ramp = np.clip((np.arange(head_dim // 2) - low) / ((high - low) or 0.001), 0, 1)  # 1: interpolated
    return (extrapolated / yarn["factor"] * ramp + extrapolated * (1 - ramp)).astype(np.float32)


def rope_attention_factor(yarn) -> float:
    """What YaRN multiplies the rotated queries and keys by (so the scores by its square): the
    given attention_factor, else 0.1 ln(factor) + 1; 1 without YaRN."""
    if yarn is None:
        return 1.0
    if yarn.get("attention_factor") is not None:
        return float(yarn["attention_factor"])
    return 0.1 * math.log(yarn["factor"]) + 1.0 if yarn["factor"] > 1 else 1.0


def apply_rope(x: Array, positions: Array, inv_freq: np.ndarray) -> Array:
    """Rotates x [batch, seq, heads, head_dim] by its positions [batch, seq].

    Pairs are (i, i + head_dim/2), the layout Hugging Face's Llama uses, so converted
    checkpoints need no permutation of the q/k projections.
    """
    angles = positions[..., None].astype(jnp.float32) * jnp.asarray(inv_freq)  # [b, s, d/2]
    sin, cos = jnp.sin(angles)[:, :, None, :], jnp.cos(angles)[:, :, None, :]
    x32 = x.astype(jnp.float32)
    first, second = jnp.split(x32, 2, axis=-1)
    rotated = jnp.concatenate([first * cos - second * sin, second * cos + first * sin], axis=-1)
    return rotated.astype(x.dtype)

