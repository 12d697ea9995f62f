"""The training entry point: `python -m maxtext_rocm.train CONFIG.py[:VARIANT] [--config.KEY=VALUE ...]`.

The command line only: load the config, start the distributed runtime, agree on the config with
every process, build the Trainer (maxtext_rocm/trainer/trainer.py) with the periodic hooks the config
asks of the layers above it (eval/in_training.py: lm-eval's harness) and run it, and map how the run
ended to an exit code: 0 done (or stopped by SIGTERM, checkpointed), 2 a user error, 3 divergence,
130 stopped by SIGINT; 5 a lost peer (runtime/peers.py).
"""

from __future__ import annotations

import sys

import jax

from maxtext_rocm import config as config_lib
from maxtext_rocm.config import help as config_help
from maxtext_rocm.eval.in_training import harness_hooks
from maxtext_rocm.reporting import run_summary
from maxtext_rocm.runtime import distributed, preemption, startup_signals
from maxtext_rocm.runtime.peers import USER_ERROR_EXIT_STATUS
from maxtext_rocm.runtime.watchdog import HangWatchdog
from maxtext_rocm.trainer.divergence import TrainingDiverged
from maxtext_rocm.trainer.trainer import Trainer

# Trainer and TrainingDiverged: where callers have imported them from.
__all__ = ["Trainer", "TrainingDiverged", "main"]

USAGE = config_help.USAGE


def main(argv: list[str] | None = None) -> int:
    try:
        status = _main(sys.argv[1:] if argv is None else argv)
    except Exception:
        distributed.wait_if_peer_lost()  # a collective that failed because a peer died: exit 5, named
        raise
    distributed.say_goodbye(status)  # the other processes of a multi-process run learn how this one ended
    return status


def _main(argv: list[str]) -> int:
    if argv and argv[0] in ("-h", "--help"):  # the keys, read from the schema (config/help.py)
        try:
            print(config_help.help_text(argv[1:]))
        except config_lib.UserError as error:
            print(f"error: {error}", file=sys.stderr)
            return USER_ERROR_EXIT_STATUS
        return 0
    if not argv or argv[0].startswith("--"):
        print(f"{USAGE}  (--help lists the config's keys)", file=sys.stderr)
        return 2
    # Until the training loop takes SIGTERM/SIGINT over (PreemptionGuard: finish the step, save),
    # a signal exits at once with one line: there is nothing to save yet (maxtext_rocm/__init__.py
    # armed this already, before the imports, when the process is `python -m maxtext_rocm.train`).
    armed_here = startup_signals.arm()
    watchdog = None
    try:
        cfg = config_lib.load(argv[0], argv[1:])
        distributed.initialize(cfg.distributed)  # before anything touches a device
        distributed.agree_on_config(cfg)  # every process trains process 0's config, or all stop naming the key
        if cfg.train.hang_timeout_s:
            watchdog = HangWatchdog(cfg.train.hang_timeout_s, cfg.train.startup_timeout_s, cfg.output_dir,
                                    cfg.train.steps, process_index=jax.process_index()).start()
        hooks = harness_hooks(cfg)  # eval.harness_*: lm-eval and its tasks found, before any step
        trainer = Trainer(cfg, hooks=hooks)
        if trainer.is_finished():  # a finished run relaunched: one line, not a header and silence
            if trainer.is_logger:
                print(run_summary.already_trained(cfg.output_dir, trainer.step_count, cfg.train.steps), flush=True)
            trainer.close()
            return 0
        if watchdog is not None:
            trainer.on_step = watchdog.dispatched
        if trainer.is_logger:
            print(trainer.describe(), flush=True)
        trainer.run()
        trainer.commit_run_record()
        trainer.writer.close()
        if trainer.is_logger:
            print(run_summary.format_summary(trainer.summary()), flush=True)
    except config_lib.UserError as error:
        print(f"error: {error}", file=sys.stderr)
        return USER_ERROR_EXIT_STATUS
    except TrainingDiverged as error:
        print(f"error: {error}", file=sys.stderr)
        return 3
    finally:
        if watchdog is not None:
            watchdog.stop()
        if armed_here:  # a caller in this process (a test) gets its signal handlers back
            startup_signals.disarm()
    if trainer.stopped_by_signal is not None:
        print(f"stopped by signal {trainer.stopped_by_signal} at step {trainer.step_count}; "
              "checkpoint committed", file=sys.stderr)
        return preemption.exit_status(trainer.stopped_by_signal)
    return 0


if __name__ == "__main__":
    sys.exit(main())
