"""Analytic FLOPs, MFU against a per-accelerator peak table, and the metric writers.

FLOPs are counted from the model's dimensions, not from `compiled.cost_analysis()`: XLA counts the
body of a scanned layer stack once, so it under-reports an `nn.scan` model by a factor of n_layers.

Only process 0 writes metrics; the trainer decides which process that is and passes
`enabled=False` everywhere else, so the writer itself never asks JAX who it is.
"""

from __future__ import annotations

import datetime
import json
import math
import os
import resource
from typing import Any, Mapping

from maxtext_rocm.config.choices import DENSE_FAMILIES, MOE_FAMILIES, feed_forward_dim
from maxtext_rocm.reporting.sinks import JsonlFile, TensorBoardSink, WandbSink

FLOPS_CONVENTION = (
    "FLOPs/token = 6 x matmul params (incl. LM head, excl. embedding gather) "
    "+ 6 x seq_len x n_heads x head_dim per layer (causal attention, halved; Megatron/MaxText)"
)


# ----------------------------------------------------------------------------------------------
# FLOPs


def _attention_params(m) -> int:
    """Q, K, V and output projections of one layer (grouped-query: K and V use n_kv_heads)."""
    q = m.d_model * m.n_heads * m.head_dim
    kv = 2 * m.d_model * m.n_kv_heads * m.head_dim
    o = m.n_heads * m.head_dim * m.d_model
    return q + kv + o


def _ffn_params(m) -> int:
    """The matmul parameters one token passes through in one layer's feed-forward block.

    This is the single place a mixture-of-experts family differs: a Mixtral block counts its
    router (d_model x n_experts) plus top_k experts' gate/up/down, since a token only runs through
    the experts it is routed to (active parameters, as MaxText counts them). Whatever the
    implementation executes beyond that (idle capacity slots, the "dense" path's unchosen experts)
    is not model FLOPs.
    """
    if m.family in MOE_FAMILIES:
        return m.d_model * m.n_experts + m.experts_per_token * 3 * m.d_model * feed_forward_dim(m)
    if m.family in DENSE_FAMILIES:
        return 3 * m.d_model * m.mlp_dim  # SwiGLU: gate, up, down
    raise NotImplementedError(f"matmul_params does not know model.family={m.family!r} yet")


def matmul_params(model_cfg) -> int:
    """Parameters that take part in a matmul per token: all layers plus the LM head.

    The embedding lookup is a gather, not a matmul, so it is left out. The LM head is counted even
    with tied embeddings because the d_model x vocab matmul still runs.
    """
    m = model_cfg
    per_layer = _attention_params(m) + _ffn_params(m)
    return m.n_layers * per_layer + m.d_model * m.vocab_size


def train_flops_per_token(model_cfg, seq_len: int) -> float:
    """Training (forward + backward) FLOPs per token under FLOPS_CONVENTION."""
    return float(6 * matmul_params(model_cfg) + seq_len * attention_flops_per_position(model_cfg))


def attention_flops_per_position(m) -> float:
    """What one more position of a row adds to each token's training FLOPs: QK^T and AV, 2 matmuls
    x 2 FLOPs/MAC x n_heads x head_dim forward, halved because the causal mask skips the upper
    triangle, x3 for forward + backward."""
    return float(6 * m.n_heads * m.head_dim * m.n_layers)


def flops_per_token_over_rows(model_cfg, flops_at_seq_len: float, seq_len: int, row_lengths) -> float:
    """Training FLOPs per position of steps whose rows are `row_lengths` long (buckets: shorter rows
    attend over fewer positions), each step weighted by its positions, from the figure at seq_len."""
    lengths = [float(length) for length in row_lengths]
    mean_attended = sum(length * length for length in lengths) / sum(lengths)
    return flops_at_seq_len + (mean_attended - seq_len) * attention_flops_per_position(model_cfg)


def executed_flops_per_token(model_cfg, seq_len: int, remat: str) -> dict[str, float]:
    """Per token, the dot FLOPs a compiled train step of this model runs, split into
    FLOPS_CONVENTION's terms (sum: train_flops_per_token) and what the program runs beyond them, so
    that the compiled program can be held to the one formula (`python -m maxtext_rocm.compile`):

    - "layers", "LM head", "causal attention": the convention's 6N and halved attention;
    - "masked attention": the other half, which an "xla" attention computes and then masks (the
      blockwise and flash kernels skip most of it, inside loops whose trip counts are run-time);
    - "remat recompute": the forward matmuls the backward pass runs again under `remat`: "full",
      every matmul of the block except the MLP's down projection (its output only joins the
      residual, which the backward does not need, so XLA drops it); "minimal", the attention
      einsums (QK^T and AV, unhalved: the projections are saved); "save_dots" and "none", nothing.
    Dense models only: a MoE step runs its capacity slots or every expert, which is not model FLOPs.
    """
    m = model_cfg
    if m.n_experts > 1:
        raise NotImplementedError("executed_flops_per_token counts dense models only")
    attention_fwd = 4 * seq_len * m.n_heads * m.head_dim * m.n_layers  # QK^T and AV, unmasked, forward
    per_layer = _attention_params(m) + _ffn_params(m)
    recompute = {"full": 2 * m.n_layers * (per_layer - m.d_model * m.mlp_dim) + attention_fwd,
                 "minimal": attention_fwd, "save_dots": 0, "none": 0}[remat]
    return {"layers": 6.0 * m.n_layers * per_layer, "LM head": 6.0 * m.d_model * m.vocab_size,
            "causal attention": 3.0 * attention_fwd / 2, "masked attention": 3.0 * attention_fwd / 2,
            "remat recompute": float(recompute)}


# ----------------------------------------------------------------------------------------------
# Peak throughput and MFU

# Dense (no structured sparsity) peak TFLOP/s per device, from the vendors' data sheets. Keys are
# lowercase substrings of `jax.Device.device_kind`. Only product names are keys, never a gfx
# architecture: gfx942 is MI300X and MI325X (same peaks) but also MI300A and MI308X (different
# peaks), so "gfx942" cannot name a peak. An unrecognised device gets no MFU rather than a wrong one;
# log.peak_tflops fills the gap. Caveat: "h200" also matches GH200 and "b200" GB200, whose bf16 peaks
# are close to (GB200: slightly above) the listed ones.
PEAK_TFLOPS: dict[str, dict[str, float]] = {
    "mi300x": {"bf16": 1307.4, "fp8": 2614.9},
    "mi325x": {"bf16": 1307.4, "fp8": 2614.9},
    "mi355x": {"bf16": 2516.6, "fp8": 5033.2},
    "mi350x": {"bf16": 2306.9, "fp8": 4613.7},
    "h100 pcie": {"bf16": 756.0, "fp8": 1513.0},  # "NVIDIA H100 PCIe"
    "h100": {"bf16": 989.4, "fp8": 1978.9},  # SXM: "NVIDIA H100 80GB HBM3"
    "h200": {"bf16": 989.4, "fp8": 1978.9},
    "b200": {"bf16": 2250.0, "fp8": 4500.0},
}


def peak_tflops(device_kind: str, policy: str, override: float = 0.0) -> float | None:
    """Peak dense TFLOP/s of one device for a precision policy, or None when unknown.

    `override` (log.peak_tflops) wins when positive. fp32 has no table entry: GPUs run fp32
    matmuls through various TF32/emulation paths, and a made-up peak would make MFU meaningless.
    """
    if override > 0:
        return float(override)
    if policy not in ("bf16", "fp8"):
        return None
    kind = device_kind.lower()
    # Longest key first, so "h100 pcie" is tried before its prefix "h100".
    for key in sorted(PEAK_TFLOPS, key=len, reverse=True):
        if key in kind:
            return PEAK_TFLOPS[key][policy]
    return None


def mfu(tflops_per_s_per_device: float, peak: float | None) -> float | None:
    """Model FLOPs utilisation as a fraction in [0, 1] (None when the peak is unknown)."""
    if peak is None or peak <= 0:
        return None
    return tflops_per_s_per_device / peak


# ----------------------------------------------------------------------------------------------
# Memory


def peak_rss_mib() -> float:
    """Peak resident memory of this process; Linux reports ru_maxrss in KiB."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def device_peak_memory_mib(device) -> float | None:
    """Peak bytes in use on an accelerator, or None where the backend keeps no stats (the CPU)."""
    try:
        stats = device.memory_stats()
    except Exception:  # some backends raise instead of returning None
        return None
    if not stats or "peak_bytes_in_use" not in stats:
        return None
    return stats["peak_bytes_in_use"] / 2**20


# ----------------------------------------------------------------------------------------------
# Writers


def _json_value(value: Any) -> Any:
    """A plain JSON value: numpy/JAX scalars become Python numbers; NaN and inf become null,
    because strict JSON (jq, most non-Python readers) has no spelling for them."""
    if value is None or isinstance(value, (bool, str)):
        return value
    if hasattr(value, "item"):  # numpy or JAX scalar
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


class MetricsWriter:
    """Appends metrics to OUTPUT_DIR/metrics.jsonl and, optionally, the same scalars to TensorBoard
    (OUTPUT_DIR/tensorboard) and to a Weights & Biases run in `wandb_project` (files under
    OUTPUT_DIR/wandb) whose config is `run_config`.

    With `enabled=False` (every process but 0) every method does nothing and no file is created.
    """

    def __init__(self, output_dir: str, *, enabled: bool = True, tensorboard: bool = True,
                 wandb_project: str = "", wandb_run_name: str = "", run_config: Mapping[str, Any] | None = None):
        self.enabled = enabled
        self._jsonl = None
        self._sinks = []
        if not enabled:
            return
        os.makedirs(output_dir, exist_ok=True)
        # W&B first: a missing wandb package is the one way to fail here, before any file is opened.
        if wandb_project:
            self._sinks.append(WandbSink(wandb_project, wandb_run_name, run_config, output_dir))
        if tensorboard:
            self._sinks.append(TensorBoardSink(os.path.join(output_dir, "tensorboard")))
        # Append, so a resumed run continues the same file (a row an earlier launch left cut short is removed).
        self._jsonl = JsonlFile(os.path.join(output_dir, "metrics.jsonl"))

    def write(self, step: int, metrics: Mapping[str, float | None]) -> None:
        if not self.enabled:
            return
        record = {"step": int(step), **{k: _json_value(v) for k, v in metrics.items()}}
        self._jsonl.write(json.dumps(record))  # one write per row: a crash loses at most this row
        # NaN is kept here: TensorBoard and W&B draw it, which shows where a run diverged.
        scalars = {k: float(v) for k, v in metrics.items() if v is not None}
        for sink in self._sinks:
            sink.write(step, scalars)

    def close(self) -> None:
        if self._jsonl is not None:
            self._jsonl.close()
            self._jsonl = None
        for sink in self._sinks:
            sink.close()
        self._sinks = []

    def __enter__(self) -> "MetricsWriter":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def format_line(step: int, total_steps: int, metrics: Mapping[str, Any]) -> str:
    """One console line: progress, then whichever of the known metrics are present."""
    width = len(str(total_steps))
    percent = 100 * step // total_steps if total_steps > 0 else 100
    parts = [f"step {step:>{width}}/{total_steps} {percent:3d}%"]

    def get(key):
        value = metrics.get(key)
        return None if value is None else float(value)

    loss, lr, gnorm = get("loss"), get("lr"), get("grad_norm")
    step_time, tokens, tflops = get("step_time_s"), get("tokens_per_s_per_device"), get("tflops_per_s_per_device")
    if loss is not None:
        parts.append(f"loss {loss:.4f}")
    if metrics.get("dpo_accuracy") is not None:  # a DPO run's (reporting/run_report.py)
        parts.append(f"acc {get('dpo_accuracy'):.3f} margin {get('dpo_reward_margin'):.4f}")
    if metrics.get("grpo_reward") is not None:  # a GRPO run's samples (finetune/grpo/rollout.py)
        parts.append(f"reward {get('grpo_reward'):.3f} len {get('grpo_completion_length'):.1f} "
                     f"sample {get('grpo_sampling_s'):.2f}s")
    if lr is not None:
        parts.append(f"lr {lr:.2e}")
    if gnorm is not None:
        parts.append(f"gnorm {gnorm:.3f}")
    padding = get("padding_fraction")
    if padding is not None:  # the batch's positions holding no token: what packing wasted
        parts.append(f"pad {100 * padding:.1f}%")
    if step_time is not None:
        parts.append(f"{step_time:.3f} s/step")
    if tokens is not None:  # every position computed; "real": those holding a token (not padding)
        real = get("real_tokens_per_s_per_device")
        parts.append(f"{tokens:,.0f} tok/s/dev" + (f" ({real:,.0f} real)" if real is not None else ""))
    if tflops is not None:
        parts.append(f"{tflops:.2f} TFLOP/s/dev")
    if "mfu" in metrics or tflops is not None:
        value = get("mfu")
        parts.append("MFU  n/a" if value is None else f"MFU {100 * value:.1f}%")
    if step_time is not None and math.isfinite(step_time):
        remaining = max(total_steps - step, 0) * step_time
        parts.append(f"eta {datetime.timedelta(seconds=round(remaining))}")
    return " | ".join(parts)
