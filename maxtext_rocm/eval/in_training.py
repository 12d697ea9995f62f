"""lm-evaluation-harness during training: `eval.harness_tasks` scored every `eval.harness_every`
steps on the live parameters, its scores written beside `eval_loss` (metrics.jsonl, TensorBoard,
W&B) as `harness/<task>/<metric>`.

    python -m maxtext_rocm.train configs/tiny_llama.py --config.eval.harness_tasks=tiny_choice,tiny_gen \\
        --config.eval.harness_every=100 --config.eval.harness_include_path=tasks/

The trainer runs it as a periodic hook (trainer/hooks.py): it sits below this package, so the
command line builds the hook (`harness_hooks(cfg)`) and hands it in, and a notebook does the same:
`Trainer(cfg, hooks=harness_hooks(cfg))`. Everything the harness can refuse (lm-eval missing, an
unknown task, an include path without task files) is refused here, before the Trainer is built.

The model is eval/model.py's, over the parameters where the Trainer keeps them (its mesh, its
precision policy, a LoRA run's adapters applied to the frozen base inside the dots): nothing is
copied to the host or merged, and nothing the step reads is changed. lm-eval seeds Python's and
numpy's global generators; their states are put back after each evaluation, so the training run
is the run without the harness, bit for bit.
"""

from __future__ import annotations

import contextlib
import logging
import random
import time

import numpy as np

from maxtext_rocm.errors import UserError
from maxtext_rocm.eval.tasks import CONFIG, not_installed, task_manager
from maxtext_rocm.trainer.hooks import HookReport, LiveModel

PREFIX = "harness"


def harness_hooks(cfg) -> list["HarnessHook"]:
    """The hooks `cfg.eval` asks for: none, or the harness with its tasks found (UserError otherwise)."""
    e = cfg.eval
    if not e.harness_tasks:
        return []
    try:
        import lm_eval  # noqa: F401
    except ImportError:
        raise UserError(not_installed(f"eval.harness_tasks={','.join(e.harness_tasks)!r}")) from None
    tasks = [t.strip() for t in e.harness_tasks]
    return [HarnessHook(e, tasks, task_manager(e.harness_include_path or None, tasks, CONFIG))]


class HarnessHook:
    """lm-eval's `simple_evaluate` of `tasks` on the live model, at every multiple of harness_every."""

    name = CONFIG.tasks

    def __init__(self, eval_cfg, tasks: list[str], manager):
        self.every, self.tasks, self.manager = int(eval_cfg.harness_every), tasks, manager
        limit = float(eval_cfg.harness_limit)
        self.limit = None if limit == 0 else limit if limit < 1 else int(limit)
        self.batch_size = int(eval_cfg.harness_batch_size)

    def due(self, step: int) -> bool:
        return step % self.every == 0

    def run(self, step: int, live: LiveModel) -> HookReport:
        import lm_eval

        from maxtext_rocm.eval.model import MaxTextLM

        started = time.perf_counter()
        with live.rules(), _global_generators_kept(), _lm_eval_quiet():
            model = MaxTextLM(params=live.variables, cfg=live.cfg, policy=live.policy, mesh=live.mesh,
                              batch_size=self.batch_size, seed=int(live.cfg.train.seed), progress=False)
            results = lm_eval.simple_evaluate(
                model=model, tasks=list(self.tasks), limit=self.limit, task_manager=self.manager,
                log_samples=False, bootstrap_iters=0, random_seed=0, numpy_random_seed=0, torch_random_seed=None,
                fewshot_random_seed=0)
        metrics = scores(results)
        seconds = time.perf_counter() - started
        said = ", ".join(f"{name.split('/', 1)[1]} {value:.4f}" for name, value in metrics.items())
        return HookReport({**metrics, f"{PREFIX}_s": seconds}, f"harness {said} ({seconds:.1f} s)")


def scores(results: dict) -> dict[str, float]:
    """lm-eval's results as flat metrics: `harness/<task>/<metric>` for its "<metric>,none" values
    (`harness/<task>/<metric>/<filter>` for other filters); standard errors and counts left out."""
    out = {}
    for task, values in results["results"].items():
        for key, value in values.items():
            if "," not in key or "_stderr" in key or isinstance(value, str) or value is None:
                continue
            metric, filter_name = key.split(",", 1)
            out[f"{PREFIX}/{task}/{metric}" + ("" if filter_name == "none" else f"/{filter_name}")] = float(value)
    return out


@contextlib.contextmanager
def _global_generators_kept():
    """Python's and numpy's global random states as they were (lm-eval seeds both)."""
    python_state, numpy_state = random.getstate(), np.random.get_state()
    try:
        yield
    finally:
        random.setstate(python_state)
        np.random.set_state(numpy_state)


@contextlib.contextmanager
def _lm_eval_quiet():
    """lm-eval's INFO lines (its seeds, each task's request counts) stay out of the training log;
    its warnings still come through."""
    logger = logging.getLogger("lm_eval")
    level = logger.level
    logger.setLevel(max(level, logging.WARNING))
    try:
        yield
    finally:
        logger.setLevel(level)
