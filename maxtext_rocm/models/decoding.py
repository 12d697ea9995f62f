"""Decoding with a KV cache, as pure functions of a model built with decode=True: the sampling
rule, and the prefill + decode loop (a `lax.while_loop` on the device) that generate.py jits for
one device and GRPO's sampler (finetune/grpo/sampler.py) for a training mesh. Padding of
left-aligned prompts gets position -1, which attention never attends to (models/attention.py).
"""

from __future__ import annotations

import flax.core
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from maxtext_rocm.models.attention import CACHE


def sample(logits, key, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0):
    """Next tokens [batch] from logits [batch, vocab]: the argmax at temperature 0; otherwise a
    draw from softmax(logits / temperature) restricted to the top_k most likely tokens (0: all)
    and to the smallest set of them whose probability reaches top_p (1.0: all)."""
    if temperature == 0:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    logits = logits.astype(jnp.float32) / temperature
    if top_k:
        kth = jax.lax.top_k(logits, top_k)[0][:, -1:]
        logits = jnp.where(logits < kth, -jnp.inf, logits)
    if top_p < 1.0:
        ordered = jnp.sort(logits, axis=-1)[:, ::-1]
        probs = jax.nn.softmax(ordered, axis=-1)
        before = jnp.cumsum(probs, axis=-1) - probs  # the mass of the tokens more likely than each
        threshold = jnp.min(jnp.where(before < top_p, ordered, jnp.inf), axis=-1, keepdims=True)
        logits = jnp.where(logits < threshold, -jnp.inf, logits)
    return jax.random.categorical(key, logits).astype(jnp.int32)


def decoding_model_cfg(model_cfg) -> ml_collections.FrozenConfigDict:
    """The model config for decoding: a mixture of experts that never drops a token ("capacity"
    would drop where a decode step's few tokens crowd one expert)."""
    m = ml_collections.ConfigDict(model_cfg)
    if m.n_experts > 1 and m.moe_impl == "capacity":
        m.moe_impl = "dense" if jax.default_backend() == "cpu" else "dropless"
    return ml_collections.FrozenConfigDict(m)


def decode_loop(model, batch: int, prompt_len: int, max_new: int, temperature: float, top_k: int, top_p: float,
                stop_ids: tuple[int, ...]):
    """The prefill + decode loop of one shape and one sampling setting, to be jitted:
    run(variables, tokens, positions, key) -> (new tokens [batch, max_new], the steps taken, each
    new token's log-probability [batch, max_new] fp32 under the model at temperature 1).
    `variables`: the model's variables but its cache ({"params": ...}, plus LoRA's adapters and
    an fp8 state where the model has them); `model` is built with decode=True. GRPO's sampler
    (finetune/grpo/sampler.py) runs this same loop on a training mesh."""
    stops = jnp.asarray(stop_ids or (-1,), jnp.int32)
    others = flax.core.DenyList("params")  # the cache, plus fp8 state / router losses (dropped)

    def step(variables, cache, tokens, positions):
        logits, updated = model.apply({**variables, CACHE: cache}, tokens, positions, mutable=others)
        return logits[:, -1], updated[CACHE]

    def draw(logits, key):
        token = sample(logits, key, temperature, top_k, top_p)
        log_probs = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
        return token, jnp.take_along_axis(log_probs, token[:, None], axis=-1)[:, 0]

    def run(variables, tokens, positions, key):
        # `init` sizes the cache (positions -1: empty); XLA drops the parameter initialisation.
        cache = model.init(jax.random.key(0), jnp.zeros((batch, prompt_len + max_new), jnp.int32))[CACHE]
        logits, cache = step(variables, cache, tokens, positions)  # prefill
        next_position = jnp.max(positions, axis=1) + 1
        key, sub = jax.random.split(key)
        out = jnp.zeros((batch, max_new), jnp.int32)
        logps = jnp.zeros((batch, max_new), jnp.float32)

        def body(carry):  # the decode step: record the token, feed it, sample the next
            i, token, logp, cache, out, logps, done, key = carry
            out, logps = out.at[:, i].set(token), logps.at[:, i].set(logp)
            done = done | jnp.isin(token, stops)
            logits, cache = step(variables, cache, token[:, None], (next_position + i)[:, None])
            key, sub = jax.random.split(key)
            return (i + 1, *draw(logits, sub), cache, out, logps, done, key)

        def cond(carry):
            i, done = carry[0], carry[6]
            return (i < max_new) & ~jnp.all(done)

        carry = (jnp.int32(0), *draw(logits, sub), cache, out, logps, jnp.zeros((batch,), bool), key)
        steps, _, _, _, out, logps, _, _ = jax.lax.while_loop(cond, body, carry)
        return out, steps, logps

    return run


def left_pad(prompts, pad_to: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """(tokens, positions) [batch, max(longest, pad_to)]: prompts aligned to the right, padding at
    position -1."""
    longest = max(max(len(p) for p in prompts), pad_to)
    tokens = np.zeros((len(prompts), longest), np.int32)
    positions = np.full((len(prompts), longest), -1, np.int32)
    for row, prompt in enumerate(prompts):
        if len(prompt):
            tokens[row, longest - len(prompt):] = prompt
            positions[row, longest - len(prompt):] = np.arange(len(prompt))
    return tokens, positions
