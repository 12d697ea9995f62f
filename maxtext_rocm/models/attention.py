"""Grouped-query attention: one entry point, several implementations.

- "xla":       plain einsums and a softmax in fp32; runs on every backend and is the reference.
- "cudnn":     cuDNN's fused flash attention through `jax.nn.dot_product_attention` (CUDA GPUs).
- "blockwise": FlashAttention's algorithm in XLA ops (blockwise_attention.py): no [seq, seq]
               scores held, every backend; the memory-bounded choice on ROCm.
- "pallas":    FlashAttention-2 as Pallas kernels (pallas_attention.py): Triton on CUDA and ROCm
               GPUs, Pallas' interpreter on the CPU (slow; there for tests). Never picked by "auto"
               until a GPU measurement says it beats the choice above.
- "auto":      "cudnn" on CUDA GPUs (bf16/fp16), "blockwise" on ROCm and for long sequences on
               the CPU, else "xla" (implementation_for), decided by the resolve step
               (maxtext_rocm/resolve.py) before the model is built: the model never sees "auto".
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
from flax import linen as nn

from maxtext_rocm.config import ConfigError
from maxtext_rocm.models.blockwise_attention import blockwise_attention
from maxtext_rocm.models.layer_kinds import kind_settings, settings_of_layer
from maxtext_rocm.models.layers import Dense, Kernel, RMSNorm, apply_rope, fused_projections
from maxtext_rocm.numerics.precision import Policy

Array = jax.Array
# The Flax collection of the decoding KV cache (Attention with decode=True).
CACHE = "cache"


def attention_mask(seq_len: int, segment_ids: Array | None, sliding_window: int | None = None) -> Array:
    """Causal mask [batch or 1, 1, seq, seq]; with segment ids, documents never see each other.

    With a sliding window W (Mistral's), a query sees the W tokens ending at itself; a traced W
    (a layer given by its index, models/layer_kinds.py) is applied as a value, 0 meaning none.
    """
    causal = jnp.tril(jnp.ones((seq_len, seq_len), dtype=bool))
    if isinstance(sliding_window, jax.Array):
        index = jnp.arange(seq_len)
        causal = within_window(causal, index[:, None], index[None, :], sliding_window)
    elif sliding_window:
        causal = jnp.triu(causal, k=1 - sliding_window)
    causal = causal[None, None]
    if segment_ids is None:
        return causal
    same_doc = segment_ids[:, None, :, None] == segment_ids[:, None, None, :]
    return causal & same_doc


# Sequence length from which "auto" picks "blockwise" on the CPU. tiny_llama on 2 cores, 4096
# tokens per step: 256-token sequences ran at the same speed either way (one block), 1024-token
# ones 1.3x faster blockwise (peak RSS 745 vs 1,544 MiB), 4096-token ones 3.6x (789 vs 5,389 MiB).
CPU_BLOCKWISE_MIN_SEQ = 1024


def resolve_implementation(name: str, device=None, dtype=None, seq_len: int | None = None) -> str:
    """`model.attention` for `device` (default: this process's first): implementation_for on its
    platform."""
    return implementation_for(name, platform_of(device or jax.devices()[0]), dtype, seq_len)


# The implementations that take model.attention_sinks (config/checks.py refuses the others with them).
SINK_IMPLEMENTATIONS = ("xla", "blockwise")


def implementation_for(name: str, platform: str, dtype=None, seq_len: int | None = None, sinks: bool = False) -> str:
    """`model.attention` on `platform` ("cpu", "cuda", "rocm"; platform_of), with "auto" replaced
    by the platform's memory-bounded attention: cuDNN's fused kernel on CUDA GPUs in bf16/fp16
    (checked on an H200 against "xla"; it has no fp32 form), the blockwise one on ROCm and for
    fp32 on CUDA. On the CPU: "blockwise" from CPU_BLOCKWISE_MIN_SEQ tokens per sequence, the
    reference "xla" below (where they tie). `dtype`: the compute dtype (default bf16). "pallas"
    on a platform its kernels do not serve is a ConfigError. With `sinks` (model.attention_sinks),
    which cuDNN's kernel has no input for, "auto" never picks cuDNN. Called by the resolve step
    (maxtext_rocm/resolve.py); the model receives its answer."""
    if name == "pallas":
        check_pallas_platform(platform)
    if name != "auto":
        return name
    if platform == "cpu":
        return "blockwise" if seq_len and seq_len >= CPU_BLOCKWISE_MIN_SEQ else "xla"
    half = jnp.dtype(dtype or jnp.bfloat16) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
    return "cudnn" if platform == "cuda" and half and not sinks else "blockwise"


# Where the Pallas kernels run: through Triton on GPUs (CUDA, and ROCm where jax routes Pallas to
# Triton), interpreted on the CPU. A TPU would need Mosaic kernels, which this project lacks.
PALLAS_PLATFORMS = ("cuda", "rocm", "cpu")


def check_pallas_platform(platform: str) -> None:
    if platform not in PALLAS_PLATFORMS:
        raise ConfigError(f"model.attention='pallas' runs on GPUs (Triton) and, interpreted, on the CPU, "
                          f"not on {platform}; use model.attention='blockwise' or 'auto'")


def platform_of(device) -> str:
    """"cuda" or "rocm" for a GPU (JAX names both "gpu"; ROCm's platform version says "rocm"),
    else the device's own platform ("cpu", "tpu")."""
    if device.platform != "gpu":
        return device.platform
    return "rocm" if "rocm" in device.client.platform_version.lower() else "cuda"


def is_cuda_gpu(device) -> bool:
    return platform_of(device) == "cuda"


def dot_product_attention(q: Array, k: Array, v: Array, *, segment_ids: Array | None = None,
                          implementation: str = "xla", sliding_window: int | None = None,
                          dot_general=jax.lax.dot_general, sinks: Array | None = None) -> Array:
    """Causal attention. q: [batch, seq, heads, head_dim]; k, v: [batch, seq, kv_heads, head_dim].

    Each group of heads/kv_heads query heads shares one key/value head. `dot_general`: the
    precision policy's, for the "xla" implementation's two matmuls. `sinks` [heads]: each head's
    extra logit in the softmax's denominator (model.attention_sinks; "xla" and "blockwise" only).
    """
    if implementation == "auto":
        raise ValueError("model.attention='auto' reached the model: the config was not resolved "
                         "(maxtext_rocm.resolve.resolve() was skipped)")
    if sinks is not None and implementation not in SINK_IMPLEMENTATIONS:
        raise ValueError(f"model.attention={implementation!r} has no attention sinks; the config checks refuse it")
    if implementation == "blockwise":
        return blockwise_attention(q, k, v, segment_ids=segment_ids, sliding_window=sliding_window, sinks=sinks)
    if implementation == "pallas":
        # Imported here: Pallas and its Triton module took 0.4-1.5 s to import on this machine,
        # a cost every launch would pay otherwise.
        from maxtext_rocm.models.pallas_attention import pallas_attention

        return pallas_attention(q, k, v, segment_ids=segment_ids, sliding_window=sliding_window)
    mask = attention_mask(q.shape[1], segment_ids, sliding_window)
    if implementation == "cudnn":
        return jax.nn.dot_product_attention(
            q, k, v, mask=None if segment_ids is None else mask,
            is_causal=segment_ids is None, implementation="cudnn",
            local_window_size=(sliding_window - 1, 0) if sliding_window else None)
    return masked_attention(q, k, v, mask, dot_general, sinks)


def masked_attention(q: Array, k: Array, v: Array, mask: Array, dot_general=jax.lax.dot_general,
                     sinks: Array | None = None) -> Array:
    """The "xla" attention under any mask [batch or 1, 1, q_len, kv_len] (True = attend).

    q: [batch, q_len, heads, head_dim]; k, v: [batch, kv_len, kv_heads, head_dim]. `sinks`
    [heads]: a logit per head that joins each row's softmax and attends to nothing (gpt-oss).
    """
    batch, seq, heads, head_dim = q.shape
    kv_heads = k.shape[2]
    groups = heads // kv_heads
    q = q.reshape(batch, seq, kv_heads, groups, head_dim)
    # [b, q, k, g, d] x [b, s, k, d] -> [b, k, q, g, s]: batch and kv head are batch axes.
    scores = dot_general(q, k, (((4,), (3,)), ((0, 2), (0, 2))), preferred_element_type=jnp.float32)
    scores = jnp.transpose(scores, (0, 1, 3, 2, 4)) * (head_dim ** -0.5)  # [b, k, g, q, s]
    scores = jnp.where(mask[:, :, None], scores, jnp.finfo(jnp.float32).min)
    if sinks is None:
        probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    else:  # the sink's column joins the softmax, then leaves: the rows sum to less than one
        sink = jnp.broadcast_to(sinks.astype(jnp.float32).reshape(1, kv_heads, groups, 1, 1), (*scores.shape[:-1], 1))
        probs = jax.nn.softmax(jnp.concatenate([scores, sink], axis=-1), axis=-1)[..., :-1].astype(v.dtype)
    out = dot_general(probs, v, (((4,), (1,)), ((0, 1), (0, 2))))  # [b, k, g, q, d]
    return jnp.transpose(out, (0, 3, 1, 2, 4)).reshape(batch, seq, heads, head_dim)


def position_mask(q_positions: Array, k_positions: Array, sliding_window: int | None = None) -> Array:
    """Mask [batch, 1, q_len, kv_len] from token positions: a query sees the keys at or before its
    own position (within the sliding window, if any). A negative position marks padding or an
    empty cache slot, which no query sees."""
    q_pos, k_pos = q_positions[:, None, :, None], k_positions[:, None, None, :]
    return within_window((k_pos >= 0) & (k_pos <= q_pos), q_pos, k_pos, sliding_window)


def within_window(mask: Array, q_pos: Array, k_pos: Array, window) -> Array:
    """`mask` where the key lies within the query's `window` (a static size, 0 or None for none;
    or a traced one, 0 meaning none)."""
    if isinstance(window, jax.Array):
        return mask & ((window == 0) | (q_pos - k_pos < window))
    return mask & (q_pos - k_pos < window) if window else mask


def by_window(attend: Callable, window, sliding, local_window: int, traced: bool) -> Array:
    """attend(window) under a layer's window. A static window (`sliding` None) goes as it is. A
    layer given by its index has a traced one: an implementation that takes it as a mask value
    (`traced`: the xla attention) gets it so; the others, whose kernels take a static window, run
    under lax.cond between the sliding kind's `local_window` and none. In a scan one branch runs;
    in a pipeline's stages, vmapped, both do (a cond on a batched predicate is a select)."""
    if sliding is None or traced:
        return attend(window)
    return jax.lax.cond(sliding, lambda: attend(local_window), lambda: attend(0))


class Attention(nn.Module):
    """Self-attention with rotary embeddings: q/k/v projections, attention, output projection."""

    cfg: "ml_collections.FrozenConfigDict"  # noqa: F821 - cfg.model
    policy: Policy
    # Decoding (generate.py): keys and values accumulate in the "cache" collection, sized by the
    # input of `init`; each call appends its tokens and attends over the cache by position.
    decode: bool = False
    # Attention over a sequence split across devices, f(q, k, v, segment_ids, window=) -> out, built from
    # the config and the mesh outside the model (maxtext_rocm/parallel/context.py); None: this
    # module's own attention (one device, or no `sequence` axis).
    context_attention: Callable | None = None
    # "full" or "sliding" (model.attention_kinds): the window and the rope this layer uses; "": as
    # model.sliding_window says for every layer. A layer called with its index (a stack whose
    # kinds differ) looks its kind up instead (models/layer_kinds.py).
    kind: str = ""

    def sinks(self) -> Array:
        """model.attention_sinks: one logit per query head, in fp32 (a softmax input)."""
        init = nn.initializers.normal(0.02)
        return self.param("sinks", nn.with_logical_partitioning(init, ("heads",)), (self.cfg.n_heads,),
                          self.policy.param_dtype).astype(jnp.float32)

    @nn.compact
    def __call__(self, x: Array, positions: Array, segment_ids: Array | None, layer: Array | None = None) -> Array:
        """`layer`: this layer's index in a stack whose kinds differ (traced, scanned with the
        weights), which decides its kind; None: the module's own `kind`."""
        m = self.cfg
        sliding, kind = (None, kind_settings(m, self.kind)) if layer is None else settings_of_layer(m, layer)
        d, hd = m.d_model, m.head_dim
        q, k, v = self.project(x)
        if m.qkv_bias:  # Qwen2.5: added after the dot, so fp8, fused projections and LoRA never see them
            q, k, v = (t + self.bias(name, t.shape[-2:]) for name, t in zip(("q_bias", "k_bias", "v_bias"), (q, k, v)))
        if m.qk_norm:  # Qwen3, Gemma 3: each head's query and key normalised over head_dim, before rope
            q = RMSNorm(m.norm_eps, self.policy, m.norm_unit_offset, name="q_norm")(q)
            k = RMSNorm(m.norm_eps, self.policy, m.norm_unit_offset, name="k_norm")(k)
        q = nn.with_logical_constraint(q, ("activation_batch", "activation_length", "activation_heads", None))
        k = nn.with_logical_constraint(k, ("activation_batch", "activation_length", "activation_kv_heads", None))
        v = nn.with_logical_constraint(v, ("activation_batch", "activation_length", "activation_kv_heads", None))

        q, k = apply_rope(q, positions, kind.inv_freq), apply_rope(k, positions, kind.inv_freq)
        if kind.attention_factor is not None:  # YaRN's factor on the rotated q and k, as on cos and sin
            factor = jnp.asarray(kind.attention_factor, q.dtype)
            q, k = q * factor, k * factor
        sinks = self.sinks() if m.attention_sinks else None
        if m.query_pre_attn_scalar:  # Gemma 3's score scale, by every implementation's head_dim ** -0.5
            q = q * jnp.asarray((hd / m.query_pre_attn_scalar) ** 0.5, q.dtype)
        if self.decode and self.has_variable(CACHE, "key"):
            out = self.cached_attention(q, k, v, positions, kind.window, sinks)
        else:
            if self.decode:  # `init` sizes the cache [batch, max_len, kv_heads, head_dim]
                self.cache_variables(k, positions)
            split = self.context_attention is not None and not self.decode
            if split:  # no sinks: the config checks refuse them
                def attend(window):
                    return self.context_attention(q, k, v, segment_ids, window=window)
            else:
                def attend(window):
                    return dot_product_attention(q, k, v, segment_ids=segment_ids, implementation=m.attention,
                                                 sliding_window=window, dot_general=self.policy.dot_general,
                                                 sinks=sinks)
            out = by_window(attend, kind.window, sliding, m.sliding_window or 0,
                            traced=not split and m.attention == "xla")
        out = nn.with_logical_constraint(out, ("activation_batch", "activation_length", "activation_heads", None))
        out = Dense((m.n_heads, hd), (d,), ("heads", "head_dim", "embed"), self.policy, name="o")(out)
        if m.out_bias:  # gpt-oss: after the dot, as the q/k/v biases
            out = out + self.param("o_bias", nn.with_logical_partitioning(nn.initializers.zeros, ("embed",)), (d,),
                                   self.policy.param_dtype).astype(out.dtype)
        return out

    def project(self, x: Array) -> tuple[Array, Array, Array]:
        """q [.., heads, head_dim], k and v [.., kv_heads, head_dim]. Without fp8 as one dot over
        the kernels side by side, grouped by kv head ([d, kv, group + 2, head_dim]: a kv head's
        query heads, its key, its value), so tensor parallelism reduces x's gradient once, not
        three times, and the kv axis that tensor parallelism splits stays split the same way."""
        m = self.cfg
        d, hd, kv = m.d_model, m.head_dim, m.n_kv_heads
        specs = {"q": ((d,), (m.n_heads, hd), ("embed", "heads", "head_dim"), self.policy),
                 "k": ((d,), (kv, hd), ("embed", "kv_heads", "head_dim"), self.policy),
                 "v": ((d,), (kv, hd), ("embed", "kv_heads", "head_dim"), self.policy)}
        if self.policy.dot_general_cls or m.fuse_projections != "on":  # fp8: each weight its own dot and scales
            return tuple(Dense(*spec, name=name)(x) for name, spec in specs.items())
        group = m.n_heads // kv
        kernels = {name: Kernel(*spec, name=name)() for name, spec in specs.items()}
        qkv = fused_projections(x, [kernels["q"].reshape(d, kv, group, hd), kernels["k"][:, :, None],
                                    kernels["v"][:, :, None]], 1, self.policy)  # [.., kv, group + 2, hd]
        q = qkv[..., :group, :].reshape(*x.shape[:-1], m.n_heads, hd)
        return q, qkv[..., group, :], qkv[..., group + 1, :]

    def bias(self, name: str, shape: tuple[int, int]) -> Array:
        """A projection's bias [heads or kv_heads, head_dim], split as its output is."""
        axes = ("heads" if name == "q_bias" else "kv_heads", "head_dim")
        value = self.param(name, nn.with_logical_partitioning(nn.initializers.zeros, axes), shape,
                           self.policy.param_dtype)
        return value.astype(self.policy.compute_dtype)

    def cache_variables(self, k: Array, positions: Array):
        """(keys, values, their positions, next free slot): kv_heads wide, not heads (GQA)."""
        key = self.variable(CACHE, "key", jnp.zeros, k.shape, k.dtype)
        value = self.variable(CACHE, "value", jnp.zeros, k.shape, k.dtype)
        pos = self.variable(CACHE, "positions", lambda: jnp.full(positions.shape, -1, jnp.int32))
        index = self.variable(CACHE, "index", lambda: jnp.zeros((), jnp.int32))
        return key, value, pos, index

    def cached_attention(self, q: Array, k: Array, v: Array, positions: Array, window: int | Array = 0,
                         sinks: Array | None = None) -> Array:
        """Writes this call's keys/values at the cache's next slots, then attends over the cache.

        A negative position (left padding) is stored as such and never attended to."""
        key, value, pos, index = self.cache_variables(k, positions)
        start = index.value
        key.value = jax.lax.dynamic_update_slice(key.value, k.astype(key.value.dtype), (0, start, 0, 0))
        value.value = jax.lax.dynamic_update_slice(value.value, v.astype(value.value.dtype), (0, start, 0, 0))
        pos.value = jax.lax.dynamic_update_slice(pos.value, positions.astype(jnp.int32), (0, start))
        index.value = start + k.shape[1]
        mask = position_mask(positions, pos.value, window)
        return masked_attention(q, key.value, value.value, mask, self.policy.dot_general, sinks)
