"""One GRPO step's samples, from prompts to a training batch: sample on the device, score on the
host, advantages per group, rows laid out for the train step.

Rows: prompt p's grpo.group_size completions are rows p*G .. p*G + G - 1. A row holds its prompt
(unpadded) then its completion, right-padded to the step's row length (the bucket of its longest
row, data/buckets.py: at most train.seq_len): inputs are the sequence, targets
the sequence one token on, weights 1 on the targets that are completion tokens (through the
end-of-turn token where the completion reached it: training to stop is part of the policy).
Positions count from 0 and segment ids are 1 on tokens, 0 on padding, as packed rows have them.
A completion cut at grpo.max_new_tokens is trained on as far as it went.

Advantages: a row's total reward minus its group's mean, divided (grpo.scale_rewards) by the
group's standard deviation plus 1e-4, the unbiased (n - 1) deviation as TRL computes it with
torch's std. A group whose rewards are all equal has advantage 0 everywhere: it teaches nothing,
and the fraction of such groups is logged (grpo_zero_signal) because it says when the task is too
hard or too easy for the policy.

This is the step's one host sync: rewards are Python functions of decoded text, so the
completions come to the host (all rows to every process) and the batch goes back; its cost is in
the logged grpo_sampling_s and grpo_scoring_s.
"""

from __future__ import annotations

import time
from typing import NamedTuple

import jax
import numpy as np

from maxtext_rocm.data.buckets import bucket_of
from maxtext_rocm.data.prompts import Prompt
from maxtext_rocm.finetune.grpo import rewards as rewards_lib
from maxtext_rocm.finetune.grpo.objective import ADVANTAGES
from maxtext_rocm.models.decoding import left_pad


class Completions(NamedTuple):
    tokens: list[np.ndarray]  # per row: the sampled ids through the first stop id (or all max_new)
    stopped: np.ndarray  # bool per row: it reached a stop id


def left_padded(prompts: list[Prompt], group_size: int, length: int) -> tuple[np.ndarray, np.ndarray]:
    """(tokens, positions) [prompts x group_size, length]: each prompt repeated for its group, laid
    out as generate lays out prompts (aligned to the right, padding at position -1)."""
    return left_pad([prompt.tokens for prompt in prompts for _ in range(group_size)], pad_to=length)


def completions(sampled: np.ndarray, stop_ids: tuple[int, ...]) -> Completions:
    """Each row of `sampled` [rows, max_new] cut after its first stop id."""
    rows, stopped = [], np.zeros(len(sampled), bool)
    for row, ids in enumerate(sampled):
        hits = np.flatnonzero(np.isin(ids, stop_ids)) if stop_ids else []
        stopped[row] = len(hits) > 0
        rows.append(ids[:hits[0] + 1] if len(hits) else ids)
    return Completions(rows, stopped)


def group_advantages(totals: np.ndarray, group_size: int, scale: bool) -> np.ndarray:
    """[rows] fp32 advantages from the rows' total rewards (see the module's doc)."""
    groups = totals.reshape(-1, group_size).astype(np.float64)
    centred = groups - groups.mean(axis=1, keepdims=True)
    if scale:
        centred = centred / (groups.std(axis=1, ddof=1, keepdims=True) + 1e-4)
    return centred.reshape(-1).astype(np.float32)


def longest_row(prompts: list[Prompt], done: Completions, group_size: int) -> int:
    """The positions the longest row needs: its prompt and completion, less the last token (which
    is a target only)."""
    return max(len(prompts[row // group_size].tokens) + len(tokens) - 1 for row, tokens in enumerate(done.tokens))


def training_rows(prompts: list[Prompt], done: Completions, advantages: np.ndarray, group_size: int,
                  seq_len: int) -> dict[str, np.ndarray]:
    """The train step's batch, every row (see the module's doc for the layout), `seq_len` positions
    a row."""
    rows = len(done.tokens)
    batch = {name: np.zeros((rows, seq_len), np.int32) for name in ("inputs", "targets", "positions", "segment_ids")}
    batch["weights"] = np.zeros((rows, seq_len), np.float32)
    batch[ADVANTAGES] = np.zeros((rows, seq_len), np.float32)
    for row, completion in enumerate(done.tokens):
        prompt = prompts[row // group_size].tokens
        sequence = np.concatenate([prompt, completion]).astype(np.int32)
        n = min(len(sequence), seq_len)
        batch["inputs"][row, :n] = sequence[:n]
        batch["targets"][row, :len(sequence) - 1] = sequence[1:seq_len + 1]
        batch["positions"][row, :n] = np.arange(n)
        batch["segment_ids"][row, :n] = 1
        # Target t is token t + 1: completion tokens are targets len(prompt) - 1 onwards.
        batch["weights"][row, len(prompt) - 1:len(sequence) - 1] = 1.0
        batch[ADVANTAGES][row, :n] = advantages[row]
    return batch


class Scored(NamedTuple):
    batch: dict[str, np.ndarray]  # every row, host arrays
    metrics: dict[str, float]


def score_and_lay_out(prompts: list[Prompt], sampled: np.ndarray, tokenizer, rewards, grpo_cfg, seq_len: int,
                      stop_ids: tuple[int, ...], buckets: tuple[int, ...] | None = None) -> Scored:
    """Rewards, advantages and the batch of one step from its completions `sampled` [rows, max_new];
    `buckets`: the row lengths data.buckets gives (data/buckets.py row_buckets; default its 'auto')."""
    g = grpo_cfg.group_size
    done = completions(sampled, stop_ids)
    started = time.perf_counter()
    table = np.zeros((len(done.tokens), len(rewards)), np.float64)
    for row, ids in enumerate(done.tokens):
        text = tokenizer.decode(ids[:-1] if done.stopped[row] else ids)
        prompt = prompts[row // g]
        for column, reward in enumerate(rewards):
            table[row, column] = rewards_lib.score(reward, prompt.record, prompt.where, text)
    totals = table @ np.asarray([r.weight for r in rewards], np.float64)
    advantages = group_advantages(totals, g, grpo_cfg.scale_rewards)
    lengths = np.asarray([len(ids) for ids in done.tokens], np.float64)
    groups = totals.reshape(-1, g)
    metrics = {"grpo_reward": float(totals.mean()), "grpo_reward_std": float(totals.std()),
               "grpo_zero_signal": float(np.mean(np.all(groups == groups[:, :1], axis=1))),
               "grpo_completion_length": float(lengths.mean()), "grpo_completion_length_max": float(lengths.max()),
               "grpo_truncated": float(np.mean(~done.stopped)),
               "grpo_scoring_s": time.perf_counter() - started}
    for column, reward in enumerate(rewards):
        metrics[f"grpo_reward/{reward.name}"] = float(table[:, column].mean())
        metrics[f"grpo_reward_std/{reward.name}"] = float(table[:, column].std())
    # The rows' length: the bucket of the longest (data/buckets.py), not train.seq_len.
    length = bucket_of(longest_row(prompts, done, g), seq_len, buckets)
    return Scored(training_rows(prompts, done, advantages, g, length), metrics)


def gathered(array: jax.Array) -> np.ndarray:
    """A global array whole on this host: all rows to every process (the rewards need them all)."""
    if jax.process_count() == 1:
        return np.asarray(jax.device_get(array))
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(array, tiled=True))
