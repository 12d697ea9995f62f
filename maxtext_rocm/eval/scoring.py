"""Log-likelihoods of token continuations on the run's own forward pass, in a few fixed shapes.

lm-eval asks for thousands of (context, continuation) scores of every length. Each batch here is
`batch_size` rows padded on the right to one of a few bucket lengths (powers of two from 16 up to
the model's window), so a task compiles one program per bucket it touches, not one per request.
Right padding changes nothing before it (attention is causal), and padded rows are never read.

Only two numbers per row leave the device: the summed log-probability of the scored tokens and
whether each of them was the argmax (lm-eval's `is_greedy`), never the [batch, seq, vocab] logits.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Sequence

import flax.core
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from flax import linen as nn

from maxtext_rocm.models.decoding import decoding_model_cfg
from maxtext_rocm.models import build_model
from maxtext_rocm.numerics.precision import policy_from_config
from maxtext_rocm.resolve import resolve_here

SHORTEST_BUCKET = 16


@dataclass(frozen=True)
class ScoredRow:
    """`tokens` (context + continuation, at most window + 1 of them) of which the last `n_scored`
    are scored, each given the tokens before it."""
    tokens: Sequence[int]
    n_scored: int


@dataclass(frozen=True)
class Score:
    logprob: float  # the sum over the scored tokens of log p(token | the tokens before it)
    greedy: bool  # every scored token was the model's most likely next token


def bucket_lengths(window: int) -> list[int]:
    """The padded input lengths: powers of two from SHORTEST_BUCKET, then `window` itself."""
    lengths, length = [], SHORTEST_BUCKET
    while length < window:
        lengths.append(length)
        length *= 2
    return lengths + [window]


def bucket_for(length: int, window: int) -> int:
    return next(b for b in bucket_lengths(window) if b >= length)


@functools.lru_cache(maxsize=16)
def _scoring_program(model_cfg: ml_collections.FrozenConfigDict, policy):
    model = build_model(model_cfg, policy)
    others = flax.core.DenyList("params")  # fp8 state and router losses start fresh and are dropped

    def score(params, inputs, targets, scored):
        logits = model.apply({"params": params}, inputs, mutable=others)[0].astype(jnp.float32)
        logprobs = jax.nn.log_softmax(logits, axis=-1)
        picked = jnp.take_along_axis(logprobs, targets[..., None], axis=-1)[..., 0]
        greedy = jnp.argmax(logits, axis=-1) == targets
        return jnp.sum(jnp.where(scored, picked, 0.0), axis=1), jnp.all(greedy | ~scored, axis=1)

    return jax.jit(score)


class Scorer:
    """Scores ScoredRows with `params` of `cfg`'s model, `batch_size` rows per call of the device,
    inputs at most `window` tokens long."""

    def __init__(self, cfg, params, batch_size: int, window: int):
        params = nn.meta.unbox(params)
        self.params = params["params"] if set(params) == {"params"} else params
        self.cfg, self.batch_size, self.window = cfg, batch_size, window
        self.shapes_run: set[tuple[int, int]] = set()  # (rows, length) of each program compiled

    def _program(self, length: int):
        cfg = resolve_here(self.cfg, seq_len=length)
        # A mixture of experts must not drop tokens by capacity: a row's score would depend on its batch.
        return _scoring_program(decoding_model_cfg(cfg.model), policy_from_config(cfg.precision))

    def __call__(self, rows: Sequence[ScoredRow]) -> list[Score]:
        """Scores in the order of `rows`; rows of one call are batched longest first."""
        order = sorted(range(len(rows)), key=lambda i: -len(rows[i].tokens))
        scores: list[Score | None] = [None] * len(rows)
        for start in range(0, len(order), self.batch_size):
            chunk = [rows[i] for i in order[start:start + self.batch_size]]
            for i, score in zip(order[start:start + self.batch_size], self._score_batch(chunk)):
                scores[i] = score
        return scores

    def _score_batch(self, rows: Sequence[ScoredRow]) -> list[Score]:
        length = bucket_for(max(len(r.tokens) - 1 for r in rows), self.window)
        inputs = np.zeros((self.batch_size, length), np.int32)
        targets = np.zeros((self.batch_size, length), np.int32)
        scored = np.zeros((self.batch_size, length), bool)
        for i, row in enumerate(rows):
            tokens = np.asarray(row.tokens, np.int32)
            n = len(tokens) - 1
            if not 1 <= row.n_scored <= n or n > self.window:
                raise ValueError(f"a row of {len(tokens)} tokens cannot score its last {row.n_scored} "
                                 f"within a window of {self.window}")
            inputs[i, :n], targets[i, :n] = tokens[:-1], tokens[1:]
            scored[i, n - row.n_scored:n] = True
        self.shapes_run.add((self.batch_size, length))
        logprob, greedy = jax.device_get(self._program(length)(self.params, inputs, targets, scored))
        return [Score(float(logprob[i]), bool(greedy[i])) for i in range(len(rows))]
