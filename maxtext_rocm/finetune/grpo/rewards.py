"""GRPO's reward functions: `grpo.rewards` names each, `grpo.reward_weights` weighs them into one
total per completion.

A reward function takes the prompt's record (the JSON object of data.format="prompt", with every
field it has: "answer", test cases, ...) and the decoded completion (the text sampled after the
prompt, without the end-of-turn token), and returns a number. Either a built-in:

- `answer`: 1.0 when the completion's final answer equals the record's "answer" (both as
  strings, stripped), else 0.0. The final answer is what the last <answer>...</answer> holds, or
  else what follows the last "####" (GSM8K's convention), or else the whole completion.
- `format`: 1.0 when the whole completion, stripped, matches grpo.format_pattern (a Python
  regular expression, `.` matching newlines too), else 0.0.
- `length`: minus the completion's length in characters over 1,000 (a penalty on rambling;
  weigh it to taste);

or `module:function`, imported from the run's working directory (or anywhere on sys.path).

Rewards run on the host, on every process alike (each scores every completion, so a reward must
be deterministic: no process sees another's scores). A reward that raises, or returns something
that is not a finite number, stops the run with one sentence naming the function and the record.
"""

from __future__ import annotations

import importlib
import math
import numbers
import re
import sys
from pathlib import Path
from typing import Callable, NamedTuple

from maxtext_rocm.config.checks import check_reward_names, reward_weights
from maxtext_rocm.errors import ConfigError, UserError

RewardFunction = Callable[[dict, str], float]
_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


class RewardError(UserError):
    """A reward function that failed on a completion, or returned no finite number."""


def final_answer(completion: str) -> str:
    """The completion's final answer (see the module's doc for the rule)."""
    tagged = _ANSWER_TAG.findall(completion)
    if tagged:
        return tagged[-1].strip()
    if "####" in completion:
        return completion.rsplit("####", 1)[1].strip()
    return completion.strip()


def answer_reward(record: dict, completion: str) -> float:
    if "answer" not in record:
        raise KeyError("the record has no 'answer' field, which the built-in answer reward compares with")
    return float(final_answer(completion) == str(record["answer"]).strip())


def format_reward(pattern: str) -> RewardFunction:
    compiled = re.compile(pattern, re.DOTALL)

    def reward(record: dict, completion: str) -> float:
        return float(compiled.fullmatch(completion.strip()) is not None)
    return reward


def length_reward(record: dict, completion: str) -> float:
    return -len(completion) / 1000.0


class Reward(NamedTuple):
    name: str  # as grpo.rewards gives it
    function: RewardFunction
    weight: float


def _imported(name: str) -> RewardFunction:
    module_name, function_name = name.split(":")
    here = str(Path.cwd())
    if here not in sys.path:  # the run's working directory, as `python -m` puts it first for scripts
        sys.path.insert(0, here)
    try:
        module = importlib.import_module(module_name)
    except Exception as error:  # noqa: BLE001 - any failure to import is the user's to hear about
        raise ConfigError(f"grpo.rewards names {name!r}, but module {module_name!r} cannot be imported "
                          f"({type(error).__name__}: {error}); put {module_name}.py in the working directory "
                          "or on PYTHONPATH") from None
    function = getattr(module, function_name, None)
    if not callable(function):
        raise ConfigError(f"grpo.rewards names {name!r}, but module {module_name!r} ({module.__file__}) has no "
                          f"function {function_name!r}")
    return function


def check_records(grpo_cfg, prompts) -> None:
    """Before any device work: every record has the fields the built-in rewards read (`answer`'s
    "answer"), or a ConfigError naming the first that does not."""
    if "answer" not in tuple(grpo_cfg.rewards):
        return
    missing = next((p for p in prompts if "answer" not in p.record), None)
    if missing is not None:
        raise ConfigError(f"{missing.where} has no 'answer' field, which the built-in reward 'answer' compares the "
                          "completion's final answer with; give every record one, or drop 'answer' from grpo.rewards")


def load_rewards(grpo_cfg) -> tuple[Reward, ...]:
    """grpo.rewards as functions with their weights; a ConfigError for one that cannot be had."""
    check_reward_names(grpo_cfg)
    built_in = {"answer": answer_reward, "format": format_reward(grpo_cfg.format_pattern), "length": length_reward}
    return tuple(Reward(name, built_in[name] if name in built_in else _imported(name), weight)
                 for name, weight in zip(grpo_cfg.rewards, reward_weights(grpo_cfg)))


def score(reward: Reward, record: dict, where: str, completion: str) -> float:
    """One reward of one completion, or a RewardError naming the function and the record."""
    try:
        value = reward.function(record, completion)
    except Exception as error:  # noqa: BLE001 - a reward's failure stops the run in one sentence
        raise RewardError(f"reward {reward.name!r} raised {type(error).__name__}: {error} on the prompt of {where} "
                          f"(completion {completion[:80]!r}); fix the function or the record") from None
    if not isinstance(value, numbers.Real) or not math.isfinite(float(value)):
        raise RewardError(f"reward {reward.name!r} returned {value!r} for the prompt of {where}; a reward must "
                          "return a finite number")
    return float(value)
