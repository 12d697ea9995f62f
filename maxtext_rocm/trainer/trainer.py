"""The Trainer: one run's mesh, model, sharded state and training loop. `run` comes first; below it,
one method per concern it calls, then how the Trainer is built (launch.py makes the state and
compiles the step, overlapped)."""

from __future__ import annotations

import time
from concurrent.futures import Future
from pathlib import Path

import jax
import numpy as np

from maxtext_rocm import config as config_lib
from maxtext_rocm.config import memory_fit
from maxtext_rocm.data import batch_spec
from maxtext_rocm.data.resume import saved_state as saved_data_state
from maxtext_rocm.parallel import sharding
from maxtext_rocm.parallel.context import mesh_layout
from maxtext_rocm.reporting import metrics as metrics_lib, run_report
from maxtext_rocm.reporting.profiling import Profiler
from maxtext_rocm.reporting.run_info import write_config_json
from maxtext_rocm.reporting.run_summary import RunSummary
from maxtext_rocm.reporting.timeline import Timeline
from maxtext_rocm.runtime import distributed, run_lock
from maxtext_rocm.runtime.preemption import PreemptionGuard
from maxtext_rocm.trainer import compilation, divergence, hooks as hooks_lib
from maxtext_rocm.trainer.launch import (data_sources, jit_eval_step, launch, model_for_mesh, optimizer_hyperparameters,
                                         place_batch, run_policy)
from maxtext_rocm.trainer.preflight import check_run
from maxtext_rocm.resolve import Target, resolve
from maxtext_rocm.trainer.step import frozen_base, without_base
from maxtext_rocm.trainer.timing import StartupClock, StepClock


class Trainer:
    """Owns the mesh, the jitted step and the sharded state of one run. `Trainer(cfg).run()` trains
    `cfg.train.steps` steps; a notebook can call `.run(n)` a few steps at a time and inspect
    `.state` in between."""

    def run(self, steps: int | None = None) -> dict | None:
        """Trains `steps` more steps (default: up to train.steps); returns the last logged metrics.
        SIGTERM or SIGINT (on any process) stops every process at one agreed step, which is
        checkpointed; the signal is then in `stopped_by_signal` (runtime/preemption.py)."""
        end = self.cfg.train.steps if steps is None else self.step_count + steps
        clock, step_metrics, logged = StepClock(), None, None
        self.timeline.run_started(self.step_count)
        if self.step_count < end and not self._schedule_said:  # said once, before the first step trained
            self._schedule_said = True
            warning = run_report.warmup_warning(self.cfg)
            if warning:
                self.log(f"warning: {warning}")
        # The guard covers the final save too: a signal while it commits is answered with a line.
        with PreemptionGuard(self.step_count, describe_saved=self._describe_saved,
                             timeout_s=self._stop_timeout_s()) as preemption:
            # Everything in the loop that runs a collective (saves, evaluations, the divergence
            # checks) depends on the step count alone, never on whether this process has heard of
            # the stop yet: every process runs the same collectives in the same order.
            while self.step_count < end and preemption.proceed(self.step_count):
                step_metrics = self.step()
                if not clock.started:  # the step time counts from the end of this call's first step
                    self._first_step_done(step_metrics, clock)
                else:
                    clock.timed(step_metrics)
                if self.checkpointer:  # it raises a failed background save now, and saves at its steps
                    self.checkpointer.save_if_due(self.step_count, self.cfg.train.steps, self.save_checkpoint,
                                                  self.save_local_checkpoint)
                if self._evaluates_at(self.step_count):
                    self._evaluate_and_log(step_metrics, clock)
                for hook in self.hooks:  # work of the layers above on the live model (trainer/hooks.py)
                    if hook.due(self.step_count):
                        self._run_hook(hook, step_metrics, clock)
                if self._logs_at(self.step_count, end):  # the metrics reach the host on logging steps only,
                    fetched, logged = self._log_row(step_metrics, clock)
                    self._stop_if_diverged(fetched)  # so divergence is checked on them only
            # Every process leaves the loop at the same step: `end`, or the stop step they agreed on.
            stopped_early = self.step_count < end
            if stopped_early and step_metrics is not None and clock.logged_at != self.step_count:
                fetched, logged = self._log_row(step_metrics, clock)  # the stop step's row
                self._stop_if_diverged(fetched)
            self.profiler.stop(self.state)  # a trace still open when the run ends early
            self._save_at_end(stopped_early, preemption.signal)  # the stop step's save; every save committed
            self.stopped_by_signal = preemption.signal  # also one that came while the last save committed
        return logged

    # ----------------------------------------------------------------------------------------------
    # What the loop calls, in its order

    def step(self):
        """One optimizer step. Returns the step's metrics as device arrays (no host sync)."""
        self.profiler.before_step(self.step_count)
        sampled = {}
        if self.rollouts is not None:  # GRPO: this step's completions, sampled from the state and scored
            batch, sampled = self.rollouts.batch(self.step_count, self.state)
        else:
            batch = self.device_batch(self.step_count)
        row_length = batch["inputs"].shape[1]  # train.seq_len, or a bucket's (GRPO: data/buckets.py)
        self.state, step_metrics = self.compiled_step_for(row_length)(self.state, batch, self.hyperparameters)
        step_metrics = {**step_metrics, **sampled, "row_length": row_length}
        self.step_count += 1
        if self.on_step is not None:
            self.on_step(self.step_count, step_metrics)
        self.profiler.after_step(self.step_count, step_metrics)
        return step_metrics

    def _first_step_done(self, step_metrics, clock: StepClock) -> None:
        """Waits for a run() call's first step and starts its step clock; the Trainer's first also
        says how long launch to it took, and why."""
        jax.block_until_ready(step_metrics)
        self._startup.first_step_done(self.log)
        self.timeline.first_step(self.step_count)
        clock.start(self.step_count)

    def save_checkpoint(self) -> None:
        """Starts an asynchronous save of the current state (all processes must call it); stops
        the run (TrainingDiverged) if the state holds inf/NaN or the skipped-steps limit is hit."""
        with self.timeline.stall("checkpoint", self.step_count, ready=self.state, tier="persistent"):
            self._save_persistent()

    def _save_persistent(self) -> None:
        from maxtext_rocm.checkpoint import NonFiniteState

        self.commit_run_record()  # checkpoints of this launch's config: its record goes with them
        step, in_a_row = (int(x) for x in jax.device_get((self.state.step, self.state.skipped_in_a_row)))
        if self.checkpointer.has_saved(step):  # the stop step was a save step too: every process knows it alike
            return
        # Every data-loading process's position (a collective), or the step alone: replayed up to it.
        data_state = saved_data_state(self.data, step)
        try:
            self.checkpointer.save(step, without_base(self.state_in_model_order()), data_state, self.cfg.model)
        except NonFiniteState as error:
            raise divergence.bad_checkpoint(error, self.checkpointer.manager.latest_step()) from None
        if divergence.skip_limit_reached(self.cfg.train, in_a_row):  # saved: the frozen state is the last good one
            self.checkpointer.wait()
            raise divergence.skipped_too_many(self.cfg.train, step, saved=True)

    def save_local_checkpoint(self) -> None:
        """Starts the local tier's save of the current state (checkpoint.local_dir; all processes call it)."""
        # The copy off the devices waits for the steps anyway: waiting for them first costs nothing.
        with self.timeline.stall("checkpoint", self.step_count, ready=self.state, tier="local"):
            data_state = saved_data_state(self.data, self.step_count)  # every process's position (a collective)
            self.checkpointer.save_local(self.step_count, without_base(self.state_in_model_order()), data_state)

    def _evaluates_at(self, step_count: int) -> bool:
        return self.eval_data is not None and step_count % self.cfg.train.eval_every == 0

    def _evaluate_and_log(self, step_metrics, clock: StepClock) -> None:
        """Runs the evaluation of this step and writes its row; its time stays out of the step time."""
        jax.block_until_ready(step_metrics)
        with clock.left_out(), self.timeline.stall("eval", self.step_count):
            evaluated = self.evaluate()
            self.writer.write(self.step_count, evaluated)
            self.last_eval = (self.step_count, evaluated)
            detail = (f"perplexity {evaluated['eval_perplexity']:.2f}" if "eval_perplexity" in evaluated else
                      f"accuracy {evaluated['eval_dpo_accuracy']:.3f}, margin {evaluated['eval_dpo_reward_margin']:.4f}")
            self.log(f"step {self.step_count}: eval loss {evaluated['eval_loss']:.4f}, {detail}")

    def _run_hook(self, hook, step_metrics, clock: StepClock) -> None:
        """A periodic hook's run at this step, its metrics a row of the step; its time stays out of the step time."""
        jax.block_until_ready(step_metrics)
        with clock.left_out(), self.timeline.stall("eval", self.step_count, hook=hook.name):
            report = hook.run(self.step_count, hooks_lib.live_model(self))
        self.writer.write(self.step_count, report.metrics)
        if report.line:
            self.log(f"step {self.step_count}: {report.line}")

    def evaluate(self) -> dict:
        """Token-mean loss and perplexity over train.eval_steps batches of the eval split (the same
        batches every time, so evaluations compare); under DPO the pair-mean loss, accuracy and margin."""
        ce, tokens, sums = 0.0, 0.0, None
        with self.sharding_rules():
            for i in range(self.cfg.train.eval_steps):
                out = self._eval_step(self.state.params, self._to_device(self.eval_data.batch(i)), self.state.fp8,
                                      self.state.reference, frozen_base(self.state))
                if "loss" not in out:  # DPO: sums over pairs (step.eval_step)
                    sums = out if sums is None else jax.tree_util.tree_map(lambda a, b: a + b, sums, out)
                    continue
                ce, tokens = ce + out["loss"] * out["tokens"], tokens + out["tokens"]
        if hasattr(self.eval_data, "close"):
            self.eval_data.close()  # no prefetching in the background while training
        if sums is not None:
            from maxtext_rocm.finetune import dpo

            return dpo.eval_metrics({k: float(v) for k, v in jax.device_get(sums).items()})
        ce, tokens = (float(x) for x in jax.device_get((ce, tokens)))
        loss = ce / max(tokens, 1.0)
        return {"eval_loss": loss, "eval_perplexity": float(np.exp(min(loss, 80.0))), "eval_tokens": tokens}

    def _logs_at(self, step_count: int, end: int) -> bool:
        return step_count % self.cfg.log.every == 0 or step_count == end

    def _log_row(self, step_metrics, clock: StepClock) -> tuple[dict, dict]:
        """Fetches the step's metrics (the loop's only host sync), writes and prints its row and
        marks the step clock. Returns (the fetched metrics, the row)."""
        fetched, paddings = jax.device_get((step_metrics, clock.paddings))
        timed_padding = lengths = None
        if paddings:  # over the timed steps' positions, whose rows may differ in length (buckets)
            lengths = np.asarray(clock.row_lengths, np.float64)
            timed_padding = 1.0 - float(np.mean(lengths * (1.0 - np.asarray(paddings, np.float64)))) / np.mean(lengths)
        self.timeline.steps_until(self.step_count)  # the devices are done with every step up to here
        logged = run_report.logged_row(self.cfg, fetched, clock.step_time(self.step_count), self.global_batch,
                                       self.n_devices, self.flops_per_token, self.peak_tflops,
                                       timed_padding=timed_padding, timed_row_lengths=lengths,
                                       goodput=self.timeline.goodput_so_far())
        self.writer.write(self.step_count, logged)
        self.last_logged = (self.step_count, logged)
        if self.is_logger:
            self.log(metrics_lib.format_line(self.step_count, self.cfg.train.steps, logged))
        clock.logged(self.step_count)
        return fetched, logged

    def _stop_if_diverged(self, fetched: dict) -> None:
        """Stops the run on divergence (train.on_nonfinite, train.max_skipped_steps), read from a
        logged step's fetched metrics; the last good state is saved first where checkpoints are on."""
        if fetched["nonfinite_steps"] and self.cfg.train.on_nonfinite == "stop":
            good_step = int(jax.device_get(self.state.step))  # the state froze there (step.train_step)
            if self.checkpointer:
                self.save_checkpoint()
                self.checkpointer.wait()
            raise divergence.became_nonfinite(good_step, saved=self.checkpointer is not None)
        if divergence.skip_limit_reached(self.cfg.train, int(fetched["skipped_in_a_row"])):
            if self.checkpointer:
                self.save_checkpoint()  # raises, once the last good state is saved
            raise divergence.skipped_too_many(self.cfg.train, int(jax.device_get(self.state.step)), saved=False)

    def _save_at_end(self, stopped_early: bool, signal) -> None:
        """The stop step's save, when the loop stopped early, and the wait for every save to commit."""
        if not self.checkpointer:
            return
        # One process alone may also save a signal that came at the very end (a notebook's run(n)).
        if stopped_early or (signal is not None and jax.process_count() == 1):
            self.save_checkpoint()
        with self.timeline.stall("checkpoint", self.step_count, tier="persistent"):  # the last commits
            self.checkpointer.wait()

    def _describe_saved(self) -> str:
        """The newest committed checkpoint, for the line of a save abandoned by a repeated SIGINT."""
        from maxtext_rocm.checkpoint import committed_steps

        steps = committed_steps(self.checkpointer.directory) if self.checkpointer else []
        return str(self.checkpointer.directory / str(steps[-1])) if steps else "none"

    def _stop_timeout_s(self) -> float:
        """How long processes wait for each other to agree on a stop step: a peer silent longer is lost."""
        return float(max(60, 2 * self.cfg.distributed.heartbeat_timeout_s))

    # ----------------------------------------------------------------------------------------------
    # Building the Trainer

    def __init__(self, cfg, devices=None, log=print, hooks=()):
        self.cfg, self.log, self.hooks = cfg, log, tuple(hooks)  # hooks: trainer/hooks.py (eval's harness)
        hooks_lib.check_hooks(cfg, self.hooks)
        started = self._started = time.perf_counter()
        self._started_wall = time.time()
        devices = list(jax.devices() if devices is None else devices)
        check_run(cfg, len(devices), len({d.process_index for d in devices}))
        # Sizes that cannot fit stop here, before any allocation.
        memory_fit.check_fits(cfg, devices, _local_tier_bytes(cfg))
        # Before anything is written: a second trainer on this output_dir stops here (run_lock.py).
        self._run_dir = RunDirectory(cfg.output_dir)
        try:
            self._build(cfg, devices, started)
        except BaseException:  # a trainer that failed to start frees output_dir for the next one
            self._run_dir.release()
            raise

    def _build(self, cfg, devices, started: float) -> None:
        """Everything after the run lock: the mesh, the model, the state, the data, the writers."""
        self.on_step = None  # called as on_step(step, metrics) at each dispatch (the hang watchdog)
        self.mesh = sharding.make_mesh(cfg.mesh, devices)
        self.n_devices = len(devices)
        self.is_logger = jax.process_index() == 0
        if not self.is_logger:
            self.log = lambda *_: None  # process 0 speaks for every process
        self.compilation_cache = compilation.use_persistent_cache(cfg.train.compilation_cache, cfg.output_dir)
        self._startup = StartupClock(started, self.compilation_cache)
        # From here on the config is read-only and says what runs (config.json records it).
        self.cfg = cfg = resolve(cfg, self.mesh, Target.of_device(devices[0]))
        self.policy = run_policy(cfg, devices[0])
        self.model = model_for_mesh(cfg, self.policy, self.mesh)
        self.hyperparameters = optimizer_hyperparameters(cfg, self.mesh)
        self.global_batch = config_lib.global_batch_size(cfg, self.n_devices)
        self.checkpointer = None
        if cfg.checkpoint.enabled:  # orbax is imported only by runs that use it
            from maxtext_rocm.checkpoint import Checkpointer

            self.checkpointer = Checkpointer(cfg.checkpoint, cfg.output_dir)
        self.batch_sharding = sharding.batch_sharding(self.mesh)
        # How each sequence lies over mesh `sequence` (parallel/context.py), applied in _to_device.
        self.layout = mesh_layout(cfg.model, self.mesh)
        self._batch_dtypes = self.layout.batch_dtypes(batch_spec(cfg.data))
        # The run's timeline across restarts, for goodput (reporting/timeline.py)
        self.timeline = Timeline(cfg.output_dir, self._started_wall, distributed.init_span)
        launch_began = time.time()
        launched = launch(cfg, self.model, self.mesh, self.batch_sharding, self._batch_dtypes,
                          self.checkpointer, self.sharding_rules, self.log)
        self.timeline.launched(launch_began, self.checkpointer.restore_s if self.checkpointer else 0.0,
                               launched.step_count, self.checkpointer.restored_tier if self.checkpointer else "",
                               compilation.cache_hits())
        self.state, self.step_count, self._compiled_step = launched.state, launched.step_count, launched.compiled_step
        self._jitted_step, self._steps_by_length = launched.jitted_step, {}  # other row lengths' steps
        self.launched_at_step = launched.step_count  # where this launch began: 0, or the step it resumed from
        self.last_logged = self.last_eval = None  # (step, row) of the newest logged row and evaluation
        self._schedule_said = False  # run_report.warmup_warning, said by the first run() that trains
        self.state_sharding = launched.state_sharding
        # A pipeline's own layer order (parallel/pipeline/layout.py) <-> the model's, or None.
        self.storage_order = launched.storage_order
        self.rollouts = None
        if cfg.train.objective == "grpo":  # samples of the policy, not a data source (trainer/grpo_rollouts.py)
            from maxtext_rocm.trainer.grpo_rollouts import Rollouts

            rows = sharding.batch_rows_of_process(self.mesh, self.global_batch, cfg.train.seq_len)
            self.rollouts = Rollouts(cfg, self.policy, self.mesh, self.state_sharding, self.global_batch, rows,
                                     self._to_device)
            self.data, self.eval_data = self.rollouts, None
        else:
            self.data, self.eval_data = data_sources(cfg, self.global_batch, launched.data_state, self.mesh)
        self._eval_step = (jit_eval_step(self.model, self.mesh, self.state_sharding, self.batch_sharding,
                                         cfg.dpo if cfg.train.objective == "dpo" else None)
                           if self.eval_data is not None else None)
        self.stopped_by_signal = None
        self.profiler = Profiler(cfg.log.profile_steps, cfg.output_dir, enabled=self.is_logger)
        self.flops_per_token = metrics_lib.train_flops_per_token(cfg.model, cfg.train.seq_len)
        self.peak_tflops = metrics_lib.peak_tflops(devices[0].device_kind, self.policy.name, cfg.log.peak_tflops)
        # The run record: a fresh directory gets it now; one that holds a previous launch's keeps
        # that until this launch has something of its own there (its first checkpoint, or its end),
        # so a launch that fails early leaves the directory as it found it.
        if self.is_logger and not self._run_dir.has_record():
            self.commit_run_record()
        self.writer = metrics_lib.MetricsWriter(
            cfg.output_dir, enabled=self.is_logger, tensorboard=cfg.log.tensorboard,
            wandb_project=cfg.log.wandb_project, wandb_run_name=cfg.log.wandb_run_name, run_config=cfg.to_dict())

    def close(self) -> None:
        """Waits for checkpoint writes, closes the metrics files and frees output_dir for another
        trainer (the process's end does all this too)."""
        if self.checkpointer:
            self.checkpointer.close()
        self.timeline.closed()
        if hasattr(getattr(self, "data", None), "close"):
            self.data.close()  # its thread, and its data.workers processes
        self.writer.close()
        self._run_dir.release()

    def commit_run_record(self) -> None:
        """Writes output_dir/config.json for this launch, once (atomically: write_config_json)."""
        self._run_dir.commit_record(self.cfg, self.mesh)

    def sharding_rules(self):
        """The mesh and logical-axis rules that the model's sharding constraints resolve against: a
        context to trace the model's programs in."""
        return sharding.rules_context(self.mesh)

    def state_in_model_order(self):
        """`.state` with the layer stack in model order, as checkpoints hold it, whatever a pipeline stores."""
        return self.state if self.storage_order is None else self.storage_order.to_canonical(self.state)

    def params_in_model_order(self):
        """The parameters as the model defines them: what generate, api.loss and comparisons take."""
        if self.storage_order is None:
            return self.state.params
        return self.storage_order.params_to_canonical(self.state.params)

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

    def compiled_step_for(self, row_length: int) -> jax.stages.Compiled:
        """The train step compiled for rows of `row_length` positions: `compiled_step` for
        train.seq_len, else compiled on first use (once per bucket; data/buckets.py)."""
        if row_length == self.cfg.train.seq_len:
            return self.compiled_step
        if row_length not in self._steps_by_length:
            from maxtext_rocm.trainer.launch import lower_step

            abstract = jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
                                              self.state)
            with self.sharding_rules():
                lowered = lower_step(self._jitted_step, self.cfg, self.mesh, abstract, self.batch_sharding,
                                     self._batch_dtypes, row_length)
            self._steps_by_length[row_length] = lowered.compile()
        return self._steps_by_length[row_length]

    def describe(self) -> str:
        return run_report.describe(self)

    def is_finished(self) -> bool:
        """Whether the state is at train.steps already (a finished run relaunched): nothing to train."""
        return self.step_count >= self.cfg.train.steps

    def summary(self) -> RunSummary:
        """This launch's end, for run_summary.format_summary: losses, token positions, wall time, the
        newest checkpoint."""
        from maxtext_rocm.checkpoint import committed_steps

        steps = committed_steps(self.checkpointer.directory) if self.checkpointer else []
        launch_steps = self.step_count - self.launched_at_step
        (loss_step, row), (eval_step, evaluated) = self.last_logged or (None, {}), self.last_eval or (None, {})
        return RunSummary(
            name=self.cfg.name, output_dir=self.cfg.output_dir, step=self.step_count, total_steps=self.cfg.train.steps,
            launch_steps=launch_steps, token_positions=launch_steps * self.global_batch * self.cfg.train.seq_len,
            wall_s=time.perf_counter() - self._started, loss=row.get("loss"), loss_step=loss_step,
            objective=self.cfg.train.objective, eval_loss=evaluated.get("eval_loss"), eval_step=eval_step,
            checkpoint=str(self.checkpointer.directory / str(steps[-1])) if steps else None,
            checkpoints_enabled=self.checkpointer is not None, lora=self.cfg.lora.rank > 0,
            stopped_by_signal=self.stopped_by_signal)


def _local_tier_bytes(cfg) -> int:
    """What the run's local checkpoint steps on this process hold already (checkpoint.local_dir)."""
    if not (cfg.checkpoint.enabled and cfg.checkpoint.get("local_dir", "")):
        return 0
    from maxtext_rocm.checkpoint.local_tier import held_bytes

    return held_bytes(cfg.checkpoint, cfg.output_dir)


class RunDirectory:
    """output_dir as one Trainer holds it: the run lock (runtime/run_lock.py), which process 0
    takes for every process, and the run record (config.json), which process 0 writes once per
    launch, when the launch first has something of its own there."""

    def __init__(self, output_dir: str):
        run_lock.acquire_for_run(output_dir, jax.process_index(), jax.process_count())
        self.output_dir = output_dir
        self.holds_lock = self.record_pending = jax.process_index() == 0

    def has_record(self) -> bool:
        return Path(self.output_dir, "config.json").exists()

    def commit_record(self, cfg, mesh) -> None:
        if self.record_pending:
            write_config_json(cfg, mesh, f"{self.output_dir}/config.json")
            self.record_pending = False

    def release(self) -> None:
        if self.holds_lock:
            self.holds_lock = False
            run_lock.release(self.output_dir)
