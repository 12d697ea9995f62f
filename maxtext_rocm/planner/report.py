"""Will it fit? Ahead-of-time compile of the real train step for a target GPU node, on this CPU.

    python -m maxtext_rocm.compile CONFIG.py[:VARIANT] --target=mi355x:8 [--search] [--comm] [--json OUT]
                                   [--config.GROUP.KEY=VALUE ...]

The train step (`launch.jit_train_step`, the one the Trainer runs) is lowered and compiled against
abstract arrays (`jax.ShapeDtypeStruct` with their shardings) on N fake CPU devices, so nothing
is allocated. Printed per device:

- parameters, optimizer state, gradients: exact, from the shapes, dtypes and shardings;
- activations and temporaries, two ways, side by side:
  * "XLA (CPU)": `compiled.memory_analysis()` of the CPU executable (temp buffers minus the
    gradients). The CPU's buffer assignment is not a GPU's: it upcasts bf16/fp8 matmuls to fp32,
    has no latency-hiding scheduler and no GPU fusions, so it usually over-states the GPU's need.
  * "analytic (GPU)": the formula below, from the model's dimensions and the remat policy;
- FLOPs per step (analytic, `metrics.train_flops_per_token`: `cost_analysis()` counts a scanned
  layer once), and the compiled step's own dot FLOPs per device (comm.py's HLO walk, loops x trip
  counts) against what the one formula says it should run: remat's recompute, a pipeline's bubble
  and its LM head on every stage included (maxtext_rocm/planner/estimates.py);
- the temporaries of the checkpoint checksum program (checksums.py) on this state: XLA's memory
  analysis; it runs between steps, beside the state only;
- under a pipeline (mesh stage > 1), every figure is one device of one stage: its L/S layers, the
  GPipe loop's saved iterations, the stage's share of the embedding and head (planner/estimates.py);
- the verdict against the target's memory (times `--usable`, default 0.92: the runtime and the
  allocator keep some), decided on the analytic GPU estimate; the XLA CPU figure is printed with it.

Analytic activation estimate per device, bytes (c = compute dtype bytes: 4 fp32, 2 bf16/fp8;
T = tokens per device per micro-batch; b = sequences per device; s = seq_len; t = tensor shards;
L = layers; d = d_model; q = n_heads*head_dim/t; kv = 2*n_kv_heads*head_dim/t; f = mlp_dim/t for a
dense model, experts_per_token * capacity_factor * mlp_dim/t for MoE; S = b*(n_heads/t)*s^2, the
attention scores of the "xla" implementation; a flash attention ("cudnn", fused; "blockwise", XLA
ops over key blocks) keeps only b*(n_heads/t)*s fp32 softmax statistics instead):

    layer_all   = T*c*(4d + 2q + kv + 3f) + S*(4 + c)      every tensor of one layer's forward
    saved/layer = full:      T*d*c                          (the block input only)
                  minimal:   T*c*(2d + q + kv + 2f) + T*d*c (matmuls without batch dims)
                  save_dots: minimal + S*4 + T*q*c          (+ the attention einsums)
                  none:      layer_all
    activations = L*saved + 2*layer_all (one layer recomputed + its gradients)
                  + T_c*V/t*(c + 8) + 4*d*V/t               (a loss chunk's logits: fp32, fp32
                                                             softmax, gradient in c; the fp32 sum
                                                             of the head's gradient)
    with T_c = T * loss chunk / s (maxtext_rocm/numerics/cross_entropy.py); unchunked (model.loss_chunk_len=0
    or an fp8 LM head): T_c = T and no separate head-gradient sum.
                  + 2*one layer's parameters in fp32 when they are sharded (FSDP all-gather, prefetched)

`--comm` adds the communication report of the compiled step (maxtext_rocm/planner/comm.py): every
collective per kind and mesh axis, bytes per device per step, beside the layout's analytic minimum
(maxtext_rocm/planner/comm_minimum.py, formula printed) and the time at the target's link bandwidths.
`--target=KIND:NODESxGPUS` (e.g. mi355x:2x8) plans the mesh as NODES hosts of GPUS devices would
(`mesh.dcn.*` axes across hosts), so DCN bytes are reported apart from ICI.

`--search` (and any config that does not fit) looks for the largest per-device batch that fits
under each remat policy by the estimate, then confirms the recommendation with a real compile
(at most `--max-compiles`, so the search stays bounded in time).
"""

from __future__ import annotations

import copy
import json
import math
import sys
import time

from maxtext_rocm.planner.gpu_nodes import (FNUZ_TARGETS, TARGETS, cluster_mesh, dumped_optimized_hlo, flash_attention_for,
                                  force_host_devices, parse_target, target_nodes)

from maxtext_rocm.planner.estimates import analytic_activations  # noqa: F401 - the estimate's home is there
from maxtext_rocm.trainer.preflight import check_run

GIB = 2 ** 30
USAGE = ("usage: python -m maxtext_rocm.compile CONFIG.py[:VARIANT] --target=KIND:N|KIND:NODESxGPUS "
         f"[--search] [--comm] [--max-compiles=K] [--usable=0.92] [--json OUT] [--config.KEY=VALUE ...]; "
         f"KIND is one of {', '.join(TARGETS)}")
# Least recomputation first: the first policy that fits is the fastest one that fits.
REMAT_ORDER = ("none", "save_dots", "minimal", "full")


# ----------------------------------------------------------------------------------------------
# Bytes from shapes


def _sharded_bytes(tree) -> int:
    import jax
    total = 0
    for leaf in jax.tree_util.tree_leaves(tree):
        shape = leaf.sharding.shard_shape(leaf.shape) if leaf.sharding is not None else leaf.shape
        total += math.prod(shape) * leaf.dtype.itemsize
    return total


def _checksum_temp_bytes(abstract, mesh) -> int | None:
    """Temporaries per device of the program that checksums the state at each checkpoint save
    (maxtext_rocm/checkpoint/checksums.py), compiled on the abstract state: XLA's memory analysis."""
    import jax

    from maxtext_rocm.checkpoint import checksums

    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    mem = checksums.summariser(replicated).lower(jax.tree_util.tree_leaves(abstract)).compile().memory_analysis()
    return None if mem is None else mem.temp_size_in_bytes


# ----------------------------------------------------------------------------------------------
# The compile


def analyse(cfg, kind: str, n_devices: int, usable: float = 0.92, compile_it: bool = True,
            comm: bool = False, nodes: int = 1) -> dict:
    """Lowers and compiles the train step for `n_devices` (fake CPU devices) on `nodes` hosts;
    returns a report."""
    import jax
    import jax.numpy as jnp

    from maxtext_rocm.planner import estimates
    from maxtext_rocm import config as config_lib
    from maxtext_rocm.reporting import metrics
    from maxtext_rocm.parallel import sharding
    from maxtext_rocm.parallel import context, pipeline
    from maxtext_rocm.trainer.launch import (jit_train_step, model_for_mesh, optimizer_hyperparameters, resolve_auto,
                                             stored_state)

    if cfg.precision.policy == "fp8" and cfg.precision.fp8_format == "auto":
        cfg.precision.fp8_format = "fnuz" if kind in FNUZ_TARGETS else "ocp"
    if cfg.model.attention == "auto":  # the target's, as the Trainer would resolve it there
        cfg.model.attention = flash_attention_for(kind)
    devices = jax.devices()[:n_devices]
    check_run(cfg, n_devices, nodes)
    mesh = sharding.make_mesh(cfg.mesh, devices) if nodes == 1 else cluster_mesh(cfg.mesh, devices, nodes)
    sizes = config_lib.axis_sizes(config_lib.mesh_shape(cfg.mesh, n_devices, nodes))
    policy = resolve_auto(cfg, mesh, devices[0], platform="gpu")  # every target is a GPU
    cpu_model_cfg = copy.deepcopy(cfg.model)
    if cpu_model_cfg.attention == "cudnn":  # same parameters; the CPU cannot trace cuDNN's attention
        cpu_model_cfg.attention = "xla"
    elif cpu_model_cfg.attention == "pallas":  # on the CPU Pallas is an interpreter: the same
        cpu_model_cfg.attention = "blockwise"  # flash algorithm in XLA ops stands in for it
    # The target's program: a GPU's MoE exchange and grouped GEMMs, not the CPU's stand-ins.
    model = model_for_mesh(cfg, policy, mesh, platform="gpu", model_cfg=cpu_model_cfg)
    layout = stored_state(cfg, model, mesh)
    abstract, state_sharding, stack = layout.abstract, layout.sharding, layout.storage_order
    batch_sharding = sharding.batch_sharding(mesh)

    state_bytes = {
        "params": _sharded_bytes(abstract.params),
        "opt_state": _sharded_bytes(abstract.opt_state),
        "fp8_state": _sharded_bytes(abstract.fp8) + _sharded_bytes((abstract.step, abstract.nonfinite_steps)),
    }
    # Gradients have the parameters' shapes, dtypes and shardings; accumulating micro-batches
    # keeps a running sum beside each micro-batch's gradients.
    grads = state_bytes["params"] * (2 if cfg.train.grad_accum > 1 else 1)
    fsdp_sharded = sizes["fsdp"] * sizes["sequence"] * sizes["expert"] > 1
    microbatches = cfg.pipeline.microbatches if sizes["stage"] > 1 else 1
    act = estimates.analytic_activations(cfg, sizes, n_devices, microbatches)
    act["gathered_weights"] = 2 * estimates.layer_param_bytes(cfg, sizes) if fsdp_sharded else 0.0
    if sizes["stage"] > 1 and cfg.pipeline.schedule == "circular" and cfg.pipeline.repeats > 1:
        # The chunk a stage runs changes per iteration, so the loop's autodiff saves its weights
        # (this device's share, 1/R of its slots) once per iteration (parallel/pipeline.py).
        iterations, _ = estimates.loop_shape(cfg.pipeline, cfg.model.n_layers, sizes["stage"], microbatches)
        split = estimates.per_stage(abstract.params, sizes["stage"])["layer_param_bytes"]
        act["circular chunk weights"] = iterations * split / cfg.pipeline.repeats
    analytic_act = sum(act.values())
    analytic_total = sum(state_bytes.values()) + grads + analytic_act
    capacity = TARGETS[kind] * GIB
    report = {
        "config": cfg.name, "target": f"{kind}:{n_devices}", "policy": cfg.precision.policy,
        "fp8_format": cfg.precision.fp8_format if cfg.precision.policy == "fp8" else None,
        "mesh": sharding.describe(mesh), "remat": cfg.model.remat,
        "per_device_batch_size": cfg.train.per_device_batch_size, "seq_len": cfg.train.seq_len,
        "grad_accum": cfg.train.grad_accum, "target_memory_bytes": capacity, "usable_fraction": usable,
        **{f"{k}_bytes": v for k, v in state_bytes.items()}, "gradients_bytes": grads,
        "analytic_activations_bytes": analytic_act,
        "analytic_activation_terms_bytes": act,
        "analytic_total_bytes": analytic_total,
        "flops_per_token": metrics.train_flops_per_token(cfg.model, cfg.train.seq_len),
    }
    global_batch = config_lib.global_batch_size(cfg, n_devices)
    report["flops_per_step"] = report["flops_per_token"] * global_batch * cfg.train.seq_len
    peak = metrics.peak_tflops(kind, "fp8" if cfg.precision.policy == "fp8" else "bf16")
    report["peak_tflops_per_device"] = peak
    if stack is not None:
        # A pipeline that stores the layer stack in its own order (circular, padded) saves
        # checkpoints in model order: between two steps (no gradients or activations live) the
        # state's layer leaves exist twice while a save converts them.
        flags = jax.tree_util.tree_leaves(stack.flags)
        layer_state = sum(_sharded_bytes(x) for x, f in zip(jax.tree_util.tree_leaves(abstract), flags) if f)
        report["checkpoint_save_peak_bytes"] = sum(state_bytes.values()) + layer_state
    report["fits"] = max(analytic_total, report.get("checkpoint_save_peak_bytes", 0)) <= usable * capacity
    if cfg.model.n_experts > 1:
        from maxtext_rocm.models.moe import resolve_implementation
        report["moe_impl"] = resolve_implementation(cfg.model.moe_impl)
    if sizes["stage"] > 1:  # schedule, microbatches, bubble; every figure above is one stage's device
        report["pipeline"] = pipeline.describe(cfg.pipeline, sizes["stage"], cfg.model.n_layers)
        report["stages"] = estimates.per_stage(abstract.params, sizes["stage"])
    report["analytic_dot_flops"] = estimates.analytic_device_flops(cfg, sizes, n_devices, microbatches)
    if not compile_it:
        return report

    if cfg.model.attention in ("cudnn", "pallas"):  # the CPU cannot lower these GPU kernels
        report["xla_note"] = (f"XLA (CPU) compiled model.attention={cpu_model_cfg.attention!r} "
                              f"in place of {cfg.model.attention!r}")
    batch_dtypes = {"inputs": jnp.int32, "targets": jnp.int32, "weights": jnp.float32}
    batch_dtypes = context.mesh_layout(cfg.model, mesh).batch_dtypes(batch_dtypes)  # + positions if balanced
    batch = {name: jax.ShapeDtypeStruct((global_batch, cfg.train.seq_len), dtype, sharding=batch_sharding)
             for name, dtype in batch_dtypes.items()}
    step = jit_train_step(cfg, model, mesh, state_sharding, batch_sharding)
    started = time.perf_counter()
    with sharding.rules_context(mesh):
        lowered = step.lower(abstract, batch, optimizer_hyperparameters(cfg, mesh, abstract=True))
        try:
            compiled = lowered.compile()
            hlo = compiled.as_text()  # its dot FLOPs are always counted; its collectives under --comm
        except Exception as error:  # noqa: BLE001 - only XLA:CPU's missing GPU collective is expected
            if "ragged-all-to-all" not in str(error):
                raise
            # The GPU's expert exchange: XLA optimizes and partitions the whole program, then
            # XLA:CPU cannot emit code for the ragged all-to-all. The optimized HLO is what counts.
            compiled, hlo = None, dumped_optimized_hlo() if comm else None
            report["xla_note"] = ("XLA:CPU cannot finish compiling the GPU program (its ragged all-to-all has "
                                  "no CPU code): no XLA memory figures" +
                                  ("; communication counted on XLA's dump of the optimized program" if hlo else ""))
    report["compile_s"] = time.perf_counter() - started
    if hlo:
        from maxtext_rocm.planner import comm as comm_lib
        layout = comm_lib.MeshLayout.of(mesh, config_lib.mesh_shape(cfg.mesh, n_devices, nodes), compiled)
        counted = comm_lib.account(hlo, layout)
        report["compiled_dot_flops"] = counted["dot_flops"]
        report["compiled_flops_lower_bound"] = bool(counted["unknown_trip_count_dot_loops"])
        if comm:
            repeats = cfg.pipeline.repeats if cfg.pipeline.schedule == "circular" else 1
            report["comm"] = comm_lib.report(hlo, layout, cfg.model, cfg.train, cfg.precision.policy, kind,
                                             microbatches, counted, repeats=repeats)
    checksum_temp = report["checkpoint_checksum_temp_bytes"] = _checksum_temp_bytes(abstract, mesh)
    if checksum_temp is not None:  # between steps, at a save: the state and the checksum's temporaries
        report["fits"] = report["fits"] and sum(state_bytes.values()) + checksum_temp <= usable * capacity
    if compiled is None:
        return report
    mem = compiled.memory_analysis()
    if mem is not None:
        args, out = mem.argument_size_in_bytes, mem.output_size_in_bytes
        alias, temp = mem.alias_size_in_bytes, mem.temp_size_in_bytes
        report.update(xla_argument_bytes=args, xla_output_bytes=out, xla_alias_bytes=alias,
                      xla_temp_bytes=temp, xla_total_bytes=args + out - alias + temp,
                      xla_activations_bytes=max(temp - grads, 0))
        report["xla_fits"] = report["xla_total_bytes"] <= usable * capacity
    return report


def search(cfg, kind: str, n_devices: int, usable: float, max_compiles: int, log=print, nodes: int = 1,
           microbatches: int | None = None) -> dict:
    """Largest per-device batch that fits for each remat policy (by the estimate), confirmed by
    compiling at most `max_compiles` candidates. `microbatches`: the pipeline.microbatches the user
    asked for, where `cfg` has been through analyse (which resolves 0, auto, for its own batch):
    each trial batch resolves it afresh."""
    def with_(remat, batch, attention=None):
        trial = copy.deepcopy(cfg)
        trial.model.remat, trial.train.per_device_batch_size, trial.train.grad_accum = remat, batch, 1
        trial.model.attention = attention or cfg.model.attention
        if microbatches is not None:
            trial.pipeline.microbatches = microbatches
        return trial

    def largest_by_remat(attention=None):
        largest = {}
        for remat in REMAT_ORDER:
            best, batch = None, 1
            while batch <= 256:
                if not analyse(with_(remat, batch, attention), kind, n_devices, usable, compile_it=False,
                               nodes=nodes)["fits"]:
                    break
                best, batch = batch, batch * 2
            largest[remat] = best
        return largest

    largest = largest_by_remat()
    wanted = cfg.train.per_device_batch_size
    fitting = [r for r in REMAT_ORDER if largest[r] and largest[r] >= wanted]
    result = {"largest_batch_by_remat": largest,
              "remat_for_configured_batch": fitting[0] if fitting else None,
              "largest_batch": max((b for b in largest.values() if b), default=None)}
    result["largest_batch_remat"] = next((r for r in REMAT_ORDER if largest[r] == result["largest_batch"]), None)
    confirmed = []
    candidates = []
    if result["remat_for_configured_batch"]:
        candidates.append((result["remat_for_configured_batch"], wanted))
    if result["largest_batch"] and (result["largest_batch_remat"], result["largest_batch"]) not in candidates:
        candidates.append((result["largest_batch_remat"], result["largest_batch"]))
    for remat, batch in candidates[:max_compiles]:
        log(f"  confirming remat={remat} per_device_batch_size={batch} by compiling ...")
        r = analyse(with_(remat, batch), kind, n_devices, usable, nodes=nodes)
        confirmed.append({"remat": remat, "per_device_batch_size": batch, "compile_s": r.get("compile_s"),
                          "analytic_total_bytes": r["analytic_total_bytes"],
                          "xla_total_bytes": r.get("xla_total_bytes"), "fits": r["fits"]})
    result["confirmed"] = confirmed
    if result["largest_batch"] is None and cfg.model.attention == "xla":
        result["flash_attention"] = flash_attention_for(kind)
        result["largest_batch_by_remat_flash"] = largest_by_remat(result["flash_attention"])
    return result


# ----------------------------------------------------------------------------------------------
# Report


def _gib(x) -> str:
    return "n/a" if x is None else f"{x / GIB:8.2f} GiB"


def format_report(r: dict) -> str:
    cap = r["target_memory_bytes"]
    lines = [
        f"{r['config']} on {r['target']} ({r['target'].split(':')[0].upper()}: {cap / GIB:.0f} GiB each, "
        f"{100 * r['usable_fraction']:.0f}% usable); mesh {r['mesh']}; policy {r['policy']}"
        + (f" ({r['fp8_format']})" if r.get("fp8_format") else "")
        + (f"; moe_impl {r['moe_impl']}" if r.get("moe_impl") else "")
        + (f"; {r['pipeline']}" if r.get("pipeline") else ""),
        f"batch {r['per_device_batch_size']}/device x {r['seq_len']} tokens"
        + (f" in {r['grad_accum']} micro-batches" if r["grad_accum"] > 1 else "") + f"; remat {r['remat']}"
        + (f"; compiled in {r['compile_s']:.1f} s" if "compile_s" in r else ""),
        "per device                      analytic (GPU)       XLA (CPU buffer assignment)",
        f"  parameters                    {_gib(r['params_bytes'])}         (in the arguments)",
        f"  optimizer state               {_gib(r['opt_state_bytes'])}         (in the arguments)",
        f"  fp8 scales + counters         {_gib(r['fp8_state_bytes'])}         (in the arguments)",
        f"  gradients                     {_gib(r['gradients_bytes'])}         (in the temporaries)",
        f"  activations + temporaries     {_gib(r['analytic_activations_bytes'])}     "
        f"{_gib(r.get('xla_activations_bytes'))} (temporaries - gradients)",
        f"  total                         {_gib(r['analytic_total_bytes'])}     "
        f"{_gib(r.get('xla_total_bytes'))} (arguments + outputs - donated + temporaries)",
        f"  target                        {_gib(cap)}     usable {_gib(r['usable_fraction'] * cap)}",
        "  (analytic activations: " + ", ".join(f"{k} {v / GIB:.1f} GiB" for k, v in
                                               r["analytic_activation_terms_bytes"].items()) + ")",
    ]
    if r.get("xla_note"):
        lines.append(f"  ({r['xla_note']})")
    if r.get("stages"):
        st = r["stages"]
        lines.append(f"per stage ({st['stages']} stages, every figure above is one device of one stage; all "
                     f"stages alike, so the worst is any): parameters split over stage {_gib(st['layer_param_bytes']).strip()}, "
                     f"on every stage {_gib(st['other_param_bytes']).strip()}: {st['note']}")
    if r.get("checkpoint_save_peak_bytes"):
        lines.append(f"checkpoint save peak (state + its layer leaves converted to model order, between steps): "
                     f"{_gib(r['checkpoint_save_peak_bytes']).strip()}")
    if r.get("checkpoint_checksum_temp_bytes") is not None:
        state = r["params_bytes"] + r["opt_state_bytes"] + r["fp8_state_bytes"]
        lines.append(f"checkpoint checksum (at each save, XLA CPU): {r['checkpoint_checksum_temp_bytes']:,} bytes of "
                     f"temporaries per device, {r['checkpoint_checksum_temp_bytes'] / state:.2g} x the state")
    flops = r["flops_per_step"]
    n = int(r["target"].split(":")[1])
    timing = ""
    if r.get("peak_tflops_per_device"):
        timing = f"; >= {flops / n / (r['peak_tflops_per_device'] * 1e12):.3f} s/step at 100% MFU"
    lines.append(f"FLOPs: {flops / 1e15:.2f} PFLOP/step ({flops / n / 1e12:.1f} TFLOP/device, "
                 f"{r['flops_per_token'] / 1e9:.2f} GFLOP/token, analytic 6N + attention){timing}")
    if "compiled_dot_flops" in r and r["analytic_dot_flops"]:
        a = r["analytic_dot_flops"]
        bubble = (f" x the pipeline loop's slot-iterations per real layer pass (bubble, empty slots) = "
                  f"{a['bubble_factor']:.3f} on the layers" if a["bubble_factor"] > 1 else "")
        head = (f", LM head on every stage ({a['redundant_head'] / 1e12:.3f} TFLOP/device redundant)"
                if a["redundant_head"] else "")
        lines.append(f"compiled dot FLOPs per device per step: {r['compiled_dot_flops'] / 1e12:.3f} TFLOP vs analytic "
                     f"{a['total'] / 1e12:.3f} TFLOP (6N + attention"
                     f"{' + ' + a['remat'] + ' remat recompute' if a['terms']['remat recompute'] else ''}"
                     f"{' + masked attention' if a['terms']['masked attention'] else ''}{bubble}{head}): ratio "
                     f"{r['compiled_dot_flops'] / a['total']:.3f}"
                     + (" (a LOWER bound: dots inside loops without a known trip count, e.g. the blockwise "
                        "attention's, count once)" if r["compiled_flops_lower_bound"] else ""))
    agree = ""
    if "xla_fits" in r:
        agree = ("; the XLA CPU figure agrees" if r["xla_fits"] == r["fits"] else
                 f"; the XLA CPU figure says it would {'' if r['xla_fits'] else 'not '}fit (CPU buffers "
                 "upcast bf16/fp8 matmuls and are not scheduled for memory like a GPU's)")
    lines.append(f"verdict: {'FITS' if r['fits'] else 'DOES NOT FIT'} "
                 f"({r['analytic_total_bytes'] / GIB:.1f} of {r['usable_fraction'] * cap / GIB:.1f} GiB usable, "
                 f"analytic GPU estimate){agree}")
    s = r.get("search")
    if s:
        by = ", ".join(f"{k}: {v or 'none'}" for k, v in s["largest_batch_by_remat"].items())
        lines.append(f"largest per-device batch that fits, by remat policy (estimate): {by}")
        if s["remat_for_configured_batch"]:
            lines.append(f"remat policy that fits batch {r['per_device_batch_size']} with the least recomputation: "
                         f"{s['remat_for_configured_batch']}")
        elif s["largest_batch"]:
            lines.append(f"batch {r['per_device_batch_size']} fits under no remat policy; "
                         f"largest that fits: {s['largest_batch']} with remat={s['largest_batch_remat']}")
        else:
            need = (r["params_bytes"] + r["opt_state_bytes"] + r["gradients_bytes"]) * n
            min_devices = math.ceil(need / (r["usable_fraction"] * cap))
            flash = s.get("largest_batch_by_remat_flash") or {}
            if need / n <= r["usable_fraction"] * cap:
                lines.append(f"no batch fits under any remat policy: state (parameters, optimizer, gradients) "
                             f"takes {need / n / GIB:.1f} GiB/device and one {r['seq_len']}-token sequence's "
                             "activations the rest; use more devices, mesh.ici.tensor or mesh.ici.sequence, "
                             "or a shorter train.seq_len")
                if any(flash.values()):
                    remat = next(k for k in REMAT_ORDER if flash[k])
                    by_flash = ", ".join(f"{k}: {v or 'none'}" for k, v in flash.items())
                    lines.append(f"with flash attention (model.attention='{s['flash_attention']}') it would fit "
                                 f"by the estimate: batch {flash[remat]} with remat={remat} "
                                 f"(largest by remat: {by_flash})")
            else:
                lines.append(f"no batch fits under any remat policy: parameters, optimizer state and gradients "
                             f"alone need {need / GIB:,.0f} GiB in all, i.e. at least {min_devices} "
                             f"{r['target'].split(':')[0].upper()}s with FSDP (before activations)")
        for c in s["confirmed"]:
            lines.append(f"  compiled remat={c['remat']} batch={c['per_device_batch_size']}: "
                         f"{c['analytic_total_bytes'] / GIB:.1f} GiB analytic, "
                         f"{_gib(c['xla_total_bytes']).strip()} XLA CPU, {c['compile_s']:.1f} s")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help") or argv[0].startswith("--"):
        print(USAGE, file=sys.stderr)
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    spec, rest = argv[0], argv[1:]
    options = {"target": None, "search": False, "comm": False, "max-compiles": "2", "usable": "0.92", "json": None}
    overrides, i = [], 0
    while i < len(rest):
        arg = rest[i]
        name = arg[2:].split("=", 1)[0] if arg.startswith("--") else None
        if arg.startswith("--config."):
            overrides.append(arg)
            if "=" not in arg and i + 1 < len(rest):
                overrides.append(rest[i + 1])
                i += 1
        elif name in ("search", "comm") and "=" not in arg:
            options[name] = True
        elif name in options:
            if "=" in arg:
                options[name] = arg.split("=", 1)[1]
            elif i + 1 < len(rest):
                options[name] = rest[i + 1]
                i += 1
        else:
            print(f"error: unexpected argument {arg!r}\n{USAGE}", file=sys.stderr)
            return 2
        i += 1
    try:
        kind, n = parse_target(options["target"] or "")
        usable, max_compiles = float(options["usable"]), int(options["max-compiles"])
    except ValueError as error:
        print(f"error: {error}" if options["target"] else f"error: --target is required\n{USAGE}", file=sys.stderr)
        return 2
    force_host_devices(n, dump_hlo=options["comm"])

    from maxtext_rocm import config as config_lib

    try:
        cfg = config_lib.load(spec, overrides)
        nodes = target_nodes(options["target"])
        asked_microbatches = cfg.pipeline.microbatches  # analyse resolves auto for the configured batch
        report = analyse(cfg, kind, n, usable, comm=options["comm"], nodes=nodes)
        if options["search"] or not report["fits"]:
            report["search"] = search(cfg, kind, n, usable, max_compiles, nodes=nodes,
                                      microbatches=asked_microbatches)
    except config_lib.UserError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(format_report(report), flush=True)
    if "comm" in report:
        from maxtext_rocm.planner import comm as comm_lib
        print(comm_lib.format_report(report["comm"]), flush=True)
    if options["json"]:
        with open(options["json"], "w") as f:
            json.dump(report, f, indent=2)
    return 0
