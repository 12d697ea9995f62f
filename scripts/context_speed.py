"""One long sequence's train step with and without context parallelism, on fake CPU devices.

    python scripts/context_speed.py [--seq-len=16384] [--steps=3] [--json OUT]

One process with 8 fake CPU devices (XLA reads its flags once per process, so both runs share
them): the same one-sequence batch (train.per_device_batch_size = 1 on one device, 0.125 on 8)
trained on 1 device (sequence=1, the blockwise attention) and on 8 devices with mesh sequence=8
for each model.context_parallel mode, causal load balance on. tiny_llama's dimensions, fp32,
synthetic data. The three trainers are built first, then take turns step by step (a change in
the host's load falls on all of them). Prints each median step time and the ratio to the 1-device
run.

On a CPU the 8 "devices" share the host's cores, so the ratio measures the algorithm's overhead
(and the balance of its work) more than a speed-up; on a GPU each shard has its own chip.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

from maxtext_rocm import config as config_lib  # noqa: E402
from maxtext_rocm.train import Trainer  # noqa: E402


def make_trainer(seq_len: int, steps: int, devices, **overrides) -> Trainer:
    cfg = config_lib.load_preset("tiny_llama")
    for key, value in {"precision.policy": "fp32", "data.source": "synthetic", "train.seq_len": seq_len,
                       "train.steps": steps + 1, "checkpoint.enabled": False, "log.tensorboard": False,
                       "model.scan_layers": True, "model.remat": "full",
                       "output_dir": tempfile.mkdtemp(prefix="context_speed_"),
                       **{f"mesh.ici.{a}": 1 for a in config_lib.MESH_AXES}, **overrides}.items():
        config_lib.set_key(cfg, key, value)
    trainer = Trainer(cfg, devices=devices, log=lambda *_: None)
    jax.block_until_ready(trainer.step())  # compiles
    return trainer


def step_times(trainers: dict, steps: int) -> dict[str, list[float]]:
    """Each trainer's step times, the trainers taking turns step by step, so that a change in the
    host's load (other work on shared cores) falls on every row alike."""
    times = {name: [] for name in trainers}
    for _ in range(steps):
        for name, trainer in trainers.items():
            start = time.perf_counter()
            jax.block_until_ready(trainer.step())
            times[name].append(time.perf_counter() - start)
    for trainer in trainers.values():
        trainer.close()
    return times


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seq-len", type=int, default=16384)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    devices = jax.devices()
    trainers = {"sequence=1 (1 device)": make_trainer(args.seq_len, args.steps, devices[:1],
                                                      **{"train.per_device_batch_size": 1})}
    for mode in ("all_gather", "ring"):
        trainers[f"sequence=8 {mode}"] = make_trainer(args.seq_len, args.steps, devices, **{
            "mesh.ici.sequence": 8, "model.context_parallel": mode, "train.per_device_batch_size": 0.125})
    rows = step_times(trainers, args.steps)
    base = statistics.median(rows["sequence=1 (1 device)"])
    report = {}
    print(f"one {args.seq_len}-token sequence, tiny_llama dims, fp32, remat full, {os.cpu_count()} host cores")
    for name, times in rows.items():
        median = statistics.median(times)
        report[name] = {"median_step_s": median, "steps_s": times, "ratio_to_sequence_1": median / base}
        print(f"  {name:24s} {median:8.2f} s/step   x{median / base:.2f} of sequence=1")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
