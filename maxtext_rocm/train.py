"""The training entry point: `python -m maxtext_rocm.train CONFIG.py[:VARIANT] [--config.KEY=VALUE ...]`.

Reads top to bottom: the Trainer builds the mesh and the model, has launch.py make the sharded
state and compile the step (overlapped), then loops over steps, fetching metrics from the device
only every `log.every` steps.
"""

from __future__ import annotations

from concurrent.futures import Future
import signal
import sys
import time
from pathlib import Path

import jax
import numpy as np

from maxtext_rocm.trainer import compilation, divergence
from maxtext_rocm.runtime import distributed, run_lock, startup_signals
from maxtext_rocm.config import memory_fit
from maxtext_rocm.reporting import run_report
from maxtext_rocm.parallel import sharding
from maxtext_rocm import config as config_lib
from maxtext_rocm.reporting import metrics as metrics_lib
from maxtext_rocm.trainer.divergence import TrainingDiverged  # noqa: F401 - where callers have imported it from
from maxtext_rocm.trainer.launch import data_sources, jit_eval_step, launch, optimizer_hyperparameters, place_batch, model_for_mesh, resolve_auto
from maxtext_rocm.data import batch_spec
from maxtext_rocm.data.resume import saved_state as saved_data_state
from maxtext_rocm.parallel import context
from maxtext_rocm.runtime.preemption import PreemptionGuard
from maxtext_rocm.reporting.profiling import Profiler
from maxtext_rocm.reporting.run_info import write_config_json
from maxtext_rocm.runtime.watchdog import HangWatchdog
from maxtext_rocm.trainer.preflight import check_run

USAGE = "usage: python -m maxtext_rocm.train CONFIG.py[:VARIANT] [--config.GROUP.KEY=VALUE ...]"


class Trainer:
    """Owns the mesh, the jitted step and the sharded state of one run.

    `Trainer(cfg).run()` trains `cfg.train.steps` steps; a notebook can call `.run(n)` a few steps
    at a time and inspect `.state` in between.
    """

    def __init__(self, cfg, devices=None, log=print):
        self.cfg, self.log = cfg, log
        self._started = time.perf_counter()
        devices = list(jax.devices() if devices is None else devices)
        check_run(cfg, len(devices), len({d.process_index for d in devices}))
        memory_fit.check_fits(cfg, devices)  # sizes that cannot fit stop here, before any allocation
        # Before anything is written: a second trainer on this output_dir stops here (run_lock.py).
        run_lock.acquire_for_run(cfg.output_dir, jax.process_index(), jax.process_count())
        self._holds_lock = jax.process_index() == 0
        try:
            self._build(cfg, devices)
        except BaseException:  # a trainer that failed to start frees output_dir for the next one
            if self._holds_lock:
                self._holds_lock = False
                run_lock.release(cfg.output_dir)
            raise

    def _build(self, cfg, devices) -> None:
        """Everything after the run lock: the mesh, the model, the state, the data, the writers."""
        self.on_step = None  # called as on_step(step, metrics) at each dispatch (the hang watchdog)
        self.mesh = sharding.make_mesh(cfg.mesh, devices)
        self.n_devices = len(devices)
        self.is_logger = jax.process_index() == 0
        if not self.is_logger:
            self.log = lambda *_: None  # process 0 speaks for every process
        self.compilation_cache = compilation.use_persistent_cache(cfg.train.compilation_cache, cfg.output_dir)
        self._cache_hits_before = compilation.cache_hits()
        self.policy = resolve_auto(cfg, self.mesh, devices[0])  # "auto" values written into cfg, for config.json
        self.model = model_for_mesh(cfg, self.policy, self.mesh)
        self.hyperparameters = optimizer_hyperparameters(cfg, self.mesh)
        self.global_batch = config_lib.global_batch_size(cfg, self.n_devices)
        self.checkpointer = None
        if cfg.checkpoint.enabled:  # orbax is imported only by runs that use it
            from maxtext_rocm.checkpoint import Checkpointer

            self.checkpointer = Checkpointer(cfg.checkpoint, cfg.output_dir)
        self.batch_sharding = sharding.batch_sharding(self.mesh)
        # How each sequence lies over mesh `sequence` (parallel/context.py), applied in _to_device.
        self.layout = context.mesh_layout(cfg.model, self.mesh)
        self._batch_dtypes = self.layout.batch_dtypes(batch_spec(cfg.data))
        launched = launch(cfg, self.model, self.mesh, self.batch_sharding, self._batch_dtypes,
                          self.checkpointer, self.context, self.log)
        self.state, self.step_count, resumed_data_state = launched.state, launched.step_count, launched.data_state
        self._compiled_step, self.state_sharding = launched.compiled_step, launched.state_sharding
        self.stack = launched.stack  # a pipeline's own layer order (parallel/pipeline_layout.py), or None
        self.data, self.eval_data = data_sources(cfg, self.global_batch, resumed_data_state, self.mesh)
        self._eval_step = (jit_eval_step(self.model, self.mesh, self.state_sharding, self.batch_sharding)
                           if self.eval_data is not None else None)
        self.stopped_by_signal = None
        self.profiler = Profiler(cfg.log.profile_steps, cfg.output_dir, enabled=self.is_logger)
        self.flops_per_token = metrics_lib.train_flops_per_token(cfg.model, cfg.train.seq_len)
        self.peak_tflops = metrics_lib.peak_tflops(
            devices[0].device_kind, self.policy.name, cfg.log.peak_tflops)
        # The run record: a fresh directory gets it now; one that holds a previous launch's keeps
        # that until this launch has something of its own there (its first checkpoint, or its end),
        # so a launch that fails early leaves the directory as it found it.
        self._record_pending = self.is_logger
        if self.is_logger and not Path(cfg.output_dir, "config.json").exists():
            self.commit_run_record()
        self.writer = metrics_lib.MetricsWriter(
            cfg.output_dir, enabled=self.is_logger, tensorboard=cfg.log.tensorboard,
            wandb_project=cfg.log.wandb_project, wandb_run_name=cfg.log.wandb_run_name, run_config=cfg.to_dict())

    def close(self) -> None:
        """Waits for checkpoint writes, closes the metrics files and frees output_dir for another
        trainer (the process's end does all this too)."""
        if self.checkpointer:
            self.checkpointer.close()
        self.writer.close()
        if self._holds_lock:
            self._holds_lock = False
            run_lock.release(self.cfg.output_dir)

    def commit_run_record(self) -> None:
        """Writes output_dir/config.json for this launch, once (atomically: write_config_json)."""
        if not self._record_pending:
            return
        write_config_json(self.cfg, self.mesh, f"{self.cfg.output_dir}/config.json")
        self._record_pending = False

    def context(self):
        """The mesh and logical-axis rules that the model's sharding constraints resolve against."""
        return sharding.rules_context(self.mesh)

    def state_in_model_order(self):
        """`.state` with the layer stack in model order, as checkpoints hold it, whatever a pipeline stores."""
        return self.state if self.stack is None else self.stack.to_canonical(self.state)

    def params_in_model_order(self):
        """The parameters as the model defines them: what generate, api.loss and comparisons take."""
        return self.state.params if self.stack is None else self.stack.params_to_canonical(self.state.params)

    def save_checkpoint(self) -> None:
        """Starts an asynchronous save of the current state (all processes must call it); stops
        the run (TrainingDiverged) if the state holds inf/NaN or the skipped-steps limit is hit."""
        from maxtext_rocm.checkpoint import NonFiniteState

        self.commit_run_record()  # checkpoints of this launch's config: its record goes with them
        step, in_a_row = (int(x) for x in jax.device_get((self.state.step, self.state.skipped_in_a_row)))
        # Every data-loading process's position (a collective), or the step alone: replayed up to it.
        data_state = saved_data_state(self.data, step)
        try:
            self.checkpointer.save(step, self.state_in_model_order(), data_state, self.cfg.model)
        except NonFiniteState as error:
            raise divergence.bad_checkpoint(error, self.checkpointer.manager.latest_step()) from None
        if divergence.skip_limit_reached(self.cfg.train, in_a_row):  # saved: the frozen state is the last good one
            self.checkpointer.wait()
            raise divergence.skipped_too_many(self.cfg.train, step, saved=True)

    def evaluate(self) -> dict:
        """Token-mean loss and perplexity over train.eval_steps batches of the eval split (the same
        batches every time, so evaluations compare)."""
        ce, tokens = 0.0, 0.0
        with self.context():
            for i in range(self.cfg.train.eval_steps):
                out = self._eval_step(self.state.params, self._to_device(self.eval_data.batch(i)), self.state.fp8)
                ce, tokens = ce + out["loss"] * out["tokens"], tokens + out["tokens"]
        if hasattr(self.eval_data, "close"):
            self.eval_data.close()  # no prefetching in the background while training
        ce, tokens = (float(x) for x in jax.device_get((ce, tokens)))
        loss = ce / max(tokens, 1.0)
        return {"eval_loss": loss, "eval_perplexity": float(np.exp(min(loss, 80.0))), "eval_tokens": tokens}

    def _to_device(self, host: dict) -> dict[str, jax.Array]:
        return place_batch(host, self.layout, self.batch_sharding, self._batch_dtypes, self.global_batch)

    def device_batch(self, step: int) -> dict[str, jax.Array]:
        return self._to_device(self.data.batch(step))

    @property
    def compiled_step(self) -> jax.stages.Compiled:
        """The compiled train step; waits for a background compilation the first time."""
        if isinstance(self._compiled_step, Future):
            self._compiled_step = self._compiled_step.result()
            compilation.release_freed_host_memory()
        return self._compiled_step

    def step(self):
        """One optimizer step. Returns the step's metrics as device arrays (no host sync)."""
        self.profiler.before_step(self.step_count)
        batch = self.device_batch(self.step_count)
        self.state, step_metrics = self.compiled_step(self.state, batch, self.hyperparameters)
        self.step_count += 1
        if self.on_step is not None:
            self.on_step(self.step_count, step_metrics)
        self.profiler.after_step(self.step_count, step_metrics)
        return step_metrics

    def run(self, steps: int | None = None) -> dict | None:
        """Trains `steps` more steps (default: up to train.steps); returns the last logged metrics.

        SIGTERM or SIGINT (on any process) stops every process at one agreed step, which is
        checkpointed; the signal is then in `stopped_by_signal` (preemption.py).
        """
        end = self.cfg.train.steps if steps is None else self.step_count + steps
        logged, step_metrics, logged_at, since = None, None, None, None
        # The guard covers the final save too: a signal while it commits is answered with a line.
        with PreemptionGuard(self.step_count, describe_saved=self._describe_saved,
                             timeout_s=self._stop_timeout_s()) as preemption:
            # Everything in the loop that runs a collective (saves, evaluations, the divergence
            # checks) depends on the step count alone, never on whether this process has heard of
            # the stop yet: every process runs the same collectives in the same order.
            while self.step_count < end and preemption.proceed(self.step_count):
                step_metrics = self.step()
                if self.checkpointer:
                    self.checkpointer.poll()  # a failed background save stops the run now, not at the next
                if since is None:
                    # Time from the end of this call's first step (the Trainer's first includes compilation).
                    jax.block_until_ready(step_metrics)
                    self._log_first_step()
                    since = (time.perf_counter(), self.step_count)
                if self.checkpointer and self.checkpointer.should_save(self.step_count, self.cfg.train.steps):
                    self.save_checkpoint()
                if self.eval_data is not None and self.step_count % self.cfg.train.eval_every == 0:
                    since = self._evaluate_and_log(step_metrics, since)
                if self.step_count % self.cfg.log.every == 0 or self.step_count == end:
                    logged, since, logged_at = self._log_row(step_metrics, since), (time.perf_counter(), self.step_count), self.step_count
            # Every process leaves the loop at the same step: `end`, or the stop step they agreed on.
            stopped_early = self.step_count < end
            if stopped_early and step_metrics is not None and logged_at != self.step_count:
                logged = self._log_row(step_metrics, since)  # the stop step's row
            self.profiler.stop(self.state)  # a trace still open when the run ends early
            if self.checkpointer:
                # One process alone may also save a signal that came at the very end (a notebook's run(n)).
                if stopped_early or (preemption.signal is not None and jax.process_count() == 1):
                    self.save_checkpoint()
                self.checkpointer.wait()
            self.stopped_by_signal = preemption.signal  # also one that came while the last save committed
        return logged

    def _evaluate_and_log(self, step_metrics, since):
        """Runs the evaluation of this step and writes its row; returns `since` moved on by the
        evaluation's time, which stays out of the step time."""
        jax.block_until_ready(step_metrics)
        eval_started = time.perf_counter()
        evaluated = self.evaluate()
        self.writer.write(self.step_count, evaluated)
        self.log(f"step {self.step_count}: eval loss {evaluated['eval_loss']:.4f}, "
                 f"perplexity {evaluated['eval_perplexity']:.2f}")
        return since[0] + time.perf_counter() - eval_started, since[1]

    def _log_row(self, step_metrics, since) -> dict:
        """Fetches the step's metrics (the loop's only host sync), writes and prints its row, and
        stops the run on divergence (train.on_nonfinite, train.max_skipped_steps). `since`: the
        (time, step count) that the step time is measured from."""
        fetched = jax.device_get(step_metrics)
        timed_steps = self.step_count - since[1]
        step_time = (time.perf_counter() - since[0]) / timed_steps if timed_steps else None
        logged = run_report.logged_row(self.cfg, fetched, step_time, self.global_batch, self.n_devices,
                                      self.flops_per_token, self.peak_tflops)
        self.writer.write(self.step_count, logged)
        if self.is_logger:
            self.log(metrics_lib.format_line(self.step_count, self.cfg.train.steps, logged))
        if fetched["nonfinite_steps"] and self.cfg.train.on_nonfinite == "stop":
            self._stop_on_nonfinite()
        if divergence.skip_limit_reached(self.cfg.train, int(fetched["skipped_in_a_row"])):
            if self.checkpointer:
                self.save_checkpoint()  # raises, once the last good state is saved
            raise divergence.skipped_too_many(self.cfg.train, int(jax.device_get(self.state.step)), saved=False)
        return logged

    def _describe_saved(self) -> str:
        """The newest committed checkpoint, for the line of a save abandoned by a repeated SIGINT."""
        from maxtext_rocm.checkpoint import committed_steps

        steps = committed_steps(self.checkpointer.directory) if self.checkpointer else []
        return str(self.checkpointer.directory / str(steps[-1])) if steps else "none"

    def _stop_timeout_s(self) -> float:
        """How long processes wait for each other to agree on a stop step: a peer silent longer is lost."""
        return float(max(60, 2 * self.cfg.distributed.heartbeat_timeout_s))

    def _log_first_step(self) -> None:
        """Once per Trainer: how long launch to the first finished step took, and why."""
        if self._started is None:
            return
        loaded = compilation.cache_hits() - self._cache_hits_before
        how = (f"{loaded} compiled program{'s' * (loaded > 1)} loaded from {self.compilation_cache}"
               if loaded else "includes compilation")
        self.log(f"first step done {time.perf_counter() - self._started:.1f}s after the trainer started ({how})")
        self._started = None

    def _stop_on_nonfinite(self):
        """The state froze at the last good step (see step.train_step): keep it and stop."""
        good_step = int(jax.device_get(self.state.step))
        if self.checkpointer:
            self.save_checkpoint()
            self.checkpointer.wait()
        raise divergence.became_nonfinite(good_step, saved=self.checkpointer is not None)

    def describe(self) -> str:
        return run_report.describe(self)


def main(argv: list[str] | None = None) -> int:
    try:
        status = _main(sys.argv[1:] if argv is None else argv)
    except Exception:
        distributed.wait_if_peer_lost()  # a collective that failed because a peer died: exit 5, named
        raise
    distributed.say_goodbye(status)  # the other processes of a multi-process run learn how this one ended
    return status


def _main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help") or argv[0].startswith("--"):
        print(USAGE, file=sys.stderr)
        return 0 if argv and argv[0] in ("-h", "--help") else 2
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
        trainer = Trainer(cfg)
        if watchdog is not None:
            trainer.on_step = watchdog.dispatched
        if trainer.is_logger:
            print(trainer.describe(), flush=True)
        trainer.run()
        trainer.commit_run_record()
        trainer.writer.close()
    except config_lib.UserError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
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
        return 130 if trainer.stopped_by_signal == signal.SIGINT else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
