"""The text `python -m maxtext_rocm.compile` prints for a `FitReport`: the memory columns side by
side, the pipeline's stages, the checkpoint's peaks, FLOPs, the verdict and the batch search
(the communication report's text is comm.format_report's)."""

from __future__ import annotations

import math

from maxtext_rocm.planner.batch_search import REMAT_ORDER
from maxtext_rocm.planner.fit_report import GIB, BatchSearch, FitReport


def _gib(x) -> str:
    return "n/a" if x is None else f"{x / GIB:8.2f} GiB"


def format_report(r: FitReport) -> str:
    setup, m, f = r.setup, r.memory, r.flops
    cap, usable = setup.target_memory_bytes, setup.usable_bytes
    xla = r.compiled.memory if r.compiled else None
    lines = [
        f"{setup.config} on {setup.target} ({setup.kind.upper()}: {cap / GIB:.0f} GiB each, "
        f"{100 * setup.usable_fraction:.0f}% usable); mesh {setup.mesh}; policy {setup.policy}"
        + (f" ({setup.fp8_format})" if setup.fp8_format else "")
        + (f"; moe_impl {r.moe_impl}" if r.moe_impl else "")
        + (f"; {r.pipeline}" if r.pipeline else ""),
        f"batch {setup.per_device_batch_size}/device x {setup.seq_len} tokens"
        + (f" in {setup.grad_accum} micro-batches" if setup.grad_accum > 1 else "") + f"; remat {setup.remat}"
        + (f"; compiled in {r.compiled.compile_s:.1f} s" if r.compiled else ""),
        "per device                      analytic (GPU)       XLA (CPU buffer assignment)",
        f"  parameters                    {_gib(m.params_bytes)}         (in the arguments)",
        f"  optimizer state               {_gib(m.opt_state_bytes)}         (in the arguments)",
        f"  fp8 scales + counters         {_gib(m.fp8_state_bytes)}         (in the arguments)",
        f"  gradients                     {_gib(m.gradients_bytes)}         (in the temporaries)",
        f"  activations + temporaries     {_gib(m.analytic_activations_bytes)}     "
        f"{_gib(xla and xla.activations_bytes)} (temporaries - gradients)",
        f"  total                         {_gib(m.analytic_total_bytes)}     "
        f"{_gib(xla and xla.total_bytes)} (arguments + outputs - donated + temporaries)",
        f"  target                        {_gib(cap)}     usable {_gib(usable)}",
        "  (analytic activations: " + ", ".join(f"{k} {v / GIB:.1f} GiB" for k, v in
                                               m.analytic_activation_terms_bytes.items()) + ")",
    ]
    if r.compiled and r.compiled.note:
        lines.append(f"  ({r.compiled.note})")
    if r.stages:
        st = r.stages
        lines.append(f"per stage ({st.stages} stages, every figure above is one device of one stage; all "
                     f"stages alike, so the worst is any): parameters split over stage {_gib(st.layer_param_bytes).strip()}, "
                     f"on every stage {_gib(st.other_param_bytes).strip()}: {st.note}")
    if m.checkpoint_save_peak_bytes:
        lines.append(f"checkpoint save peak (state + its layer leaves converted to model order, between steps): "
                     f"{_gib(m.checkpoint_save_peak_bytes).strip()}")
    if m.checkpoint_checksum_temp_bytes is not None:
        lines.append(f"checkpoint checksum (at each save, XLA CPU): {m.checkpoint_checksum_temp_bytes:,} bytes of "
                     f"temporaries per device, {m.checkpoint_checksum_temp_bytes / m.state_bytes:.2g} x the state")
    flops, n = f.flops_per_step, setup.n_devices
    timing = ""
    if f.peak_tflops_per_device:
        timing = f"; >= {flops / n / (f.peak_tflops_per_device * 1e12):.3f} s/step at 100% MFU"
    lines.append(f"FLOPs: {flops / 1e15:.2f} PFLOP/step ({flops / n / 1e12:.1f} TFLOP/device, "
                 f"{f.flops_per_token / 1e9:.2f} GFLOP/token, analytic 6N + attention){timing}")
    if f.compiled_dot_flops is not None and f.analytic_dot_flops:
        a = f.analytic_dot_flops
        bubble = (f" x the pipeline loop's slot-iterations per real layer pass (bubble, empty slots) = "
                  f"{a.bubble_factor:.3f} on the layers" if a.bubble_factor > 1 else "")
        head = (f", LM head on every stage ({a.redundant_head / 1e12:.3f} TFLOP/device redundant)"
                if a.redundant_head else "")
        lines.append(f"compiled dot FLOPs per device per step: {f.compiled_dot_flops / 1e12:.3f} TFLOP vs analytic "
                     f"{a.total / 1e12:.3f} TFLOP (6N + attention"
                     f"{' + ' + a.remat + ' remat recompute' if a.terms['remat recompute'] else ''}"
                     f"{' + masked attention' if a.terms['masked attention'] else ''}"
                     f"{' + the stage recompute' if a.terms.get('stage recompute') else ''}{bubble}{head}): ratio "
                     f"{f.compiled_dot_flops / a.total:.3f}"
                     + (" (a LOWER bound: dots inside loops without a known trip count, e.g. the blockwise "
                        "attention's, count once)" if f.compiled_flops_lower_bound else ""))
    agree = ""
    if xla:
        agree = ("; the XLA CPU figure agrees" if xla.fits == r.fits else
                 f"; the XLA CPU figure says it would {'' if xla.fits else 'not '}fit (CPU buffers "
                 "upcast bf16/fp8 matmuls and are not scheduled for memory like a GPU's)")
    lines.append(f"verdict: {'FITS' if r.fits else 'DOES NOT FIT'} "
                 f"({m.analytic_total_bytes / GIB:.1f} of {usable / GIB:.1f} GiB usable, "
                 f"analytic GPU estimate){agree}")
    if r.search:
        lines += _search_lines(r, r.search)
    return "\n".join(lines)


def _search_lines(r: FitReport, s: BatchSearch) -> list[str]:
    setup, m = r.setup, r.memory
    n, usable = setup.n_devices, setup.usable_bytes
    by = ", ".join(f"{k}: {v or 'none'}" for k, v in s.largest_batch_by_remat.items())
    lines = [f"largest per-device batch that fits, by remat policy (estimate): {by}"]
    if s.remat_for_configured_batch:
        lines.append(f"remat policy that fits batch {setup.per_device_batch_size} with the least recomputation: "
                     f"{s.remat_for_configured_batch}")
    elif s.largest_batch:
        lines.append(f"batch {setup.per_device_batch_size} fits under no remat policy; "
                     f"largest that fits: {s.largest_batch} with remat={s.largest_batch_remat}")
    else:
        need = (m.params_bytes + m.opt_state_bytes + m.gradients_bytes) * n
        min_devices = math.ceil(need / usable)
        flash = s.largest_batch_by_remat_flash or {}
        if need / n <= usable:
            lines.append(f"no batch fits under any remat policy: state (parameters, optimizer, gradients) "
                         f"takes {need / n / GIB:.1f} GiB/device and one {setup.seq_len}-token sequence's "
                         "activations the rest; use more devices, mesh.ici.tensor or mesh.ici.sequence, "
                         "or a shorter train.seq_len")
            if any(flash.values()):
                remat = next(k for k in REMAT_ORDER if flash[k])
                by_flash = ", ".join(f"{k}: {v or 'none'}" for k, v in flash.items())
                lines.append(f"with flash attention (model.attention='{s.flash_attention}') it would fit "
                             f"by the estimate: batch {flash[remat]} with remat={remat} "
                             f"(largest by remat: {by_flash})")
        else:
            lines.append(f"no batch fits under any remat policy: parameters, optimizer state and gradients "
                         f"alone need {need / GIB:,.0f} GiB in all, i.e. at least {min_devices} "
                         f"{setup.kind.upper()}s with FSDP (before activations)")
    for c in s.confirmed:
        lines.append(f"  compiled remat={c.remat} batch={c.per_device_batch_size}: "
                     f"{c.analytic_total_bytes / GIB:.1f} GiB analytic, "
                     f"{_gib(c.xla_total_bytes).strip()} XLA CPU, {c.compile_s:.1f} s")
    return lines
