"""Log-likelihoods of token continuations on the run's own forward pass, in a few fixed shapes.

lm-eval asks for thousands of (context, continuation) scores of every length. Each batch here is
`batch_size` rows padded on the right to one of a few bucket lengths (powers of two from 16 up to
the model's window), so a task compiles one program per bucket it touches, not one per request.
Right padding changes nothing before it (attention is causal), and padded rows are never read.

Only two numbers per row leave the device: the summed log-probability of the scored tokens and
whether each of them was the argmax (lm-eval's `is_greedy`), never the [batch, seq, vocab] logits.

The parameters are used where they lie: a saved run's as `load_params` placed them, a training
run's as its mesh holds them (with `mesh`, the rows are split over its batch axes as a training
batch's are, and the model's sharding constraints resolve against its rules), a LoRA run's as its
frozen base and adapters, the adapters applied inside the dots as the train step applies them.
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
from maxtext_rocm.parallel import sharding
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


def model_variables(params) -> dict:
    """A params tree, or a model's variables ({"params": ..., and a LoRA run's "adapters", an fp8
    run's scales}), as the variables the model applies with (boxes removed)."""
    params = nn.meta.unbox(params)
    return dict(params) if "params" in params else {"params": params}


@functools.lru_cache(maxsize=16)
def _scoring_program(model_cfg: ml_collections.FrozenConfigDict, policy):
    model = build_model(model_cfg, policy)
    # The fp8 state and router losses it updates are dropped (a run's own are only read).
    others = flax.core.DenyList("params")

    def score(variables, inputs, targets, scored):
        logits = model.apply(variables, inputs, mutable=others)[0].astype(jnp.float32)
        logprobs = jax.nn.log_softmax(logits, axis=-1)
        picked = jnp.take_along_axis(logprobs, targets[..., None], axis=-1)[..., 0]
        greedy = jnp.argmax(logits, axis=-1) == targets
        return jnp.sum(jnp.where(scored, picked, 0.0), axis=1), jnp.all(greedy | ~scored, axis=1)

    return jax.jit(score)


class Scorer:
    """Scores ScoredRows with `params` of `cfg`'s model (a params tree or model_variables'),
    `batch_size` rows per call of the device, inputs at most `window` tokens long. `policy`: the
    precision policy to apply the model with (default cfg.precision's); `mesh`: the mesh `params`
    lie on, whose batch axes split the rows (the batch is rounded up to a multiple of them)."""

    def __init__(self, cfg, params, batch_size: int, window: int, policy=None, mesh=None):
        self.variables = model_variables(params)
        self.cfg, self.window, self.policy, self.mesh = cfg, window, policy, mesh
        self.rows_sharding = None if mesh is None else row_sharding(mesh)
        shards = 1 if mesh is None else batch_shards(mesh)
        self.batch_size = -(-batch_size // shards) * shards
        self.shapes_run: set[tuple[int, int]] = set()  # (rows, length) of each program compiled

    def _program(self, length: int):
        cfg = resolve_here(self.cfg, seq_len=length)
        policy = self.policy if self.policy is not None else policy_from_config(cfg.precision)
        # A mixture of experts must not drop tokens by capacity: a row's score would depend on its batch.
        return _scoring_program(decoding_model_cfg(cfg.model), policy)

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
        program = self._program(length)
        if self.mesh is None:
            out = program(self.variables, inputs, targets, scored)
        else:
            with sharding.rules_context(self.mesh):  # every process holds the rows: each places its own
                placed = [jax.make_array_from_callback(a.shape, self.rows_sharding, lambda index, a=a: a[index])
                          for a in (inputs, targets, scored)]
                out = program(self.variables, *placed)
        logprob, greedy = (np.asarray(x) for x in jax.device_get(replicated_on_host(out)))
        return [Score(float(logprob[i]), bool(greedy[i])) for i in range(len(rows))]


def row_sharding(mesh) -> jax.sharding.NamedSharding:
    """Rows over the mesh's batch axes, as a training batch's (its tokens stay whole: scoring runs
    the plain model, without a context-parallel attention)."""
    return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(sharding.batch_sharding(mesh).spec[0]))


def batch_shards(mesh) -> int:
    axes = sharding.batch_sharding(mesh).spec[0]
    axes = () if axes is None else (axes,) if isinstance(axes, str) else tuple(axes)
    return int(np.prod([mesh.shape[a] for a in axes]))


def replicated_on_host(tree):
    """Arrays every process can read whole: the per-row scores are [batch] floats, gathered once."""
    from jax.experimental import multihost_utils

    if jax.process_count() == 1:
        return tree
    return multihost_utils.process_allgather(tree, tiled=True)
