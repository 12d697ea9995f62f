"""Finding lm-eval's tasks by name, with the checks that make a wrong name one sentence: for the
command line (`--tasks`, `--include_path`) and for the config (`eval.harness_tasks`,
`eval.harness_include_path`), which name the same things differently.

lm-eval indexes its ~10,000 built-in task files when asked (12 s on a 2-core machine); where every
named task is a plain task of the include path, that folder alone is indexed, which finds the same
tasks (lm-eval lets an include path's tasks override its own of the same name).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from maxtext_rocm.errors import UserError

INSTALL = "pip install -e '.[eval]'"


@dataclass(frozen=True)
class Names:
    """What the user calls the task list and the include path."""
    tasks: str
    include_path: str


COMMAND_LINE = Names("--tasks", "--include_path")
CONFIG = Names("eval.harness_tasks", "eval.harness_include_path")


def not_installed(what: str) -> str:
    return f"{what} needs lm-evaluation-harness, which is not installed; run {INSTALL}"


def task_manager(include_path: str | None, tasks: list[str], names: Names = COMMAND_LINE):
    """lm-eval's TaskManager that knows `tasks`, or UserError naming what is wrong."""
    from lm_eval.tasks import TaskManager

    if not tasks:
        raise UserError(f"{names.tasks} is empty; give task names such as hellaswag,arc_easy")
    if include_path:
        folder = Path(include_path)
        if not folder.is_dir():
            raise UserError(f"{names.include_path} {include_path} is not a folder; give a folder of task YAML files")
        if not any(folder.rglob("*.yaml")) and not any(folder.rglob("*.yml")):
            raise UserError(f"{names.include_path} {include_path} holds no task YAML file (*.yaml); give the folder "
                            "that holds your tasks' YAML files")
        local = TaskManager(include_path=include_path, include_defaults=False)
        if all(t in local.all_subtasks for t in tasks):
            return local
    manager = TaskManager(include_path=include_path or None)
    unknown = [t for t in tasks if not t.endswith(".yaml") and not manager.match_tasks([t])]
    if unknown:
        where = f" or in {names.include_path} {include_path}" if include_path else ""
        raise UserError(f"unknown task {', '.join(map(repr, unknown))} in {names.tasks}: not one of lm-eval's "
                        f"tasks{where}; `python -m lm_eval ls tasks` lists them, {names.include_path} DIR adds "
                        "your own")
    return manager
