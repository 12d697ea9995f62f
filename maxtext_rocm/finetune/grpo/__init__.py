"""Group Relative Policy Optimization (Shao et al., 2024, DeepSeekMath), train.objective="grpo".

Each step samples grpo.group_size completions of each of its prompts from the current policy
(sampler.py: one compiled program on the run's mesh), scores them with the reward functions on
the host (rewards.py), makes each completion's advantage its reward against its group's
(rollout.py), and takes grpo.updates_per_batch optimizer updates of the clipped surrogate
objective over that batch (objective.py, step.py). Prompts come from data.format="prompt" records
(prompts.py). docs/grpo.md is the user's page.
"""
