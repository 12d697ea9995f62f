"""GRPO's sampler: the run's own policy continuing a batch of prompts on the training mesh, in one
compiled program (generate.py's prefill + decode loop, a `lax.while_loop` on the device: no Python
per token), with the parameters where training keeps them (sharded as the state is, no copy).

A LoRA run samples with its adapters applied to the frozen base; an fp8 run with the train
state's fp8 scales. The prompts arrive left-padded to one length (train.seq_len less
grpo.max_new_tokens), padding at position -1, so every step runs the same program.
"""

from __future__ import annotations

import jax
import numpy as np

from maxtext_rocm.finetune import lora
from maxtext_rocm.models.decoding import decode_loop, decoding_model_cfg
from maxtext_rocm.models import build_model
from maxtext_rocm.numerics.fp8 import FP8_COLLECTION
from maxtext_rocm.parallel import sharding


def prompt_length(cfg) -> int:
    """The longest prompt a row takes: what train.seq_len leaves after grpo.max_new_tokens."""
    return cfg.train.seq_len - cfg.grpo.max_new_tokens


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

        def sample(params, frozen, fp8_state, tokens, positions, key):
            variables = lora.model_variables(params, frozen)
            if fp8_state:
                variables[FP8_COLLECTION] = fp8_state
            return run(variables, tokens, positions, key)

        self._jitted = jax.jit(
            sample, in_shardings=(state_sharding.params, getattr(state_sharding, "frozen", {}), state_sharding.fp8,
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
