"""Periodic hooks: work that a layer above the trainer does on the live model every few steps.

The trainer cannot import what sits above it (lm-evaluation-harness's model lives in eval/, which
builds on generate and api), so the work comes to it: `Trainer(cfg, hooks=[...])` takes objects
with `due(step)` and `run(step, live) -> HookReport`, and its loop calls each one that is due after
the step, its time left out of the step time like an evaluation's, its metrics written as a row of
that step. The command line (maxtext_rocm/train.py, above both) builds them from the config
(eval/in_training.py: `eval.harness_*`).

A hook reads the state; it never changes it. It gets the live parameters as the devices hold them
(a LoRA run's frozen base and adapters, applied inside the dots as the step applies them; no merged
copy, nothing copied to the host) and runs collectives only as a function of the step, so every
process runs it at the same steps.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Protocol, Sequence

from maxtext_rocm.errors import UserError
from maxtext_rocm.finetune import lora


@dataclass(frozen=True)
class LiveModel:
    """The model as the Trainer holds it between steps."""
    cfg: Any  # the run's resolved config
    policy: Any  # the run's precision policy (a LoRA run's applies the "adapters" collection)
    mesh: Any
    variables: dict  # {"params": ...} in model order; a LoRA run's adds "adapters", an fp8 run "fp8"
    rules: Callable[[], Any]  # the mesh and logical-axis rules, a context to trace the model's programs in


@dataclass(frozen=True)
class HookReport:
    """What a hook's run gives back: `metrics` for metrics.jsonl, TensorBoard and W&B (a row of the
    step), `line` for the log (empty: nothing said)."""
    metrics: dict[str, float] = field(default_factory=dict)
    line: str = ""


class PeriodicHook(Protocol):
    name: str  # says which config group asks for it (the harness: "eval.harness_tasks")

    def due(self, step: int) -> bool: ...

    def run(self, step: int, live: LiveModel) -> HookReport: ...


def live_model(trainer) -> LiveModel:
    """The Trainer's state as a hook sees it: the parameters in model order, a LoRA run's frozen
    base beside its adapters, and the fp8 scales the step keeps (where the layer order is the
    model's: a pipeline's fp8 state stays out)."""
    state = trainer.state
    variables = lora.model_variables(trainer.params_in_model_order(), getattr(state, "frozen", {}))
    if state.fp8 and trainer.storage_order is None:
        from maxtext_rocm.numerics.fp8 import FP8_COLLECTION

        variables[FP8_COLLECTION] = state.fp8
    return LiveModel(trainer.cfg, trainer.policy, trainer.mesh, variables, trainer.sharding_rules)


def check_hooks(cfg, hooks: Sequence[PeriodicHook]) -> None:
    """A config that asks for a hook nobody handed the Trainer is one sentence, not a silent skip
    (a notebook's `Trainer(cfg)` with eval.harness_tasks set)."""
    if cfg.eval.harness_tasks and not any(getattr(h, "name", "") == "eval.harness_tasks" for h in hooks):
        raise UserError(f"eval.harness_tasks={','.join(cfg.eval.harness_tasks)!r} needs the harness hook, which "
                        "`python -m maxtext_rocm.train` builds; from Python pass "
                        "Trainer(cfg, hooks=maxtext_rocm.eval.in_training.harness_hooks(cfg))")
