"""The planner's results as named objects: `FitReport` (what `analyse` finds for one config on one
target, read by formatting.py by attribute) and `BatchSearch` (what `search` finds). Their
`to_json` writes the keys `--json` has always written (docs/fit.md, scripts/benchmark.py read
them): one flat object, a group's optional keys absent where they do not apply."""

from __future__ import annotations

import dataclasses
from typing import Any

from maxtext_rocm.planner.estimates import DotFlops, StageSplit

GIB = 2 ** 30


@dataclasses.dataclass
class Setup:
    """What was planned, as analyse resolved it: the config, the target, the mesh and the batch."""
    config: str
    target: str  # "KIND:N", N devices in all
    policy: str  # precision.policy
    fp8_format: str | None  # "ocp" or "fnuz" under fp8 ("auto" resolved from the target), else None
    mesh: str  # sharding.describe's "fsdp=8" or "stage=4 x fsdp=8"
    remat: str
    per_device_batch_size: int
    seq_len: int
    grad_accum: int
    target_memory_bytes: int  # one device's memory
    usable_fraction: float  # --usable: the share of it the allocator hands out

    @property
    def kind(self) -> str:
        return self.target.split(":")[0]

    @property
    def n_devices(self) -> int:
        return int(self.target.split(":")[1])

    @property
    def usable_bytes(self) -> float:
        return self.usable_fraction * self.target_memory_bytes


@dataclasses.dataclass
class AnalyticMemory:
    """Bytes per device (one stage's device under a pipeline): the state exact from the abstract
    arrays' shapes, dtypes and shardings, activations by estimates.py's formula. The verdict is
    decided on this column."""
    params_bytes: int
    opt_state_bytes: int
    fp8_state_bytes: int  # delayed-scaling state and the step counters
    gradients_bytes: int  # the parameters' again (twice under grad_accum > 1: the running sum)
    analytic_activations_bytes: float
    analytic_activation_terms_bytes: dict[str, float]  # its terms: "layers", "logits", ...
    analytic_total_bytes: float  # state + gradients + activations
    # A stack stored in its own order (circular, padded) converted to model order at each save,
    # between steps: the state and its layer leaves again. None where no conversion happens.
    checkpoint_save_peak_bytes: int | None = None
    # The checkpoint checksum program's temporaries (XLA's memory analysis); None until compiled.
    checkpoint_checksum_temp_bytes: int | None = None

    @property
    def state_bytes(self) -> int:
        return self.params_bytes + self.opt_state_bytes + self.fp8_state_bytes


@dataclasses.dataclass
class Flops:
    """FLOPs: the analytic convention per step (6N + attention), and the dot FLOPs per device the
    compiled step should run (None for MoE) beside what it does run (comm.account's HLO walk)."""
    flops_per_token: float
    flops_per_step: float
    peak_tflops_per_device: float | None  # metrics.peak_tflops of the target under the policy
    analytic_dot_flops: DotFlops | None
    compiled_dot_flops: float | None = None  # None until compiled
    compiled_flops_lower_bound: bool | None = None  # dots in loops without a known trip count counted once


@dataclasses.dataclass
class XlaMemory:
    """compiled.memory_analysis() of the CPU executable, bytes per device (JSON keys "xla_" + name):
    a cross-check, since XLA:CPU upcasts bf16/fp8 matmuls and does not schedule for memory."""
    argument_bytes: int
    output_bytes: int
    alias_bytes: int
    temp_bytes: int
    total_bytes: int  # arguments + outputs - donated + temporaries
    activations_bytes: int  # temporaries - gradients
    fits: bool


@dataclasses.dataclass
class Compiled:
    """The real compile on fake CPU devices (absent under compile_it=False)."""
    compile_s: float
    note: str | None = None  # why XLA's figures are another program's, or missing (JSON "xla_note")
    memory: XlaMemory | None = None  # None where XLA:CPU could not finish the program


@dataclasses.dataclass
class Confirmed:
    """One recommendation of the batch search, compiled."""
    remat: str
    per_device_batch_size: int
    compile_s: float | None
    analytic_total_bytes: float
    xla_total_bytes: int | None
    fits: bool


@dataclasses.dataclass
class BatchSearch:
    """The largest per-device batch that fits under each remat policy (by the estimate), the
    choices it implies, and their compiles."""
    largest_batch_by_remat: dict[str, int | None]
    remat_for_configured_batch: str | None  # the least recomputation that fits the configured batch
    largest_batch: int | None
    largest_batch_remat: str | None
    confirmed: list[Confirmed]
    # Where nothing fits under the "xla" attention: the target's flash attention and the search under it.
    flash_attention: str | None = None
    largest_batch_by_remat_flash: dict[str, int | None] | None = None

    def to_json(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        if self.flash_attention is None:
            del out["flash_attention"], out["largest_batch_by_remat_flash"]
        return out


@dataclasses.dataclass
class FitReport:
    """What `analyse` finds for one config on one target; `search` and `comm` where asked for."""
    setup: Setup
    memory: AnalyticMemory
    flops: Flops
    fits: bool  # the verdict: the analytic total (and the checkpoint save's peaks) within the usable memory
    moe_impl: str | None = None  # the resolved MoE implementation of an MoE model
    pipeline: str | None = None  # pipeline.describe's schedule, microbatches and bubble, under stage > 1
    stages: StageSplit | None = None  # under stage > 1
    compiled: Compiled | None = None
    comm: dict | None = None  # comm.report's collectives and minimum, under --comm
    search: BatchSearch | None = None  # under --search, or when it does not fit

    def to_json(self) -> dict[str, Any]:
        """The flat object `--json` writes, its keys as they always were."""
        m, f, c = self.memory, self.flops, self.compiled
        out = {**dataclasses.asdict(self.setup)}
        out.update({k: v for k, v in dataclasses.asdict(m).items() if not k.startswith("checkpoint_")})
        out.update(flops_per_token=f.flops_per_token, flops_per_step=f.flops_per_step,
                   peak_tflops_per_device=f.peak_tflops_per_device)
        if m.checkpoint_save_peak_bytes is not None:
            out["checkpoint_save_peak_bytes"] = m.checkpoint_save_peak_bytes
        out["fits"] = self.fits
        if self.moe_impl is not None:
            out["moe_impl"] = self.moe_impl
        if self.pipeline is not None:
            out["pipeline"] = self.pipeline
        if self.stages is not None:
            out["stages"] = dataclasses.asdict(self.stages)
        out["analytic_dot_flops"] = f.analytic_dot_flops and dataclasses.asdict(f.analytic_dot_flops)
        if c is not None:
            if c.note is not None:
                out["xla_note"] = c.note
            out["compile_s"] = c.compile_s
        if f.compiled_dot_flops is not None:
            out.update(compiled_dot_flops=f.compiled_dot_flops, compiled_flops_lower_bound=f.compiled_flops_lower_bound)
        if self.comm is not None:
            out["comm"] = self.comm
        if c is not None:
            out["checkpoint_checksum_temp_bytes"] = m.checkpoint_checksum_temp_bytes
            if c.memory is not None:
                out.update({f"xla_{k}": v for k, v in dataclasses.asdict(c.memory).items()})
        if self.search is not None:
            out["search"] = self.search.to_json()
        return out
