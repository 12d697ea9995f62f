"""Will it fit? Ahead-of-time compile of the real train step for a target GPU node, on this CPU.
This module is the command line (`main`) and what the command prints, described; the work is in
analysis.py (the compile and its FitReport, fit_report.py), batch_search.py, formatting.py,
estimates.py (the formula below), comm.py and gpu_nodes.py beside it.

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

import dataclasses
import json
import sys

from maxtext_rocm import config as config_lib
# The planner's parts, reached from here by the command, the tests and scripts (and stubbed here by
# tests/test_docs.py, which is why main reads them as this module's names):
from maxtext_rocm.planner.analysis import analyse
from maxtext_rocm.planner.batch_search import REMAT_ORDER, search  # noqa: F401
from maxtext_rocm.planner.estimates import analytic_activations  # noqa: F401 - the estimate's home is there
from maxtext_rocm.planner.fit_report import FitReport  # noqa: F401
from maxtext_rocm.planner.formatting import format_report
from maxtext_rocm.planner.gpu_nodes import (TARGETS, cluster_mesh, flash_attention_for,  # noqa: F401
                                            force_host_devices, parse_target, target_nodes)
from maxtext_rocm.planner import comm as comm_lib
from maxtext_rocm.planner import plan as plan_lib

PLAN_COMPILES = 4  # --plan's default --max-compiles: the few best by the estimate
# What --plan chooses itself, so a flag that sets it contradicts the question.
PLAN_CHOOSES = ("--config.mesh.", "--config.pipeline.microbatches", "--config.pipeline.schedule",
                "--config.pipeline.weight_gather", "--config.model.remat")

USAGE = ("usage: python -m maxtext_rocm.compile CONFIG.py[:VARIANT] --target=KIND:N|KIND:NODESxGPUS "
         f"[--search] [--comm] [--plan] [--max-compiles=K] [--usable=0.92] [--json OUT] [--config.KEY=VALUE ...]; "
         f"KIND is one of {', '.join(TARGETS)}")


def plan_refusal(options: dict, overrides: list[str]) -> str | None:
    """The one sentence refusing a flag that --plan cannot take, or None."""
    if options["search"] or options["comm"]:
        flag = "--search" if options["search"] else "--comm"
        return (f"--plan compiles its best layouts with their communication and fit already; drop {flag}, "
                "or drop --plan to check one layout")
    chosen = [o.split("=", 1)[0] for o in overrides if o.startswith(PLAN_CHOOSES)]
    if chosen:
        return ("--plan chooses the mesh, the pipeline's microbatches, schedule and weight gathering, and the remat "
                "policy itself; "
                f"drop {chosen[0]}, or drop --plan to check that layout")
    return None


def number_refusal(options: dict) -> str | None:
    """The one sentence refusing a --max-compiles or --usable that is not a number of its kind, or None."""
    if options["max-compiles"] is not None and not options["max-compiles"].isdigit():
        return f"--max-compiles={options['max-compiles']!r} is not valid; use a whole number of compiles, 0 or more"
    try:
        usable = float(options["usable"])
    except ValueError:
        usable = None
    if usable is None or not 0 < usable <= 1:
        return f"--usable={options['usable']!r} is not valid; use the share of each GPU's memory to plan for, in (0, 1]"
    return None


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help") or argv[0].startswith("--"):
        print(USAGE, file=sys.stderr)
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    spec, rest = argv[0], argv[1:]
    options = {"target": None, "search": False, "comm": False, "plan": False, "max-compiles": None, "usable": "0.92",
               "json": None}
    overrides, i = [], 0
    while i < len(rest):
        arg = rest[i]
        name = arg[2:].split("=", 1)[0] if arg.startswith("--") else None
        if arg.startswith("--config."):
            overrides.append(arg)
            if "=" not in arg and i + 1 < len(rest):
                overrides.append(rest[i + 1])
                i += 1
        elif name in ("search", "comm", "plan") and "=" not in arg:
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
    refusal = number_refusal(options)
    if refusal:
        print(f"error: {refusal}", file=sys.stderr)
        return 2
    try:
        kind, n = parse_target(options["target"] or "")
        usable = float(options["usable"])
        max_compiles = int(options["max-compiles"] or (PLAN_COMPILES if options["plan"] else 2))
    except ValueError as error:
        print(f"error: {error}" if options["target"] else f"error: --target is required\n{USAGE}", file=sys.stderr)
        return 2
    if options["plan"]:
        refusal = plan_refusal(options, overrides)
        if refusal:
            print(f"error: {refusal}", file=sys.stderr)
            return 2
    force_host_devices(n, dump_hlo=options["comm"] or options["plan"])  # before jax starts a backend: nothing above starts one
    try:
        cfg = config_lib.load(spec, overrides)
        nodes = target_nodes(options["target"])
        if options["plan"]:
            found = plan_lib.make_plan(cfg, spec, kind, nodes, n // nodes, usable, max_compiles, overrides,
                                       analyse=analyse, log=print)
            print(plan_lib.format_plan(found), flush=True)
            if options["json"]:
                with open(options["json"], "w") as f:
                    json.dump(dataclasses.asdict(found), f, indent=2)
            return 0
        asked_microbatches = cfg.pipeline.microbatches  # analyse resolves auto for the configured batch
        report = analyse(cfg, kind, n, usable, comm=options["comm"], nodes=nodes)
        if options["search"] or not report.fits:
            report.search = search(cfg, kind, n, usable, max_compiles, nodes=nodes, microbatches=asked_microbatches)
    except config_lib.UserError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(format_report(report), flush=True)
    if report.comm is not None:
        print(comm_lib.format_report(report.comm), flush=True)
    if options["json"]:
        with open(options["json"], "w") as f:
            json.dump(report.to_json(), f, indent=2)
    return 0
