"""The training entry point: `python -m maxtext_rocm.train CONFIG.py[:VARIANT] [--config.KEY=VALUE ...]`.

Reads top to bottom: build the mesh, the model, the optimizer and the sharded state; then loop
over steps, fetching metrics from the device only every `log.every` steps.
"""

from __future__ import annotations

import contextlib
import functools
from concurrent.futures import Future
import signal
import sys
import time
from pathlib import Path

import jax
import jax.extend.core as jax_core
import ml_collections
import numpy as np
from flax import linen as nn

from maxtext_rocm import compilation
from maxtext_rocm import config as config_lib
from maxtext_rocm import fp8
from maxtext_rocm import distributed
from maxtext_rocm import memory_fit
from maxtext_rocm import startup_signals
from maxtext_rocm import metrics as metrics_lib
from maxtext_rocm import optim
from maxtext_rocm import run_lock
from maxtext_rocm import sharding
from maxtext_rocm.data import batch_spec, build_source
from maxtext_rocm.models import build_model
from maxtext_rocm.models.attention import resolve_implementation as resolve_attention
from maxtext_rocm.parallel import experts, pipeline
from maxtext_rocm.precision import policy_from_config
from maxtext_rocm.preemption import PreemptionGuard
from maxtext_rocm.profiling import Profiler
from maxtext_rocm.run_info import write_config_json
from maxtext_rocm.step import create_state, eval_step, train_step
from maxtext_rocm.watchdog import HangWatchdog

USAGE = "usage: python -m maxtext_rocm.train CONFIG.py[:VARIANT] [--config.GROUP.KEY=VALUE ...]"


class TrainingDiverged(RuntimeError):
    """The loss or gradients became inf/NaN under train.on_nonfinite='stop', or for
    train.max_skipped_steps steps in a row under 'skip'."""


def abstract_state(cfg, model, mesh):
    """(init fn, its key, the state as ShapeDtypeStructs carrying their shardings, the shardings):
    the state's layout without allocating it (the Trainer and the AOT fit check share it)."""
    # The optimizer state's layout depends on whether it clips, not on the numbers (optim.py).
    tx = optim.build_optimizer(optim.hyperparameters(cfg.optimizer, cfg.train.steps), optim.clips(cfg.optimizer))
    create = functools.partial(create_state, model=model, tx=tx, batch_shape=(1, min(cfg.train.seq_len, 8)))
    key = jax.random.key(cfg.train.seed)
    # Flax traces the model's init once, here; `init` replays the recorded program (re-tracing the
    # model cost 0.3-0.5 s of launch at the reference comparison's size).
    jaxpr, abstract = jax.make_jaxpr(create, return_shape=True)(key)
    out_tree = jax.tree_util.tree_structure(abstract)

    def init(k):
        return jax.tree_util.tree_unflatten(out_tree, jax_core.jaxpr_as_fun(jaxpr)(k))

    state_sharding = sharding.logical_to_sharding(nn.get_partition_spec(abstract), mesh)
    abstract = jax.tree_util.tree_map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                                      nn.meta.unbox(abstract), state_sharding)
    return init, key, abstract, state_sharding


def jit_train_step(cfg, model, mesh, state_sharding, batch_sharding):
    """The jitted train step, state donated (maxtext_rocm/compile.py lowers this same function).
    Called as step(state, batch, hyperparameters): see `optimizer_hyperparameters`."""
    return jax.jit(
        functools.partial(train_step, model=model, clip=optim.clips(cfg.optimizer),
                          train_cfg=ml_collections.FrozenConfigDict(cfg.train)),
        in_shardings=(state_sharding, batch_sharding, sharding.replicated(mesh)),
        out_shardings=(state_sharding, sharding.replicated(mesh)),
        donate_argnums=0,
        compiler_options=compilation.step_compiler_options(cfg.precision.policy, mesh.devices.flat[0].platform))


def optimizer_hyperparameters(cfg, mesh, abstract: bool = False) -> dict:
    """The train step's third argument, optim.hyperparameters of the run: fp32 scalars replicated
    over the mesh, made once (every process holds the same values); `abstract`: their shapes only."""
    replicated = sharding.replicated(mesh)
    values = optim.hyperparameters(cfg.optimizer, cfg.train.steps)
    if abstract:
        return {name: jax.ShapeDtypeStruct((), np.float32, sharding=replicated) for name in values}
    return {name: jax.make_array_from_callback((), replicated, lambda _, v=value: v)
            for name, value in values.items()}


class Trainer:
    """Owns the mesh, the jitted step and the sharded state of one run.

    `Trainer(cfg).run()` trains `cfg.train.steps` steps; a notebook can call `.run(n)` a few steps
    at a time and inspect `.state` in between.
    """

    def __init__(self, cfg: ml_collections.ConfigDict, devices=None, log=print):
        self.cfg, self.log = cfg, log
        self._started = time.perf_counter()
        devices = list(jax.devices() if devices is None else devices)
        config_lib.validate(cfg, len(devices), len({d.process_index for d in devices}))
        memory_fit.check_fits(cfg, devices)  # sizes that cannot fit stop here, before any allocation
        # Before anything is written: a second trainer on this output_dir stops here (run_lock.py).
        run_lock.acquire_for_run(cfg.output_dir, jax.process_index(), jax.process_count())
        self._holds_lock = jax.process_index() == 0
        self.on_step = None  # called as on_step(step, metrics) at each dispatch (the hang watchdog)
        self.mesh = sharding.make_mesh(cfg.mesh, devices)
        self.n_devices = len(devices)
        self.is_logger = jax.process_index() == 0
        if not self.is_logger:
            self.log = lambda *_: None  # process 0 speaks for every process
        self.compilation_cache = compilation.use_persistent_cache(cfg.train.compilation_cache, cfg.output_dir)
        self._cache_hits_before = compilation.cache_hits()
        self.policy = policy_from_config(cfg.precision, devices[0])
        if self.policy.fp8_format:
            cfg.precision.fp8_format = self.policy.fp8_format  # "auto" resolved, for config.json
        cfg.model.attention = resolve_attention(cfg.model.attention, devices[0], self.policy.compute_dtype,
                                                cfg.train.seq_len)
        self.model = build_model(cfg.model, self.policy, expert_exchange=experts.expert_exchange(cfg.model, self.mesh),
                                 layer_stack=pipeline.layer_stack(cfg.pipeline, cfg.model, self.mesh))
        self.hyperparameters = optimizer_hyperparameters(cfg, self.mesh)
        self.global_batch = config_lib.global_batch_size(cfg, self.n_devices)

        self.checkpointer = None
        if cfg.checkpoint.enabled:  # orbax is imported only by runs that use it
            from maxtext_rocm.checkpoint import Checkpointer

            self.checkpointer = Checkpointer(cfg.checkpoint, cfg.output_dir)
        init, key, abstract, self.state_sharding = abstract_state(cfg, self.model, self.mesh)
        self.batch_sharding = sharding.batch_sharding(self.mesh)
        self._batch_dtypes = batch_spec(cfg.data)
        self._train_step = jit_train_step(cfg, self.model, self.mesh, self.state_sharding, self.batch_sharding)
        # The state is made (or restored) in a thread while this one traces and lowers the step:
        # XLA compiles and runs the init program without holding the GIL, and tracing is Python.
        # The init program is lowered here first, since lowering is Python too: lowered in the
        # thread, it and the step's tracing took turns on the GIL and its compilation started
        # late (reference comparison's MoE model: 0.9 s to lower instead of 0.2). Lowered here,
        # the step's compilation started 1.6 s after the Trainer did instead of 2.2 for the
        # dense model, 2.0 instead of 2.2 for the MoE one (2 cores, medians of 3-4 runs).
        resume = self.checkpointer.find_resume() if self.checkpointer else None
        if resume and resume.steps[0] > cfg.train.steps:  # the newest the resume may read
            newest = resume.steps[0]
            raise config_lib.ConfigError(
                f"train.steps={cfg.train.steps} is below step {newest} of the checkpoint this run resumes "
                f"from in {cfg.output_dir}; raise train.steps above {newest} to train on, or use "
                "another output_dir to start afresh")
        if resume:
            made = compilation.in_thread(self._restore_state, resume, abstract)
        else:
            init_jit = jax.jit(lambda k: nn.meta.unbox(init(k)), out_shardings=self.state_sharding)
            made = compilation.in_thread(self._fresh_state, compilation.lower_init(init_jit, key), key, abstract)
        lowered = self._lower_step(abstract)
        if compilation.compile_overlaps_init():
            self._compiled_step = compilation.in_thread(lowered.compile)
            self.state, self.step_count, resumed_data_state = made.result()
        else:
            self.state, self.step_count, resumed_data_state = made.result()
            self._compiled_step = lowered.compile()
            compilation.release_freed_host_memory()
        if resume:  # checkpoints it skipped or passed over move out of the way of this run's saves
            moved = self.checkpointer.set_aside(self.step_count)
            if moved:
                self.log(f"checkpoints newer than step {self.step_count} moved to {moved[0].parent}: "
                         + ", ".join(p.name for p in moved))
        # The block of rows this process's devices hold (all processes of a pipeline's stages hold the same).
        rows_index, rows_count = sharding.batch_rows_of_process(self.mesh, self.global_batch, cfg.train.seq_len)
        self.data = build_source(
            cfg.data, vocab_size=cfg.model.vocab_size, global_batch=self.global_batch,
            seq_len=cfg.train.seq_len, process_index=rows_index, process_count=rows_count)
        if resumed_data_state and hasattr(self.data, "restore"):  # the files source continues from it
            self.data.restore(resumed_data_state)
        self.eval_data, self._eval_step = None, None
        if cfg.train.eval_every:
            self.eval_data = build_source(
                cfg.data, vocab_size=cfg.model.vocab_size, global_batch=self.global_batch,
                seq_len=cfg.train.seq_len, process_index=rows_index, process_count=rows_count, split="eval")
            self._eval_step = jax.jit(
                lambda params, batch, fp8_state: eval_step(params, batch, model=self.model, fp8_state=fp8_state),
                in_shardings=(self.state_sharding.params, self.batch_sharding, self.state_sharding.fp8),
                out_shardings=sharding.replicated(self.mesh))
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
        try:
            write_config_json(self.cfg, self.mesh, f"{self.cfg.output_dir}/config.json")
        except OSError as error:
            raise config_lib.UserError(
                f"cannot write {self.cfg.output_dir}/config.json ({error.strerror}); "
                "set output_dir to a writable directory") from None
        self._record_pending = False

    def context(self):
        """The mesh and logical-axis rules that the model's sharding constraints resolve against."""
        stack = contextlib.ExitStack()
        stack.enter_context(jax.set_mesh(self.mesh))
        stack.enter_context(nn.logical_axis_rules(sharding.LOGICAL_RULES))
        return stack

    def _lower_step(self, abstract):
        """The train step lowered from shapes alone (no state needed yet); tracing reads this
        thread's mesh context, so it happens here."""
        shape = (self.global_batch, self.cfg.train.seq_len)
        batch = {k: jax.ShapeDtypeStruct(shape, dtype, sharding=self.batch_sharding)
                 for k, dtype in self._batch_dtypes.items()}
        with self.context():
            return self._train_step.lower(abstract, batch,
                                          optimizer_hyperparameters(self.cfg, self.mesh, abstract=True))

    def _restore_state(self, resume, abstract):
        """(state, its step, the data position saved with it) from checkpoint `resume`, each array
        directly in its sharding."""
        state, data_state, step = self.checkpointer.restore(resume, abstract)
        self.log(f"resumed from {resume.manager.directory}/{step}")
        return state, int(data_state["step"]), data_state

    def _fresh_state(self, init_lowered, key, abstract):
        """(state, 0, None): the lowered init program compiled and run (every array made in its
        sharding), optionally with parameters from another run."""
        n_values = sum(x.size for x in jax.tree_util.tree_leaves(abstract.params))
        state = compilation.run_init(init_lowered, key, n_values)
        if self.cfg.checkpoint.load_params_from:
            from maxtext_rocm.checkpoint import restore_params

            state = state.replace(params=restore_params(self.cfg.checkpoint.load_params_from, abstract.params))
            self.log(f"parameters from {self.cfg.checkpoint.load_params_from}; fresh optimizer at step 0")
        return state, 0, None

    def save_checkpoint(self) -> None:
        """Starts an asynchronous save of the current state (all processes must call it); stops
        the run (TrainingDiverged) if the state holds inf/NaN or the skipped-steps limit is hit."""
        from maxtext_rocm.checkpoint import NonFiniteState

        self.commit_run_record()  # checkpoints of this launch's config: its record goes with them
        step, in_a_row = (int(x) for x in jax.device_get((self.state.step, self.state.skipped_in_a_row)))
        data_state = self.data.state() if hasattr(self.data, "state") else {}
        data_state = data_state if data_state.get("step") == step else {}  # else: replayed up to step
        try:
            self.checkpointer.save(step, self.state, {**data_state, "step": step}, self.cfg.model)
        except NonFiniteState as error:
            newest = self.checkpointer.manager.latest_step()
            raise TrainingDiverged(f"{error}; " + (f"checkpoint {newest} is the newest good one" if newest is not None
                                                   else "no checkpoint was written before")) from None
        if self._skip_limit_reached(in_a_row):  # saved above: the frozen state is the last good one
            self.checkpointer.wait()
            raise self._skipped_too_many(step)

    def _skip_limit_reached(self, in_a_row: int) -> bool:
        return self.cfg.train.on_nonfinite == "skip" and in_a_row >= self.cfg.train.max_skipped_steps

    def _skipped_too_many(self, step: int) -> TrainingDiverged:
        limit = self.cfg.train.max_skipped_steps
        saved = f"checkpoint {step} holds the last good state" if self.checkpointer else "nothing was saved"
        return TrainingDiverged(
            f"the loss or gradients were inf/NaN in {limit} steps in a row (steps {step - limit + 1}-{step}, "
            f"train.max_skipped_steps={limit}); {saved} (lower optimizer.lr and resume from an earlier "
            "checkpoint, or raise train.max_skipped_steps to skip on)")

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
        """This process's rows of a batch, assembled into one global sharded array each."""
        return {k: jax.make_array_from_process_local_data(self.batch_sharding, np.asarray(v, self._batch_dtypes[k]),
                                                          (self.global_batch, *np.shape(v)[1:]))
                for k, v in host.items()}

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

        SIGTERM or SIGINT finishes the current step, checkpoints it and returns, with the signal
        in `stopped_by_signal`; a second signal exits at once.
        """
        end = self.cfg.train.steps if steps is None else self.step_count + steps
        logged, mark_time, mark_step = None, None, self.step_count
        with PreemptionGuard() as preemption:
            while self.step_count < end and not preemption.requested(self.step_count):
                step_metrics = self.step()
                if self.checkpointer:
                    self.checkpointer.poll()  # a failed background save stops the run now, not at the next
                if mark_time is None:
                    # Time from the end of this call's first step (the Trainer's first includes compilation).
                    jax.block_until_ready(step_metrics)
                    if self._started is not None:
                        loaded = compilation.cache_hits() - self._cache_hits_before
                        how = (f"{loaded} compiled program{'s' * (loaded > 1)} loaded from {self.compilation_cache}"
                               if loaded else "includes compilation")
                        self.log(f"first step done {time.perf_counter() - self._started:.1f}s after the "
                                 f"trainer started ({how})")
                        self._started = None
                    mark_time, mark_step = time.perf_counter(), self.step_count
                stopping = preemption.requested(self.step_count)
                if self.checkpointer and (
                        stopping or self.checkpointer.should_save(self.step_count, self.cfg.train.steps)):
                    self.save_checkpoint()
                if self.eval_data is not None and self.step_count % self.cfg.train.eval_every == 0:
                    jax.block_until_ready(step_metrics)  # eval time stays out of the step time
                    eval_started = time.perf_counter()
                    evaluated = self.evaluate()
                    mark_time += time.perf_counter() - eval_started
                    self.writer.write(self.step_count, evaluated)
                    self.log(f"step {self.step_count}: eval loss {evaluated['eval_loss']:.4f}, "
                             f"perplexity {evaluated['eval_perplexity']:.2f}")
                if self.step_count % self.cfg.log.every and self.step_count != end and not stopping:
                    continue
                fetched = jax.device_get(step_metrics)  # the only host sync, on logging steps
                now, timed_steps = time.perf_counter(), self.step_count - mark_step
                step_time = (now - mark_time) / timed_steps if timed_steps else None
                mark_time, mark_step = now, self.step_count
                logged = self._summarise(fetched, step_time)
                self.writer.write(self.step_count, logged)
                if self.is_logger:
                    self.log(metrics_lib.format_line(self.step_count, self.cfg.train.steps, logged))
                if fetched["nonfinite_steps"] and self.cfg.train.on_nonfinite == "stop":
                    self._stop_on_nonfinite()
                if self._skip_limit_reached(int(fetched["skipped_in_a_row"])):
                    if self.checkpointer:
                        self.save_checkpoint()  # raises, once the last good state is saved
                    raise self._skipped_too_many(int(jax.device_get(self.state.step)))
            self.stopped_by_signal = preemption.signal
        self.profiler.stop(self.state)  # a trace still open when the run ends early
        if self.checkpointer:
            if self.stopped_by_signal is not None:  # the signal may have come between two steps
                self.save_checkpoint()
            self.checkpointer.wait()
        return logged

    def _stop_on_nonfinite(self):
        """The state froze at the last good step (see step.train_step): keep it and stop."""
        good_step = int(jax.device_get(self.state.step))
        if self.checkpointer:
            self.save_checkpoint()
            self.checkpointer.wait()
        raise TrainingDiverged(
            f"the loss or gradients became inf/NaN after step {good_step}; "
            + (f"checkpoint {good_step} holds the last good state" if self.checkpointer else "nothing was saved")
            + " (train.on_nonfinite='skip' would drop such steps and go on)")

    def _summarise(self, step_metrics: dict, step_time: float | None) -> dict:
        """The logged row for the step just taken."""
        tokens_per_s = tflops = None
        if step_time:
            tokens_per_s = self.global_batch * self.cfg.train.seq_len / step_time / self.n_devices
            tflops = self.flops_per_token * tokens_per_s / 1e12
        row = {
            "loss": float(step_metrics["loss"]), "lr": float(step_metrics["lr"]),
            "grad_norm": float(step_metrics["grad_norm"]), "step_time_s": step_time,
            "tokens_per_s_per_device": tokens_per_s, "tflops_per_s_per_device": tflops,
            "mfu": metrics_lib.mfu(tflops, self.peak_tflops) if tflops else None,
            "nonfinite_steps": int(step_metrics["nonfinite_steps"]),
        }
        if self.cfg.train.z_loss_weight:
            row["z_loss"] = float(step_metrics["z_loss"])
        if self.cfg.model.n_experts > 1:  # router losses, unweighted (a dense model has none)
            row["moe_aux_loss"] = float(step_metrics["moe_aux_loss"])
            row["moe_z_loss"] = float(step_metrics["moe_z_loss"])
        return row

    def _fp8_description(self) -> str:
        if not self.policy.fp8_format:
            return ""
        e4m3, e5m2 = (jax.numpy.dtype(t).name for t in fp8.FORMATS[self.policy.fp8_format])
        return f" ({self.policy.fp8_format}: {e4m3}/{e5m2}, {self.cfg.precision.fp8_scaling} scaling)"

    def describe(self) -> str:
        from maxtext_rocm.models import count_active_params, count_params
        from maxtext_rocm.models.moe import resolve_implementation

        cfg = self.cfg
        moe = (f" ({count_active_params(cfg) / 1e6:,.1f}M active; {cfg.model.n_experts} experts, "
               f"top {cfg.model.experts_per_token}, moe_impl {resolve_implementation(cfg.model.moe_impl)})"
               if cfg.model.n_experts > 1 else "")
        return "\n".join([
            f"run {cfg.name}: {count_params(cfg) / 1e6:,.1f}M parameters{moe}, {cfg.model.n_layers} layers, "
            f"policy {self.policy.name}{self._fp8_description()}, remat {cfg.model.remat}, "
            f"attention {cfg.model.attention}; {pipeline.describe(cfg.pipeline, self.mesh.shape['stage'])}",
            f"devices: {self.n_devices} x {jax.devices()[0].device_kind} ({jax.default_backend()}), "
            f"mesh {sharding.describe(self.mesh)}",
            f"batch: {self.global_batch} x {cfg.train.seq_len} tokens"
            f"{f' in {cfg.train.grad_accum} micro-batches' if cfg.train.grad_accum > 1 else ''}; "
            f"data: {self.data.describe()}",
            f"FLOPs: {self.flops_per_token / 1e9:.3f} GFLOP/token; {metrics_lib.FLOPS_CONVENTION}",
            f"MFU peak: {f'{self.peak_tflops} TFLOP/s/device' if self.peak_tflops else 'unknown for this device (set log.peak_tflops)'}",
            f"output: {cfg.output_dir}; compilation cache: {self.compilation_cache or 'off'}",
        ])


def main(argv: list[str] | None = None) -> int:
    status = _main(sys.argv[1:] if argv is None else argv)
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
