"""How long an asynchronous checkpoint save stops the training loop, and what the checksum costs.

    python scripts/bench_checkpoint_stall.py [--d-model 768] [--layers 12] [--vocab 32000] [--saves 3]
                                             [--local-dir /dev/shm]

A tiny_llama widened to ~100-160M parameters (fp32, Adam: 12 bytes per parameter of state) trains
on the CPU with an async save every other step. Printed:

- the state's size and the checksum program's temporaries (XLA's memory analysis of
  `checksums.summarise`'s program compiled on the state: a compile-time figure);
- per save: the time `Trainer.save_checkpoint` blocks the loop, the part of it spent in the
  checksum (`checksums.summarise`, timed in place), and the time of the step after the save,
  next to the median step without a save. On the CPU the devices are the host, so that step
  shares the cores with orbax's background write (serialisation, compression); on a GPU the
  write runs on the host while the device steps;
- the checksum alone on the live state (median of 3);
- per save of the local tier (checkpoint.local_dir, maxtext_rocm/checkpoint/local_tier.py; in
  --local-dir, default /dev/shm where it exists): the time `Trainer.save_local_checkpoint` blocks
  the loop (the copy of this process's shards off the devices), the step after it, and the
  background write's remaining time.

To compare with an older commit, run the same script against that commit's package:

    git archive COMMIT maxtext_rocm | tar -x -C /tmp/old && PYTHONPATH=/tmp/old python scripts/bench_checkpoint_stall.py
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--d-model", type=int, default=768)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--saves", type=int, default=3)
    parser.add_argument("--local-dir", default="/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir())
    args = parser.parse_args()

    import jax
    from jax.sharding import NamedSharding, PartitionSpec

    from maxtext_rocm.checkpoint import checksums
    from maxtext_rocm import config as config_lib
    from maxtext_rocm.train import Trainer

    cfg = config_lib.load_preset("tiny_llama")
    d = args.d_model
    cfg.model.update(vocab_size=args.vocab, d_model=d, n_layers=args.layers, n_heads=d // 64, n_kv_heads=d // 128,
                     head_dim=64, mlp_dim=4 * d, scan_layers=True)
    cfg.precision.policy = "fp32"
    cfg.data.source = "synthetic"
    cfg.train.update(steps=4 + 4 * args.saves, per_device_batch_size=1, seq_len=64)
    cfg.checkpoint.update(every=0, async_save=True, keep=2)
    cfg.log.tensorboard = False
    cfg.output_dir = tempfile.mkdtemp(prefix="bench_ckpt_stall_")
    local_dir = tempfile.mkdtemp(prefix="bench_ckpt_stall_local_", dir=args.local_dir)
    if "local_dir" in cfg.checkpoint:  # older commits have no local tier
        cfg.checkpoint.update(local_dir=local_dir, local_every=10**6, local_keep=2)

    trainer = Trainer(cfg, devices=jax.devices()[:1], log=lambda *_: None)
    state = trainer.state_in_model_order()
    leaves = jax.tree_util.tree_leaves(state)
    n_params = sum(x.size for x in jax.tree_util.tree_leaves(trainer.state.params))
    state_bytes = sum(x.size * x.dtype.itemsize for x in leaves)
    summariser = getattr(checksums, "summariser", None) or checksums._summariser  # older commits: private
    mesh = next(x.sharding.mesh for x in leaves if isinstance(x.sharding, NamedSharding))
    compiled = summariser(NamedSharding(mesh, PartitionSpec())).lower(leaves).compile()
    temp = compiled.memory_analysis().temp_size_in_bytes
    print(f"model: {n_params / 1e6:.1f}M parameters, state {state_bytes / 1e9:.2f} GB on {jax.device_count()} device(s)")
    print(f"checksum program temporaries (XLA memory analysis): {temp:,} bytes = {temp / state_bytes:.2g} x the state")

    spent = []
    original = checksums.summarise

    def timed_summarise(tree):
        started = time.perf_counter()
        try:
            return original(tree)
        finally:
            spent.append(time.perf_counter() - started)
    checksums.summarise = timed_summarise

    def step_time():
        started = time.perf_counter()
        jax.block_until_ready(trainer.step())
        return time.perf_counter() - started

    for _ in range(2):  # compile, warm up
        step_time()
    plain = [step_time() for _ in range(3)]
    print(f"step without a save: median {statistics.median(plain):.3f} s")
    for i in range(args.saves):
        spent.clear()
        started = time.perf_counter()
        trainer.save_checkpoint()
        stall = time.perf_counter() - started
        after = step_time()
        started = time.perf_counter()
        trainer.checkpointer.wait()
        rest = time.perf_counter() - started
        summed = sum(spent)
        print(f"save {i + 1}: loop blocked {stall:.3f} s, of which checksum {summed:.3f} s "
              f"({100 * summed / stall:.0f}%), orbax and the rest {stall - summed:.3f} s; step after it {after:.3f} s "
              f"(sharing the host's cores with orbax's background write, which then took {rest:.3f} s more); "
              f"the next step {step_time():.3f} s")
    checksums.summarise = original
    alone = []
    for _ in range(3):
        started = time.perf_counter()
        checksums.summarise(trainer.state_in_model_order())
        alone.append(time.perf_counter() - started)
    print(f"checksum alone on the live state: median {statistics.median(alone):.3f} s "
          f"({state_bytes / statistics.median(alone) / 1e9:.1f} GB/s)")
    for i in range(args.saves if trainer.checkpointer.local is not None else 0):
        started = time.perf_counter()
        trainer.save_local_checkpoint()
        stall = time.perf_counter() - started
        after = step_time()
        started = time.perf_counter()
        trainer.checkpointer.local.wait()
        rest = time.perf_counter() - started
        print(f"local save {i + 1} ({args.local_dir}): loop blocked {stall:.3f} s; step after it {after:.3f} s "
              f"(sharing the host's cores with the background write, which then took {rest:.3f} s more); "
              f"the next step {step_time():.3f} s")
    trainer.checkpointer.close()
    shutil.rmtree(cfg.output_dir, ignore_errors=True)  # ~3 GB of checkpoints
    shutil.rmtree(local_dir, ignore_errors=True)


if __name__ == "__main__":
    main()
