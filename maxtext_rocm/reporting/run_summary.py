"""What a run says when it ends (its summary, on the logging process), and the one line of a run
relaunched with nothing left to train."""

from __future__ import annotations

import dataclasses
import shlex


@dataclasses.dataclass(frozen=True)
class RunSummary:
    """The facts of one launch's end, gathered by the Trainer (Trainer.summary)."""

    name: str
    output_dir: str
    step: int  # the step the run reached
    total_steps: int  # train.steps
    launch_steps: int  # steps taken by this launch (a resumed run started later than 0)
    token_positions: int  # this launch's: launch_steps x the global batch x train.seq_len
    wall_s: float  # from the Trainer's start to now: launch, restore and compilation included
    loss: float | None  # the last logged step's
    loss_step: int | None
    objective: str  # train.objective: "lm" or "dpo" (then the loss is DPO's)
    eval_loss: float | None  # the last evaluation's, where evaluations ran
    eval_step: int | None
    checkpoint: str | None  # the newest committed checkpoint's directory; None: none saved
    checkpoints_enabled: bool
    lora: bool  # a LoRA run exports its merged model, or its adapter with --adapter
    stopped_by_signal: int | None = None


def export_command(output_dir: str, lora: bool) -> str:
    """The command that turns the run's newest checkpoint into a Hugging Face folder."""
    run = output_dir.rstrip("/") or output_dir  # "runs/x/" exports to runs/x-hf, not into runs/x/-hf
    command = f"python -m maxtext_rocm.convert to-hf {shlex.quote(run)} {shlex.quote(run + '-hf')}"
    # A shell comment, so that the whole line pastes and runs as it is.
    return command + ("   # the merged model; add --adapter for the PEFT adapter alone" if lora else "")


def format_summary(s: RunSummary) -> str:
    how = (f"stopped by signal {s.stopped_by_signal} at step {s.step} of {s.total_steps}"
           if s.stopped_by_signal is not None else f"done at step {s.step} of {s.total_steps}")
    loss_name = "dpo loss" if s.objective == "dpo" else "loss"
    losses = [f"{loss_name} {s.loss:.4f} (step {s.loss_step})" if s.loss is not None else f"no {loss_name} logged"]
    if s.eval_loss is not None:
        losses.append(f"eval loss {s.eval_loss:.4f} (step {s.eval_step})")
    lines = [f"run {s.name} {how}, {_duration(s.wall_s)} wall time: " + ", ".join(losses),
             f"  this launch: {s.launch_steps} step{'s' * (s.launch_steps != 1)}, {s.token_positions:,} token "
             "positions (steps x global batch x train.seq_len)"]
    if s.checkpoint is not None:
        lines.append(f"  checkpoint: {s.checkpoint}")
        lines.append(f"  export: {export_command(s.output_dir, s.lora)}")
    else:
        lines.append("  checkpoint: none (checkpoint.enabled=false)" if not s.checkpoints_enabled
                     else "  checkpoint: none saved")
    return "\n".join(lines)


def already_trained(output_dir: str, step: int, total_steps: int) -> str:
    """The line of a relaunched run whose checkpoint is at train.steps already: nothing is trained."""
    return (f"{output_dir} is already trained to step {step} (train.steps={total_steps}); nothing to train: raise "
            f"train.steps to continue it, or give another output_dir for a new run")


def _duration(seconds: float) -> str:
    if seconds < 60:
        return f"{seconds:.1f} s"
    minutes, secs = divmod(round(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours} h {minutes:02d} min" if hours else f"{minutes} min {secs:02d} s"
