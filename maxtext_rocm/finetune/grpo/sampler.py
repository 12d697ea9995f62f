"""GRPO's sampler: the run's own policy continuing a batch of prompts on the training mesh, in one
compiled program (models/decoding.py's prefill + decode loop, a `lax.while_loop` on the device: no
Python per token), from the parameters where training keeps them.

Decoding reads every weight at every token. Laid out as training keeps them (sharded over fsdp)
that is an all-gather of every layer per token; so by default (grpo.sampler_weights="gathered")
the program first gathers the weights over fsdp and data, once per step, into a copy per device in
the compute dtype (2 bytes per parameter under bf16, divided by tensor and expert parallelism),
freed when sampling ends. "training" decodes from the training layout instead: no copy, a gather
per layer per token.

A LoRA run samples with its adapters applied to the frozen base; an fp8 run with the train
state's fp8 scales. The prompts arrive left-padded to one length (train.seq_len less
grpo.max_new_tokens), padding at position -1, so every step runs the same program.
"""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from maxtext_rocm.finetune import lora
from maxtext_rocm.models.decoding import decode_loop, decoding_model_cfg
from maxtext_rocm.models import build_model
from maxtext_rocm.numerics.fp8 import FP8_COLLECTION
from maxtext_rocm.parallel import sharding


def prompt_length(cfg) -> int:
    """The longest prompt a row takes: what train.seq_len leaves after grpo.max_new_tokens."""
    return cfg.train.seq_len - cfg.grpo.max_new_tokens


# Mesh axes that shard parameters only to save memory (ZeRO-3 style), which decoding would otherwise
# all-gather at every token; tensor and expert parallelism split the work itself and stay.
_GATHERED_AXES = ("data", "fsdp")
# The weights every layer casts to the compute dtype before its dot (models/layers.py Dense and
# Embed, models/moe.py's experts); the router computes in fp32 and is left as it is, as are norm
# scales and biases.
_CAST_IN_THE_DOT = ("kernel", "embedding", "gate", "up", "down")


def gathered_layout(shardings, mesh, policy):
    """tree -> the same tree laid out without its fsdp and data sharding, its matmul weights in
    the compute dtype: grpo.sampler_weights="gathered". Inside the sampler's program the constraint
    sits before the decode loop, so XLA gathers each weight once per step instead of once per
    token, and in half the bytes of fp32 masters. Each cast weight is one its layer casts before
    its dot anyway, so every dot sees the values it sees from the training layout (tests/test_grpo.py
    holds the two layouts' samples equal); under an fp8 policy nothing is cast (its dots quantize
    from the masters)."""
    def without_gathered_axes(sharding):
        kept = []
        for entry in sharding.spec:
            axes = tuple(a for a in (entry if isinstance(entry, tuple) else (entry,)) if a and a not in _GATHERED_AXES)
            kept.append(axes or None)
        return NamedSharding(mesh, PartitionSpec(*kept))

    targets = jax.tree_util.tree_map(without_gathered_axes, shardings)

    def one(path, x, target):
        names = [k.key for k in path if isinstance(k, jax.tree_util.DictKey)]
        if not policy.fp8_format and names[-1] in _CAST_IN_THE_DOT and "router" not in names:
            x = x.astype(policy.compute_dtype)
        return jax.lax.with_sharding_constraint(x, target)

    return lambda tree: jax.tree_util.tree_map_with_path(one, tree, targets) if tree else tree


class Sampler:
    """`sampler(state, tokens, positions, key)` -> (completions [rows, max_new], steps, their
    log-probabilities), device arrays sharded over the batch like a training batch."""

    def __init__(self, cfg, policy, mesh, state_sharding, rows: int, stop_ids: tuple[int, ...]):
        g = cfg.grpo
        model = build_model(decoding_model_cfg(cfg.model), policy, decode=True)
        vocab = cfg.model.vocab_size
        run = decode_loop(model, rows, prompt_length(cfg), g.max_new_tokens, float(g.temperature),
                          int(min(g.top_k, vocab)), float(g.top_p), tuple(stop_ids))
        self.mesh = mesh
        rows_sharding = sharding.batch_sharding(mesh)

        frozen_sharding = getattr(state_sharding, "frozen", {})
        if g.sampler_weights == "gathered":  # a LoRA run's adapters are small: only its base is worth it
            gather_params = gathered_layout(state_sharding.params, mesh, policy) if not frozen_sharding else None
            gather_frozen = gathered_layout(frozen_sharding, mesh, policy) if frozen_sharding else None
        else:
            gather_params = gather_frozen = None

        def sample(params, frozen, fp8_state, tokens, positions, key):
            if gather_params is not None:
                params = gather_params(params)
            if gather_frozen is not None:
                frozen = gather_frozen(frozen)
            variables = lora.model_variables(params, frozen)
            if fp8_state:
                variables[FP8_COLLECTION] = fp8_state
            return run(variables, tokens, positions, key)

        self._jitted = jax.jit(
            sample, in_shardings=(state_sharding.params, frozen_sharding, state_sharding.fp8,
                                  rows_sharding, rows_sharding, sharding.replicated(mesh)),
            out_shardings=(rows_sharding, sharding.replicated(mesh), rows_sharding))
        self._rows_sharding = rows_sharding

    def __call__(self, state, tokens: np.ndarray, positions: np.ndarray, key):
        """Samples from host arrays `tokens`, `positions` [rows, prompt length] that every process
        holds whole (each places the rows its devices hold)."""
        with sharding.rules_context(self.mesh):
            placed = [jax.make_array_from_callback(a.shape, self._rows_sharding, lambda index, a=a: a[index])
                      for a in (tokens, positions)]
            return self._jitted(state.params, getattr(state, "frozen", {}), state.fp8, *placed, key)
