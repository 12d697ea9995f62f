"""The analysis behind `python -m maxtext_rocm.compile`: the train step lowered and compiled for a
target's devices on fake CPU devices, against abstract arrays, and the `FitReport` of it (state
bytes from the shardings, the activation estimate, FLOPs, XLA's memory analysis, the collectives).

jax is imported at the top: importing it starts no backend, and force_host_devices (which the
command calls before anything here runs) only needs to come before the first backend starts."""

from __future__ import annotations

import math
import time

import jax
import jax.numpy as jnp
import ml_collections

from maxtext_rocm import config as config_lib
from maxtext_rocm.checkpoint import checksums
from maxtext_rocm.parallel import context, pipeline, sharding
from maxtext_rocm.parallel.pipeline.layout import loss_on_the_last_stage
from maxtext_rocm.planner import comm as comm_lib
from maxtext_rocm.planner import comm_minimum
from maxtext_rocm.planner import estimates
from maxtext_rocm.planner.hlo_text import optimized_text
from maxtext_rocm.planner.fit_report import GIB, AnalyticMemory, Compiled, FitReport, Flops, Setup, XlaMemory
from maxtext_rocm.planner.gpu_nodes import TARGETS, cluster_mesh, dumped_optimized_hlo, resolve_target
from maxtext_rocm.reporting import metrics
from maxtext_rocm.trainer.launch import (jit_train_step, model_for_mesh, optimizer_hyperparameters, run_policy,
                                         stored_state)
from maxtext_rocm.trainer.preflight import check_run
from maxtext_rocm.resolve import resolve


def _sharded_bytes(tree) -> int:
    total = 0
    for leaf in jax.tree_util.tree_leaves(tree):
        shape = leaf.sharding.shard_shape(leaf.shape) if leaf.sharding is not None else leaf.shape
        total += math.prod(shape) * leaf.dtype.itemsize
    return total


def _checksum_temp_bytes(abstract, mesh) -> int | None:
    """Temporaries per device of the program that checksums the state at each checkpoint save
    (maxtext_rocm/checkpoint/checksums.py), compiled on the abstract state: XLA's memory analysis."""
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    mem = checksums.summariser(replicated).lower(jax.tree_util.tree_leaves(abstract)).compile().memory_analysis()
    return None if mem is None else mem.temp_size_in_bytes


def analyse(cfg, kind: str, n_devices: int, usable: float = 0.92, compile_it: bool = True,
            comm: bool = False, nodes: int = 1) -> FitReport:
    """Lowers and compiles the train step for `n_devices` (fake CPU devices) on `nodes` hosts;
    returns its report. `compile_it=False`: the estimates only (no compile, no XLA figures)."""
    devices = jax.devices()[:n_devices]
    check_run(cfg, n_devices, nodes, inputs=False)  # a plan needs no data on this machine
    mesh = sharding.make_mesh(cfg.mesh, devices) if nodes == 1 else cluster_mesh(cfg.mesh, devices, nodes)
    sizes = config_lib.axis_sizes(config_lib.mesh_shape(cfg.mesh, n_devices, nodes))
    cfg = resolve(cfg, mesh, resolve_target(kind))  # as the Trainer would resolve it on the target
    policy = run_policy(cfg, devices[0], platform="gpu")  # every target is a GPU
    cpu_model_cfg = ml_collections.ConfigDict(cfg.model.to_dict())
    if cpu_model_cfg.attention == "cudnn":  # same parameters; the CPU cannot trace cuDNN's attention
        cpu_model_cfg.attention = "xla"
    elif cpu_model_cfg.attention == "pallas":  # on the CPU Pallas is an interpreter: the same
        cpu_model_cfg.attention = "blockwise"  # flash algorithm in XLA ops stands in for it
    # The target's program: a GPU's MoE exchange and grouped GEMMs, not the CPU's stand-ins.
    model = model_for_mesh(cfg, policy, mesh, platform="gpu", model_cfg=cpu_model_cfg)
    layout = stored_state(cfg, model, mesh)
    abstract, state_sharding, storage_order = layout.abstract, layout.sharding, layout.storage_order
    batch_sharding = sharding.batch_sharding(mesh)

    trained = _sharded_bytes(abstract.params)
    # A LoRA run's frozen base (compute dtype) counts as parameters, but has no gradients.
    params = trained + _sharded_bytes(getattr(abstract, "frozen", {}))
    # Gradients have the trained parameters' shapes, dtypes and shardings; accumulating
    # micro-batches keeps a running sum beside each micro-batch's gradients.
    grads = trained * (2 if cfg.train.grad_accum > 1 else 1)
    microbatches = cfg.pipeline.microbatches if sizes["stage"] > 1 else 1
    act = estimates.analytic_activations(cfg, sizes, n_devices, microbatches)
    act.update(estimates.weight_gather_terms(cfg, sizes))
    stages = (estimates.per_stage(abstract.params, sizes["stage"], loss_on_the_last_stage(cfg))
              if sizes["stage"] > 1 else None)
    if stages and cfg.pipeline.schedule == "circular" and cfg.pipeline.repeats > 1:
        # The chunk a stage runs changes per iteration, so the loop's autodiff saves its weights
        # (this device's share, 1/R of its slots) once per iteration (parallel/pipeline/).
        iterations, _ = estimates.loop_shape(cfg.pipeline, cfg.model.n_layers, sizes["stage"], microbatches)
        act["circular chunk weights"] = iterations * stages.layer_param_bytes / cfg.pipeline.repeats
    opt_state = _sharded_bytes(abstract.opt_state)
    fp8_state = _sharded_bytes(abstract.fp8) + _sharded_bytes((abstract.step, abstract.nonfinite_steps))
    memory = AnalyticMemory(
        params_bytes=params, opt_state_bytes=opt_state, fp8_state_bytes=fp8_state, gradients_bytes=grads,
        analytic_activations_bytes=sum(act.values()), analytic_activation_terms_bytes=act,
        analytic_total_bytes=params + opt_state + fp8_state + grads + sum(act.values()))
    setup = Setup(
        config=cfg.name, target=f"{kind}:{n_devices}", policy=cfg.precision.policy,
        fp8_format=cfg.precision.fp8_format if cfg.precision.policy == "fp8" else None,
        mesh=sharding.describe(mesh), remat=cfg.model.remat, per_device_batch_size=cfg.train.per_device_batch_size,
        seq_len=cfg.train.seq_len, grad_accum=cfg.train.grad_accum, target_memory_bytes=TARGETS[kind] * GIB,
        usable_fraction=usable)
    global_batch = config_lib.global_batch_size(cfg, n_devices)
    flops_per_token = metrics.train_flops_per_token(cfg.model, cfg.train.seq_len)
    flops = Flops(flops_per_token=flops_per_token, flops_per_step=flops_per_token * global_batch * cfg.train.seq_len,
                  peak_tflops_per_device=metrics.peak_tflops(kind, "fp8" if cfg.precision.policy == "fp8" else "bf16"),
                  analytic_dot_flops=estimates.analytic_device_flops(cfg, sizes, n_devices, microbatches))
    if storage_order is not None:
        # A pipeline that stores the layer stack in its own order (circular, padded) or the
        # table and head on their stages (1f1b) saves checkpoints in model order: between two
        # steps (no gradients or activations live) those leaves exist twice while a save converts them.
        flags = jax.tree_util.tree_leaves(storage_order.converted)
        layer_state = sum(_sharded_bytes(x) for x, f in zip(jax.tree_util.tree_leaves(abstract), flags) if f)
        memory.checkpoint_save_peak_bytes = memory.state_bytes + layer_state
    report = FitReport(
        setup=setup, memory=memory, flops=flops,
        fits=max(memory.analytic_total_bytes, memory.checkpoint_save_peak_bytes or 0) <= setup.usable_bytes,
        moe_impl=cfg.model.moe_impl if cfg.model.n_experts > 1 else None,
        # schedule, microbatches, bubble; every figure above is one stage's device
        pipeline=pipeline.describe(cfg.pipeline, sizes["stage"], cfg.model.n_layers) if stages else None,
        stages=stages)
    if not compile_it:
        return report

    note = None
    if cfg.model.attention in ("cudnn", "pallas"):  # the CPU cannot lower these GPU kernels
        note = f"XLA (CPU) compiled model.attention={cpu_model_cfg.attention!r} in place of {cfg.model.attention!r}"
    batch_dtypes = {"inputs": jnp.int32, "targets": jnp.int32, "weights": jnp.float32}
    if cfg.train.objective == "grpo":  # scored samples: each row's advantage (data.batch_spec)
        batch_dtypes["advantages"] = jnp.float32
    batch_dtypes = context.mesh_layout(cfg.model, mesh).batch_dtypes(batch_dtypes)  # + positions if balanced
    batch = {name: jax.ShapeDtypeStruct((global_batch, cfg.train.seq_len), dtype, sharding=batch_sharding)
             for name, dtype in batch_dtypes.items()}
    step = jit_train_step(cfg, model, mesh, state_sharding, batch_sharding)
    started = time.perf_counter()
    with sharding.rules_context(mesh):
        lowered = step.lower(abstract, batch, optimizer_hyperparameters(cfg, mesh, abstract=True))
        try:
            compiled = lowered.compile()
            hlo = optimized_text(compiled)  # its dot FLOPs are always counted; its collectives under --comm
        except Exception as error:  # noqa: BLE001 - only XLA:CPU's missing GPU collective is expected
            if "ragged-all-to-all" not in str(error):
                raise
            # The GPU's expert exchange: XLA optimizes and partitions the whole program, then
            # XLA:CPU cannot emit code for the ragged all-to-all. The optimized HLO is what counts.
            compiled, hlo = None, dumped_optimized_hlo() if comm else None
            note = ("XLA:CPU cannot finish compiling the GPU program (its ragged all-to-all has "
                    "no CPU code): no XLA memory figures" +
                    ("; communication counted on XLA's dump of the optimized program" if hlo else ""))
    report.compiled = Compiled(compile_s=time.perf_counter() - started, note=note)
    if hlo:
        layout = comm_lib.MeshLayout.of(mesh, config_lib.mesh_shape(cfg.mesh, n_devices, nodes), compiled)
        counted = comm_lib.account(hlo, layout)
        flops.compiled_dot_flops = counted["dot_flops"]
        flops.compiled_flops_lower_bound = bool(counted["unknown_trip_count_dot_loops"])
        if comm:
            report.comm = comm_lib.report(hlo, layout, cfg.model, cfg.train, cfg.precision.policy, kind,
                                          microbatches, counted, comm_minimum.pipeline_options(cfg.pipeline))
    checksum_temp = memory.checkpoint_checksum_temp_bytes = _checksum_temp_bytes(abstract, mesh)
    if checksum_temp is not None:  # between steps, at a save: the state and the checksum's temporaries
        report.fits = report.fits and memory.state_bytes + checksum_temp <= setup.usable_bytes
    mem = compiled.memory_analysis() if compiled is not None else None
    if mem is not None:
        args, out = mem.argument_size_in_bytes, mem.output_size_in_bytes
        alias, temp = mem.alias_size_in_bytes, mem.temp_size_in_bytes
        total = args + out - alias + temp
        report.compiled.memory = XlaMemory(argument_bytes=args, output_bytes=out, alias_bytes=alias, temp_bytes=temp,
                                           total_bytes=total, activations_bytes=max(temp - grads, 0),
                                           fits=total <= setup.usable_bytes)
    return report
