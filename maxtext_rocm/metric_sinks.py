"""Where logged scalars go besides metrics.jsonl: TensorBoard event files (tensorboardX) and,
when log.wandb_project names one, a Weights & Biases run (online, or offline under
WANDB_MODE=offline, which wandb itself reads).

Each sink is opened by process 0 only (MetricsWriter decides) and takes the same scalars.
"""

from __future__ import annotations

import importlib
import sys
import time
from typing import Any, Mapping

from maxtext_rocm.errors import UserError


def _import_tensorboardx():
    """tensorboardX, imported without torch.

    tensorboardX's writer module imports torch whenever torch is installed, only so that it can
    accept torch tensors; that costs a training process about 1.3 s and 230 MiB before its first
    step, and scalars never need it. A `None` entry in sys.modules makes `import torch` raise
    ImportError, which tensorboardX handles; the entry is removed at once, so torch imports
    normally afterwards (a notebook that imported torch first keeps it: nothing is hidden then).
    """
    if "tensorboardX" in sys.modules or "torch" in sys.modules:
        return importlib.import_module("tensorboardX")
    sys.modules["torch"] = None
    try:
        return importlib.import_module("tensorboardX")
    finally:
        del sys.modules["torch"]


class TensorBoardSink:
    """One event per step holding all its scalars, in a new events.out.tfevents.* file in `logdir`."""

    def __init__(self, logdir: str):
        tensorboardx = _import_tensorboardx()
        from tensorboardX.proto.summary_pb2 import Summary

        self._summary = Summary
        self._writer = tensorboardx.FileWriter(logdir)

    def write(self, step: int, scalars: Mapping[str, float]) -> None:
        # Summary protos directly rather than SummaryWriter.add_scalar: add_scalar warns on every NaN,
        # and a NaN loss is worth drawing (it shows where a run diverged), not worth a warning a step.
        values = [self._summary.Value(tag=tag, simple_value=value) for tag, value in scalars.items()]
        self._writer.add_summary(self._summary(value=values), global_step=int(step), walltime=time.time())
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


class WandbSink:
    """A Weights & Biases run in project `project`, its files under `directory`/wandb, with the
    resolved config as the run's config."""

    def __init__(self, project: str, run_name: str, run_config: Mapping[str, Any] | None, directory: str):
        try:
            import wandb
        except ImportError:
            raise UserError(
                f"log.wandb_project={project!r} needs the wandb package, which is not installed; "
                "install it with pip install -e '.[wandb]' or leave log.wandb_project empty") from None
        try:
            self._run = wandb.init(project=project, name=run_name or None, dir=directory,
                                   config=dict(run_config or {}))
        except wandb.errors.Error as error:  # no API key, no network, no such entity
            raise UserError(
                f"log.wandb_project={project!r}: W&B could not start a run ({error}); log in with "
                "`wandb login` or WANDB_API_KEY, or set WANDB_MODE=offline to keep the run on disk") from None

    def write(self, step: int, scalars: Mapping[str, float]) -> None:
        self._run.log(dict(scalars), step=int(step))

    def close(self) -> None:
        self._run.finish()
