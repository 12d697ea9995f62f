"""The training entry point: `python -m maxtext_rocm.train CONFIG.py[:VARIANT] [--config.KEY=VALUE ...]`.

Reads top to bottom: build the mesh, the model, the optimizer and the sharded state; then loop
over steps, fetching metrics from the device only every `log.every` steps.
"""

from __future__ import annotations

import contextlib
import functools
import sys
import time

import jax
import ml_collections
import numpy as np
from flax import linen as nn

from maxtext_rocm import config as config_lib
from maxtext_rocm import metrics as metrics_lib
from maxtext_rocm import sharding
from maxtext_rocm.data import build_source
from maxtext_rocm.models import build_model
from maxtext_rocm.optim import build_optimizer
from maxtext_rocm.precision import policy_from_config
from maxtext_rocm.run_info import write_config_json
from maxtext_rocm.step import create_state, train_step

USAGE = "usage: python -m maxtext_rocm.train CONFIG.py[:VARIANT] [--config.GROUP.KEY=VALUE ...]"


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
        self.mesh = sharding.make_mesh(cfg.mesh, devices)
        self.n_devices = len(devices)
        self.is_logger = jax.process_index() == 0
        self.policy = policy_from_config(cfg.precision)
        self.model = build_model(cfg.model, self.policy)
        self.tx, self.schedule = build_optimizer(cfg.optimizer, cfg.train.steps)
        self.global_batch = config_lib.global_batch_size(cfg, self.n_devices)

        self.state, self.state_sharding = self._init_state()
        self.batch_sharding = sharding.batch_sharding(self.mesh)
        self._train_step = jax.jit(
            functools.partial(train_step, model=self.model, tx=self.tx, schedule=self.schedule,
                              train_cfg=ml_collections.FrozenConfigDict(cfg.train)),
            in_shardings=(self.state_sharding, self.batch_sharding),
            out_shardings=(self.state_sharding, sharding.replicated(self.mesh)),
            donate_argnums=0)
        self.data = build_source(
            cfg.data, vocab_size=cfg.model.vocab_size, global_batch=self.global_batch,
            seq_len=cfg.train.seq_len, process_index=jax.process_index(),
            process_count=jax.process_count())
        self.step_count = 0

        self.flops_per_token = metrics_lib.train_flops_per_token(cfg.model, cfg.train.seq_len)
        self.peak_tflops = metrics_lib.peak_tflops(
            devices[0].device_kind, self.policy.name, cfg.log.peak_tflops)
        if self.is_logger:
            try:
                write_config_json(cfg, self.mesh, f"{cfg.output_dir}/config.json")
            except OSError as error:
                raise config_lib.UserError(
                    f"cannot write {cfg.output_dir}/config.json ({error.strerror}); "
                    "set output_dir to a writable directory") from None
        self.writer = metrics_lib.MetricsWriter(
            cfg.output_dir, enabled=self.is_logger, tensorboard=cfg.log.tensorboard)

    def context(self):
        """The mesh and logical-axis rules that the model's sharding constraints resolve against."""
        stack = contextlib.ExitStack()
        stack.enter_context(jax.set_mesh(self.mesh))
        stack.enter_context(nn.logical_axis_rules(sharding.LOGICAL_RULES))
        return stack

    def _init_state(self):
        init = functools.partial(create_state, model=self.model, tx=self.tx,
                                 batch_shape=(1, min(self.cfg.train.seq_len, 8)))
        key = jax.random.key(self.cfg.train.seed)
        abstract = jax.eval_shape(init, key)
        state_sharding = sharding.logical_to_sharding(nn.get_partition_spec(abstract), self.mesh)
        # Created directly in its sharding: no device ever holds the whole model.
        init_jit = jax.jit(lambda k: nn.meta.unbox(init(k)), out_shardings=state_sharding)
        # Init runs once: on the CPU, LLVM's optimisation of its RNG code costs more than it saves
        # (tiny_llama: 3.1 s -> 1.4 s to compile, +0.15 s to run). Integer RNG bits are unchanged.
        options = {"xla_backend_optimization_level": 0} if jax.default_backend() == "cpu" else None
        state = init_jit.lower(key).compile(compiler_options=options)(key)
        return state, state_sharding

    def device_batch(self, step: int) -> dict[str, jax.Array]:
        """This process's rows of the step's batch, assembled into one global sharded array each."""
        host = self.data.batch(step)
        return {k: jax.make_array_from_process_local_data(self.batch_sharding, np.asarray(v))
                for k, v in host.items()}

    def step(self):
        """One optimizer step. Returns the step's metrics as device arrays (no host sync)."""
        batch = self.device_batch(self.step_count)
        with self.context():
            self.state, step_metrics = self._train_step(self.state, batch)
        self.step_count += 1
        return step_metrics

    def run(self, steps: int | None = None) -> dict | None:
        """Trains `steps` more steps (default: up to train.steps); returns the last logged metrics."""
        end = self.cfg.train.steps if steps is None else self.step_count + steps
        logged, losses = None, []  # losses: device scalars since the last log, fetched together
        mark_time = mark_step = None
        while self.step_count < end:
            step_metrics = self.step()
            losses.append(step_metrics["loss"])
            if mark_time is None:
                # The first step includes compilation: wait for it once and time from its end.
                jax.block_until_ready(step_metrics)
                self.log(f"first step done {time.perf_counter() - self._started:.1f}s after the trainer "
                         "started (includes compilation)")
                mark_time, mark_step = time.perf_counter(), self.step_count
            if self.step_count % self.cfg.log.every and self.step_count != end:
                continue
            fetched, losses = jax.device_get((step_metrics, losses)), []  # the only host sync
            now, timed_steps = time.perf_counter(), self.step_count - mark_step
            step_time = (now - mark_time) / timed_steps if timed_steps else None
            mark_time, mark_step = now, self.step_count
            logged = self._summarise(*fetched, step_time)
            self.writer.write(self.step_count, logged)
            if self.is_logger:
                self.log(metrics_lib.format_line(self.step_count, self.cfg.train.steps, logged))
        return logged

    def _summarise(self, step_metrics: dict, losses: list, step_time: float | None) -> dict:
        """The logged row: loss averaged over the steps since the last log, the rest of this step."""
        tokens_per_s = tflops = None
        if step_time:
            tokens_per_s = self.global_batch * self.cfg.train.seq_len / step_time / self.n_devices
            tflops = self.flops_per_token * tokens_per_s / 1e12
        row = {
            "loss": float(np.mean(losses)), "lr": float(step_metrics["lr"]),
            "grad_norm": float(step_metrics["grad_norm"]), "step_time_s": step_time,
            "tokens_per_s_per_device": tokens_per_s, "tflops_per_s_per_device": tflops,
            "mfu": metrics_lib.mfu(tflops, self.peak_tflops) if tflops else None,
        }
        if self.cfg.train.z_loss_weight:
            row["z_loss"] = float(step_metrics["z_loss"])
        return row

    def describe(self) -> str:
        from maxtext_rocm.models import count_params

        cfg = self.cfg
        return "\n".join([
            f"run {cfg.name}: {count_params(cfg) / 1e6:,.1f}M parameters, {cfg.model.n_layers} layers, "
            f"policy {self.policy.name}, remat {cfg.model.remat}",
            f"devices: {self.n_devices} x {jax.devices()[0].device_kind} ({jax.default_backend()}), "
            f"mesh {sharding.describe(self.mesh)}",
            f"batch: {self.global_batch} x {cfg.train.seq_len} tokens"
            f"{f' in {cfg.train.grad_accum} micro-batches' if cfg.train.grad_accum > 1 else ''}; "
            f"data: {self.data.describe()}",
            f"FLOPs: {self.flops_per_token / 1e9:.3f} GFLOP/token; {metrics_lib.FLOPS_CONVENTION}",
            f"MFU peak: {f'{self.peak_tflops} TFLOP/s/device' if self.peak_tflops else 'unknown for this device (set log.peak_tflops)'}",
            f"output: {cfg.output_dir}",
        ])


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help") or argv[0].startswith("--"):
        print(USAGE, file=sys.stderr)
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    try:
        cfg = config_lib.load(argv[0], argv[1:])
        trainer = Trainer(cfg)
        print(trainer.describe(), flush=True)
        trainer.run()
        trainer.writer.close()
    except config_lib.UserError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
