"""The tiny presets' losses, bit for bit: a fingerprint of what the trainer computes.

    python scripts/loss_digest.py [--steps 6] > digest.txt

Trains each tiny preset (tiny_llama and tiny_mixtral, in their default precision and in fp32)
for a few steps on 4 fake CPU devices (fsdp=2 x tensor=2) and prints every step's loss and
gradient norm as exact hexadecimal floats, one line per step. Two checkouts that print the same
text train identically; a refactoring that claims to change nothing is checked by diffing the
output of the tree before and after it (PYTHONPATH=<tree> python scripts/loss_digest.py).
Only the public API is used (maxtext_rocm.load_config, maxtext_rocm.Trainer), so the script runs
on any version of the package's layout.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

PRESETS = ["configs/tiny_llama.py", "configs/tiny_llama.py:fp32", "configs/tiny_mixtral.py",
           "configs/tiny_mixtral.py:fp32"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6)
    args = parser.parse_args()

    import jax

    import maxtext_rocm as mr

    for preset in PRESETS:
        with tempfile.TemporaryDirectory() as out:
            cfg = mr.load_config(preset, overrides={
                "train.steps": args.steps, "train.seq_len": 64, "train.per_device_batch_size": 1,
                "log.every": 1, "log.tensorboard": False, "checkpoint.enabled": False,
                "mesh.ici.fsdp": 2, "mesh.ici.tensor": 2, "output_dir": out})
            trainer = mr.Trainer(cfg, devices=jax.devices()[:4], log=lambda *_: None)
            for step in range(args.steps):
                metrics = jax.device_get(trainer.step())
                print(f"{preset} step {step + 1}: loss {float(metrics['loss']).hex()} "
                      f"grad_norm {float(metrics['grad_norm']).hex()}", flush=True)
            trainer.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
