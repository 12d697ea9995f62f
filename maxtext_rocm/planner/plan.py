"""`python -m maxtext_rocm.compile CONFIG --target=KIND:NODESxGPUS --plan`: which layout to run.

Three steps, cheapest first:

1. enumerate (`enumerate_layouts`): every mesh that makes sense for the model and the target:
   tensor (dividing the heads), sequence (dividing seq_len), expert (dividing the experts), data,
   fsdp and, on one node, stage over a node's GPUs (ICI); data, fsdp and stage over the nodes
   (DCN); under stage, the microbatches that split a batch shard evenly, as many as the stages or
   more (the bubble (S-1)/(M+S-1)), and each schedule of SCHEDULES: GPipe, whose activations grow
   with the loop's M + S - 1 iterations, 1f1b, which keeps at most 2S - 1 microbatches' for the
   same FLOPs, or gpipe_recompute, which keeps one stage input per microbatch for one more forward
   of the stack, and interleaved 1f1b (INTERLEAVED_REPEATS), whose bubble is (S-1)/(R M+S-1);
   where the stage's weights are ZeRO-3 sharded, each gathered per microbatch and once a step
   (pipeline.weight_gather: fewer bytes for the stage's weights held whole); and each remat policy;
2. estimate (`estimate`) each one without building the model: per device, the state from the
   parameter counts and the layout's shardings (fp32 parameters, Adam's two moments, gradients;
   compile.py's exact figure replaces it for those compiled), the activations of
   planner/estimates.py, the dot FLOPs the step runs (6N + attention + remat's recompute +
   the bubble's iterations, estimates.analytic_device_flops) at 50% of the target's peak, and the
   layout's communication minimum (planner/comm_minimum.py, GPU dtypes) at the target's link
   bandwidths (comm.LINKS: ICI and DCN one after the other, no overlap). Each mesh keeps its
   least-recomputing remat policy and schedule that fits, once per weight gathering (so a layout
   whose gathered weights do not fit once compiled leaves its per-microbatch form ranked); what
   does not fit is dropped;
3. compile the best few (`--max-compiles`, default 4): the real train step on fake devices
   (analysis.analyse with --comm), whose exact state and activation estimate decide the fit and
   whose measured collectives replace the minimum (scaled to GPU dtypes by the minimum's own
   GPU/CPU ratio per link, as XLA:CPU shows bf16 collectives as f32).

Ranked by compute + communication (no overlap: an upper bound on the step; a layout that hides
its communication behind compute gains most where communication is largest), fitting first,
compiled before estimated. The bubble is in the compute figure already (the idle iterations run
the layers on dropped data) and is printed apart.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import time

from maxtext_rocm import config as config_lib
from maxtext_rocm.config.choices import feed_forward_dim
from maxtext_rocm.parallel import pipeline as pipeline_lib
from maxtext_rocm.planner import comm as comm_lib
from maxtext_rocm.planner import comm_minimum, estimates
from maxtext_rocm.planner.batch_search import REMAT_ORDER
from maxtext_rocm.planner.fit_report import GIB
from maxtext_rocm.planner.gpu_nodes import TARGETS
from maxtext_rocm.reporting import metrics
from maxtext_rocm.trainer.preflight import check_run

MFU = 0.5  # the compute figure's assumed model FLOPs utilization
MAX_MICROBATCH_CHOICES = 3
# The pipeline schedules a plan weighs, cheapest compute first. Circular is left out: it would
# need pipeline.repeats chosen as well, and its chunk weights saved per iteration (estimates.py).
# gpipe and 1f1b run the same FLOPs (1f1b keeps at most 2S - 1 microbatches' residuals where
# gpipe keeps M + S - 1 iterations'), gpipe_recompute one more forward of the stack. A schedule
# the config refuses (1f1b without the fused head loss) is dropped with the layout's other refusals.
SCHEDULES = ("gpipe", "1f1b", "gpipe_recompute")
# Interleaved 1F1B (pipeline.repeats under 1f1b, parallel/pipeline/one_f_one_b_order.py): the bubble
# (S-1)/(R M+S-1) for R times the stage boundaries' activation traffic; weighed at these R where
# the layers give every virtual stage one and the microbatches come in whole groups of the stages.
INTERLEAVED_REPEATS = (2,)
# pipeline.weight_gather choices a plan weighs where the stage's weights are ZeRO-3 sharded.
# gradient_reduce="once" is left out: refused under 1f1b, MoE, fp8 and context parallelism, and on
# jax 0.11 and later, so a plan would differ by the installed jax.
WEIGHT_GATHERS = ("per_iteration", "once")


@dataclasses.dataclass(frozen=True)
class Layout:
    """One candidate: mesh sizes over ICI and DCN, the pipeline's microbatches and schedule, the
    remat policy."""
    ici: tuple[tuple[str, int], ...]  # (axis, size) for every axis of size > 1
    dcn: tuple[tuple[str, int], ...]
    microbatches: int  # 0 without a pipeline
    remat: str
    schedule: str = "gpipe"  # pipeline.schedule; meaningless without a pipeline
    weight_gather: str = "per_iteration"  # pipeline.weight_gather; likewise
    repeats: int = 1  # pipeline.repeats (interleaved 1f1b); likewise

    @property
    def stages(self) -> int:
        return dict(self.ici).get("stage", 1) * dict(self.dcn).get("stage", 1)

    def overrides(self) -> list[str]:
        """The --config flags that select it (fsdp always named: its default -1 fills the rest)."""
        ici = {"fsdp": 1, **dict(self.ici)}
        flags = [f"--config.mesh.ici.{a}={n}" for a, n in ici.items()]
        flags += [f"--config.mesh.dcn.{a}={n}" for a, n in self.dcn]
        if self.stages > 1:
            flags += [f"--config.pipeline.schedule={self.schedule}",
                      f"--config.pipeline.microbatches={self.microbatches}"]
            if self.weight_gather != "per_iteration":
                flags.append(f"--config.pipeline.weight_gather={self.weight_gather}")
            if self.repeats > 1:
                flags.append(f"--config.pipeline.repeats={self.repeats}")
        return flags + [f"--config.model.remat={self.remat}"]

    def describe(self) -> str:
        parts = [f"ici {' x '.join(f'{a}={n}' for a, n in self.ici) or 'none'}"]
        if self.dcn:
            parts.append(f"dcn {' x '.join(f'{a}={n}' for a, n in self.dcn)}")
        if self.stages > 1:
            interleaved = f" interleaved x{self.repeats}" if self.repeats > 1 else ""
            parts.append(f"{self.schedule}{interleaved}, {self.microbatches} microbatches")
            if self.weight_gather == "once":
                parts.append("stage weights gathered once")
        return ", ".join(parts) + f", remat {self.remat}"


@dataclasses.dataclass
class Candidate:
    """A layout's figures per device per step; `compiled` once analyse() has checked it."""
    layout: Layout
    memory_bytes: float  # analytic GPU estimate (exact state once compiled)
    usable_bytes: float
    fits: bool
    compute_s: float  # executed dot FLOPs at MFU x the target's peak
    comm_s: float  # minimum (estimated) or measured (compiled) bytes at link bandwidth, no overlap
    bubble: float  # the pipeline's idle share (0 without one)
    compiled: bool = False
    compile_s: float | None = None
    comm_ratio: float | None = None  # measured / minimum, once compiled (None: the layout needs none)
    comm_described: str = ""  # the measured communication in words, once compiled (comm.describe_ratio)
    command: str = ""

    @property
    def step_s(self) -> float:
        return self.compute_s + self.comm_s


@dataclasses.dataclass
class Plan:
    """What --plan prints: the ranked candidates and how many were looked at."""
    config: str
    target: str
    enumerated: int
    fitting: int
    ranked: list[Candidate]


def _divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


def enumerate_layouts(model_cfg, train_cfg, nodes: int, gpus: int) -> list[Layout]:
    """Every mesh of step 1 (the module docstring), with each remat policy; microbatches are
    filled in by `with_microbatches`."""
    m = model_cfg
    tensors = [t for t in _divisors(gpus) if m.n_heads % t == 0 and m.n_kv_heads % t == 0]
    sequences = [s for s in _divisors(gpus) if s <= 4 and train_cfg.seq_len % (2 * s) == 0]
    experts = [e for e in _divisors(gpus) if m.n_experts > 1 and m.n_experts % e == 0] or [1]
    stages_ici = [p for p in _divisors(gpus) if p <= m.n_layers] if nodes == 1 else [1]
    meshes = set()
    for t in tensors:
        for s in sequences:
            for e in experts:
                for p in stages_ici:
                    for d in (1, 2):
                        if gpus % (t * s * e * p * d):
                            continue
                        ici = {"stage": p, "data": d, "fsdp": gpus // (t * s * e * p * d), "expert": e,
                               "sequence": s, "tensor": t}
                        for dd in _divisors(nodes):
                            for ds in _divisors(nodes // dd):
                                dcn = {"stage": ds, "data": dd, "fsdp": nodes // (dd * ds)}
                                if p * ds > 1 and (p > 1 and ds > 1):
                                    continue  # stages over the nodes or within one, not both
                                meshes.add((tuple((a, n) for a, n in ici.items() if n > 1),
                                            tuple((a, n) for a, n in dcn.items() if n > 1)))
    return [Layout(ici, dcn, 0, remat) for ici, dcn in sorted(meshes) for remat in REMAT_ORDER]


def with_microbatches(layout: Layout, cfg, n_devices: int) -> list[Layout]:
    """A pipelined layout once per microbatch count worth trying, schedule (SCHEDULES) and, where
    a stage's weights are ZeRO-3 sharded (fsdp, sequence or expert), weight gathering
    (WEIGHT_GATHERS): counts that split a batch shard's sequences evenly, at least as many as the
    stages where the batch allows (fewer idle the stages most of the step), the smallest few."""
    S = layout.stages
    if S <= 1:
        return [layout]
    sizes = {**dict(layout.ici)}
    for a, n in layout.dcn:
        sizes[a] = sizes.get(a, 1) * n
    shards = sizes.get("data", 1) * sizes.get("fsdp", 1) * sizes.get("expert", 1)
    sequences = cfg.train.per_device_batch_size * n_devices // (cfg.train.grad_accum * shards)
    choices = [k for k in _divisors(sequences) if k >= S] or [max(_divisors(sequences))]
    zero3 = sizes.get("fsdp", 1) * sizes.get("sequence", 1) * sizes.get("expert", 1) > 1
    gathers = WEIGHT_GATHERS if zero3 else WEIGHT_GATHERS[:1]
    schedules = [(schedule, 1) for schedule in SCHEDULES]
    schedules += [("1f1b", r) for r in INTERLEAVED_REPEATS if cfg.model.n_layers >= S * r]
    return [dataclasses.replace(layout, microbatches=k, schedule=schedule, repeats=r, weight_gather=gather)
            for k in choices[:MAX_MICROBATCH_CHOICES] for schedule, r in schedules for gather in gathers
            if r == 1 or k % S == 0]


def apply(cfg, layout: Layout):
    """A copy of `cfg` set to `layout` (every mesh axis named, so nothing is left to -1)."""
    trial = copy.deepcopy(cfg)
    for axis in config_lib.MESH_AXES:
        trial.mesh.ici[axis] = dict(layout.ici).get(axis, 1)
        trial.mesh.dcn[axis] = dict(layout.dcn).get(axis, 1)
    trial.model.remat = layout.remat
    if layout.stages > 1:
        trial.pipeline.microbatches = layout.microbatches
        trial.pipeline.schedule = layout.schedule
        trial.pipeline.weight_gather = layout.weight_gather
        trial.pipeline.repeats = layout.repeats
    return trial


def _sizes(layout: Layout) -> dict[str, int]:
    sizes = {a: 1 for a in config_lib.MESH_AXES}
    for a, n in (*layout.ici, *layout.dcn):
        sizes[a] *= n
    return sizes


def state_bytes(model_cfg, sizes: dict[str, int], grad_accum: int) -> float:
    """Parameters, Adam's two moments and gradients per device, all fp32, from the parameter
    counts and the layout: a layer's dense weights split by tensor and by its ZeRO group
    (fsdp x sequence x expert), expert weights by expert x tensor x (fsdp x sequence), the layers by
    stage (a stack that does not divide is padded), the embedding and head by fsdp x sequence x
    expert x tensor and replicated over stage (parallel/sharding.py). Norm scales are left out."""
    m = model_cfg
    t, E, S = sizes["tensor"], sizes["expert"], sizes["stage"]
    F, Fe = sizes["fsdp"] * sizes["sequence"] * E, sizes["fsdp"] * sizes["sequence"]
    attention = m.d_model * m.head_dim * (2 * m.n_heads + 2 * m.n_kv_heads)
    if m.n_experts > 1:
        experts = 3 * m.d_model * feed_forward_dim(m) * m.n_experts / (E * t * Fe)
        layer = (attention / t + m.d_model * m.n_experts) / F + experts
    else:
        layer = (attention + 3 * m.d_model * m.mlp_dim) / (t * F)
    slots = math.ceil(m.n_layers / S)
    tables = m.vocab_size * m.d_model * (1 if m.tie_embeddings else 2) / (F * t)
    params = 4 * (slots * layer + tables)
    return params * (1 + 2 + (2 if grad_accum > 1 else 1))


def estimate(cfg, layout: Layout, kind: str, n_devices: int, usable: float) -> Candidate:
    """Step 2 of the module docstring for one layout (no model is built)."""
    trial = apply(cfg, layout)
    sizes = _sizes(layout)
    M = layout.microbatches if layout.stages > 1 else 1
    act = estimates.analytic_activations(trial, sizes, n_devices, M)
    gathered = sum(estimates.weight_gather_terms(trial, sizes).values())
    memory = state_bytes(trial.model, sizes, trial.train.grad_accum) + sum(act.values()) + gathered
    usable_bytes = TARGETS[kind] * GIB * usable
    return Candidate(layout=layout, memory_bytes=memory, usable_bytes=usable_bytes, fits=memory <= usable_bytes,
                     compute_s=compute_seconds(trial, sizes, n_devices, M, kind),
                     comm_s=minimum_seconds(trial, sizes, M, kind, layout), bubble=bubble(trial, layout))


def bubble(cfg, layout: Layout) -> float:
    if layout.stages <= 1:
        return 0.0
    return pipeline_lib.bubble_fraction(cfg.pipeline.schedule, layout.stages, layout.microbatches, cfg.pipeline.repeats)


def compute_seconds(cfg, sizes, n_devices: int, microbatches: int, kind: str) -> float:
    """The dot FLOPs one device runs per step (estimates.analytic_device_flops; for a MoE model its
    active experts, as metrics counts them) at MFU x the target's peak (bf16's for fp32 too)."""
    peak = metrics.peak_tflops(kind, "fp8" if cfg.precision.policy == "fp8" else "bf16")
    dense = copy.deepcopy(cfg)
    if dense.model.n_experts > 1:  # the formula of the active parameters, as a dense model's
        dense.model.mlp_dim = feed_forward_dim(dense.model) * dense.model.experts_per_token
        dense.model.moe_mlp_dim = 0
        dense.model.n_experts = 1
    flops = estimates.analytic_device_flops(dense, sizes, n_devices, microbatches)
    return flops.total / (MFU * peak * 1e12)


def minimum_seconds(cfg, sizes, microbatches: int, kind: str, layout: Layout) -> float:
    """The layout's communication minimum in the GPU's dtypes at the target's link bandwidths."""
    least = comm_minimum.minimum(cfg.model, cfg.train, cfg.precision.policy, sizes, microbatches=microbatches,
                                 **comm_minimum.pipeline_options(cfg.pipeline))
    dcn = {a for a, _ in layout.dcn}
    links = {"ICI": 0.0, "DCN": 0.0}
    for term in least["terms"]:
        links["DCN" if any(a in dcn for a in term["axes"].split(",")) else "ICI"] += term["gpu_bytes"]
    return comm_lib.link_seconds(links, kind)


def measured_seconds(comm_report: dict, layout: Layout, kind: str) -> float:
    """A compiled step's collectives at link bandwidth, per link scaled from the CPU's dtypes to the
    GPU's by the minimum's own ratio (XLA:CPU shows bf16 collectives as f32)."""
    dcn = {a for a, _ in layout.dcn}
    cpu, gpu = {"ICI": 0.0, "DCN": 0.0}, {"ICI": 0.0, "DCN": 0.0}
    for term in comm_report["minimum"]["terms"]:
        link = "DCN" if any(a in dcn for a in term["axes"].split(",")) else "ICI"
        cpu[link] += term["cpu_bytes"]
        gpu[link] += term["gpu_bytes"]
    scaled = {link: b * (gpu[link] / cpu[link] if cpu[link] else 1.0)
              for link, b in comm_report["bytes_by_link"].items()}
    return comm_lib.link_seconds(scaled, kind)


def rank_key(c: Candidate):
    """Fitting first, then compiled before estimated (an estimate may not survive its compile),
    then the shorter step (compute + communication, no overlap)."""
    return (not c.fits, not c.compiled, c.step_s)


def _recompute_key(c: Candidate):
    """The fewest FLOPs first (remat policies and gpipe_recompute's stage recompute only add
    forwards; interleaving shortens the bubble's), ties (none and save_dots) to the earlier policy,
    then to the earlier schedule (GPipe, then 1f1b), then to fewer repeats."""
    return c.compute_s, REMAT_ORDER.index(c.layout.remat), SCHEDULES.index(c.layout.schedule), c.layout.repeats


def prune(candidates: list[Candidate]) -> list[Candidate]:
    """The fitting candidates, each mesh (and microbatch count, and weight gathering) at its
    least-recomputing remat policy and schedule that fits (more recompute on the same mesh only
    adds compute), best first. Both weight gatherings stay: the stage's weights held whole may not
    fit once compiled, and then the per-microbatch form is the mesh's row. Interleaved and plain
    schedules stay apart too: interleaving buys compute (a shorter bubble) with communication (R
    times the stage boundaries' activations), which the ranking, not the pruning, weighs."""
    best = {}
    for c in candidates:
        if not c.fits:
            continue
        key = (c.layout.ici, c.layout.dcn, c.layout.microbatches, c.layout.weight_gather, c.layout.repeats > 1)
        if key not in best or _recompute_key(c) < _recompute_key(best[key]):
            best[key] = c
    return sorted(best.values(), key=rank_key)


def make_plan(cfg, spec: str, kind: str, nodes: int, gpus: int, usable: float, max_compiles: int,
              user_overrides: list[str], analyse=None, log=print) -> Plan:
    """Steps 1-3: enumerate, estimate and prune, compile the best `max_compiles` (with `analyse`,
    analysis.analyse, passed in so the tests can count its calls)."""
    n = nodes * gpus
    layouts = [x for layout in enumerate_layouts(cfg.model, cfg.train, nodes, gpus)
               for x in with_microbatches(layout, cfg, n)]
    valid = []
    for layout in layouts:
        try:
            check_run(apply(cfg, layout), n, nodes, inputs=False)
        except config_lib.UserError:
            continue
        valid.append(estimate(cfg, layout, kind, n, usable))
    ranked = prune(valid)
    log(f"plan: {len(layouts)} layouts enumerated, {len(valid)} valid for the model, {len(ranked)} fit by the "
        f"estimate (each mesh at its least-recomputing remat and schedule that fit); "
        f"compiling the best {min(max_compiles, len(ranked))}")
    for i, c in enumerate(ranked[:max_compiles]):
        log(f"  [{i + 1}/{min(max_compiles, len(ranked))}] {c.layout.describe()} ...", end="", flush=True)
        started = time.perf_counter()
        try:
            report = analyse(apply(cfg, c.layout), kind, n, usable, comm=True, nodes=nodes)
        except config_lib.UserError as error:  # a check the estimate does not make
            log(f" refused: {error}")
            c.fits = False
            continue
        c.compiled, c.compile_s = True, time.perf_counter() - started
        c.memory_bytes = max(report.memory.analytic_total_bytes, report.memory.checkpoint_save_peak_bytes or 0)
        c.fits = report.fits
        c.comm_s, c.comm_ratio = measured_seconds(report.comm, c.layout, kind), report.comm["ratio"]
        c.comm_described = comm_lib.describe_ratio(report.comm)
        log(f" {c.compile_s:.0f} s, {'fits' if c.fits else 'does not fit'}, communication {c.comm_described}")
    ranked.sort(key=rank_key)
    for c in ranked:
        c.command = " ".join(["python -m maxtext_rocm.train", spec, *user_overrides, *c.layout.overrides()])
    return Plan(config=cfg.name, target=f"{kind}:{nodes}x{gpus}", enumerated=len(layouts), fitting=len(ranked),
                ranked=ranked)


def format_plan(plan: Plan, top: int = 8) -> str:
    lines = [f"plan for {plan.config} on {plan.target}: best first (compute at {MFU:.0%} MFU; communication at "
             "link bandwidth, no overlap, measured for compiled layouts, the analytic minimum for the rest)"]
    for i, c in enumerate(plan.ranked[:top], 1):
        fit = f"{'fits' if c.fits else 'DOES NOT FIT'}, {c.memory_bytes / GIB:.1f} GiB"
        how = (f"compiled in {c.compile_s:.0f} s, communication {c.comm_described}" if c.compiled
               else "estimated")
        lines.append(f"{i}. {c.layout.describe()} | {fit} | compute {c.compute_s:.3g} s | "
                     f"communication {c.comm_s:.3g} s | bubble {c.bubble:.0%} | {how}")
        lines.append(f"   {c.command}")
    if not plan.ranked:
        lines.append("no layout fits by the estimate: more devices, a smaller per-device batch, or a flash attention")
    return "\n".join(lines)
