"""Sizes that cannot fit, refused before anything is allocated.

A run whose state or batches exceed the machine should stop with one sentence at start-up, not
after a failing multi-TB allocation well into start-up. The figures here are LOWER bounds, each a
quantity the trainer certainly holds, so the check never refuses a run that could fit; whether a
run that passes it fits a target node exactly is `python -m maxtext_rocm.compile`'s question
(an AOT compile with XLA's own buffer assignment), which the sentence points to.

- state: parameters, Adam's two moments, all fp32 (12 bytes per parameter), counting the matmul
  weights and the embedding table (every expert included; norm scales left out); under
  train.objective="dpo" (and "grpo" with grpo.beta > 0) plus the frozen reference, those weights
  in the compute dtype; under LoRA (lora.rank > 0) only the frozen base in the compute dtype (the
  adapters are too small to count), which is also the reference there;
- activations: the block input of every layer for the backward pass, which every remat policy
  keeps (`full` keeps only that), in the compute dtype, for one micro-batch; under
  train.objective="grpo" at least the sampler's KV cache (keys and values of every layer for every
  row and position), which it holds before the step runs;
- batches (host memory): the int32/fp32 [rows, seq_len] arrays of a batch (`data.batch_spec`),
  for files times the batches the loader builds ahead (`data.prefetch`) plus the one in use;
- the local checkpoint tier (host memory) where `checkpoint.local_dir` is on a memory file system
  (tmpfs: /dev/shm): `checkpoint.local_keep` copies of this process's share of the state, less
  what its local steps of an earlier launch already hold there (the available memory counts
  those as used already).

On the CPU the devices are the host, so everything is compared with the host's available memory;
on accelerators, state and activations with the devices' total and the batches with the host's.
"""

from __future__ import annotations

import os

from maxtext_rocm.config.keys_model import feed_forward_dim
from maxtext_rocm.config.loading import ConfigError

GIB = 1 << 30


def host_available_bytes() -> int | None:
    """MemAvailable of /proc/meminfo (what can be had without swapping), else physical memory."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def device_bytes(device) -> int | None:
    """The memory an accelerator lets this process allocate (None where it does not say, the CPU)."""
    try:
        stats = device.memory_stats()
    except Exception:  # noqa: BLE001 - backends without memory statistics raise their own errors
        return None
    return int(stats["bytes_limit"]) if stats and stats.get("bytes_limit") else None


def stored_params(m) -> int:
    """The parameters the model stores, norm scales aside: embedding, LM head (unless tied), and per
    layer the attention projections and the feed-forward weights (all experts and the router)."""
    attention = m.d_model * m.head_dim * (2 * m.n_heads + 2 * m.n_kv_heads)
    ffn = 3 * m.d_model * feed_forward_dim(m) * m.n_experts + (m.d_model * m.n_experts if m.n_experts > 1 else 0)
    embeddings = m.vocab_size * m.d_model * (1 if m.tie_embeddings else 2)
    return m.n_layers * (attention + ffn) + embeddings


def state_bytes_per_param(cfg, compute_bytes: int) -> int:
    """fp32 parameters and Adam's two moments, plus a DPO or GRPO reference; a LoRA base alone."""
    if cfg.get("lora") is not None and cfg.lora.rank > 0:
        return compute_bytes
    grpo_reference = cfg.train.objective == "grpo" and cfg.grpo.beta > 0
    return 12 + (compute_bytes if cfg.train.objective == "dpo" or grpo_reference else 0)


def in_memory_file_system(path: str) -> bool:
    """Whether `path` lies on a tmpfs or ramfs mount (/dev/shm): files there are host memory."""
    try:
        mounts = [line.split()[1:3] for line in open("/proc/mounts")]
    except OSError:
        return False
    target = os.path.realpath(path)
    best = max((point for point, _ in mounts if target == point or target.startswith(point.rstrip("/") + "/")),
               key=len, default=None)
    return best is not None and dict(mounts)[best] in ("tmpfs", "ramfs")


def lower_bounds(cfg, n_devices: int, n_processes: int = 1, held_locally: int = 0) -> dict[str, int]:
    """Bytes this run certainly needs: the state and activations summed over all devices, and the
    batches and in-memory local checkpoints of one process's host."""
    from maxtext_rocm.data import batch_spec

    m, t = cfg.model, cfg.train
    compute_bytes = 4 if cfg.precision.policy == "fp32" else 2
    global_rows = t.per_device_batch_size * n_devices
    micro_tokens = global_rows // max(t.grad_accum, 1) * t.seq_len
    in_flight = cfg.data.prefetch + 1 if cfg.data.source == "files" else 1  # only files prefetch
    activations = m.n_layers * micro_tokens * m.d_model * compute_bytes
    if t.objective == "grpo":  # the sampler's KV cache, before the step: whichever is larger is certain
        activations = max(activations, global_rows * t.seq_len * m.n_layers * 2 * m.n_kv_heads * m.head_dim
                          * compute_bytes)
    state = state_bytes_per_param(cfg, compute_bytes) * stored_params(m)
    local_dir = cfg.checkpoint.get("local_dir", "") if cfg.checkpoint.enabled else ""
    in_memory = bool(local_dir) and in_memory_file_system(local_dir)
    return {
        "state": state,
        "activations": activations,
        "batches": len(batch_spec(cfg.data)) * 4 * (global_rows // n_processes) * t.seq_len * in_flight,
        # `held_locally`: what this process's local steps of the run hold already (an earlier launch's).
        "local_tier": max(0, cfg.checkpoint.local_keep * state // n_processes - held_locally) if in_memory else 0,
    }


def check_fits(cfg, devices, held_locally: int = 0) -> None:
    """A ConfigError naming the sizes when the run cannot fit this machine's memory; `held_locally`:
    the bytes this process's local checkpoint steps of the run hold already (checkpoint/local_tier.py)."""
    devices = list(devices)
    n_processes = len({d.process_index for d in devices})
    need = lower_bounds(cfg, len(devices), n_processes, held_locally)
    host = host_available_bytes()
    per_device = device_bytes(devices[0])
    on_host = per_device is None  # the CPU backend: devices are this host's memory
    device_need = need["state"] + need["activations"]
    if on_host:
        # This process's devices hold its share of the state and activations, in host memory.
        checks = [(device_need // n_processes + need["batches"] + need["local_tier"], host,
                    "this host's available memory")]
    else:
        checks = [(device_need, per_device * len(devices), f"the {len(devices)} devices' memory"),
                  (need["batches"] + need["local_tier"], host, "this host's available memory")]
    for needed, available, what in checks:
        if available is not None and needed > available:
            raise ConfigError(
                f"this run needs at least {needed / GIB:,.1f} GiB but {what} is {available / GIB:,.1f} GiB "
                f"({_sizes(cfg)}: state {need['state'] / GIB:,.1f} GiB, activations "
                f"{need['activations'] / GIB:,.1f} GiB, batches {need['batches'] / GIB:,.1f} GiB"
                + (f", local checkpoints in {cfg.checkpoint.local_dir} {need['local_tier'] / GIB:,.1f} GiB"
                   if need["local_tier"] else "")
                + "); lower these sizes, or check what fits a target with python -m maxtext_rocm.compile CONFIG "
                "--target=mi355x:8")


def _sizes(cfg) -> str:
    m, t = cfg.model, cfg.train
    return (f"model.d_model={m.d_model}, model.n_layers={m.n_layers}, model.mlp_dim={m.mlp_dim}, "
            f"train.per_device_batch_size={t.per_device_batch_size}, train.seq_len={t.seq_len}")
