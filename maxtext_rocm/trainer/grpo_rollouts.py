"""A GRPO run's data: at each step its prompts (data/prompts.py), sampled from the current policy
on the run's mesh (finetune/grpo/sampler.py), scored and laid out as a training batch
(finetune/grpo/rollout.py). The Trainer calls `batch(step, state)` where another run reads its data
source.

The sampler's key is train.seed's, folded with the step, and the prompts of a step depend on the
step alone, so a resumed run samples at each step what the uninterrupted one did (from the same
parameters) and needs no data position in its checkpoints.
"""

from __future__ import annotations

import time

import jax

from maxtext_rocm.data.buckets import row_buckets
from maxtext_rocm.data.prompts import load_prompts
from maxtext_rocm.data.tokenizer import load_tokenizer
from maxtext_rocm.finetune.grpo import rewards as rewards_lib
from maxtext_rocm.finetune.grpo.rollout import gathered, left_padded, score_and_lay_out
from maxtext_rocm.finetune.grpo.sampler import Sampler, prompt_length

_SAMPLER_STREAM = 0x6772706F  # folded into train.seed's key: the sampler's draws, apart from any other use


class Rollouts:
    """The prompts, the rewards and the compiled sampler of a GRPO run, and each step's batch."""

    def __init__(self, cfg, policy, mesh, state_sharding, global_batch: int, rows: tuple[int, int], to_device):
        self.cfg, self.to_device = cfg, to_device
        self.tokenizer = load_tokenizer(cfg.data.tokenizer)
        self.prompts = load_prompts(cfg.data, self.tokenizer, prompt_length(cfg))
        self.rewards = rewards_lib.load_rewards(cfg.grpo)
        self.sampler = Sampler(cfg, policy, mesh, state_sharding, global_batch, self.prompts.stop_ids)
        self.prompts_per_step = global_batch // cfg.grpo.group_size
        index, count = rows  # this process's block of the batch's rows (sharding.batch_rows_of_process)
        per_process = global_batch // count
        self.local_rows = slice(index * per_process, (index + 1) * per_process)
        self.key = jax.random.fold_in(jax.random.key(cfg.train.seed), _SAMPLER_STREAM)
        # The rows' lengths (data.buckets; 'none': every row train.seq_len long).
        self.buckets = row_buckets(cfg.data, cfg.train.seq_len) or (cfg.train.seq_len,)

    def describe(self) -> str:
        g = self.cfg.grpo
        rewards = ", ".join(f"{r.name} x {r.weight:g}" for r in self.rewards)
        return (f"{len(self.prompts.prompts)} prompts of {self.cfg.data.paths}, {self.prompts_per_step} a step, "
                f"{g.group_size} completions each (up to {g.max_new_tokens} tokens, temperature {g.temperature:g}); "
                f"rewards {rewards}")

    def batch(self, step: int, state) -> tuple[dict, dict]:
        """(the step's training batch as device arrays, its sampling metrics as host floats)."""
        g = self.cfg.grpo
        prompts = self.prompts.for_step(step, self.prompts_per_step)
        tokens, positions = left_padded(prompts, g.group_size, prompt_length(self.cfg))
        jax.block_until_ready(state.params)  # the previous step's updates: not the sampler's time
        started = time.perf_counter()
        sampled = gathered(self.sampler(state, tokens, positions, jax.random.fold_in(self.key, step))[0])
        sampling_s = time.perf_counter() - started
        scored = score_and_lay_out(prompts, sampled, self.tokenizer, self.rewards, g, self.cfg.train.seq_len,
                                   self.prompts.stop_ids, self.buckets)
        local = {name: rows[self.local_rows] for name, rows in scored.batch.items()}
        return self.to_device(local), dict(scored.metrics, grpo_sampling_s=sampling_s)
