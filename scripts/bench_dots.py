#!/usr/bin/env python
"""GFLOP/s of one matmul and of its gradient on this machine's backend: XLA's dot in fp32, XLA's
dot in bf16, and precision.f32_accumulating_dot_general (bf16 operands, fp32 accumulation and
result, rounded to bf16), the dot the bf16 policy uses on the CPU.

    python scripts/bench_dots.py [--repeats 20]

Shapes are [tokens, in] x [in, out] as in a dense layer of the reference comparison's model
(1,024 tokens, d_model 256, mlp 1,024) and one MoE block (128 rows). All variants are timed in
one process, one after another; read the ratios within a row: the machine is shared.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from gpu_check import timed  # noqa: E402  (this directory)
from maxtext_rocm.numerics.precision import f32_accumulating_dot_general  # noqa: E402

SHAPES = [(1024, 256, 1024), (1024, 1024, 256), (1024, 256, 256), (128, 256, 1024)]
DIMS = (((1,), (0,)), ((), ()))
VARIANTS = {
    "fp32 (XLA)": (jnp.float32, jax.lax.dot_general),
    "bf16 (XLA)": (jnp.bfloat16, jax.lax.dot_general),
    "bf16, fp32 accumulation": (jnp.bfloat16, f32_accumulating_dot_general),
}


def _programs(dot):
    forward = jax.jit(lambda a, b: dot(a, b, DIMS))
    # A square so that the gradient needs the product itself as well as its two transposes.
    gradient = jax.jit(jax.grad(lambda a, b: jnp.sum(jnp.square(dot(a, b, DIMS).astype(jnp.float32))),
                                argnums=(0, 1)))
    return forward, gradient


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=20, help="timed calls per variant and shape")
    args = parser.parse_args()
    print(f"backend: {jax.default_backend()}, {jax.device_count()} x {jax.devices()[0].device_kind}")
    print("| [m, k] x [k, n] | " + " | ".join(f"{name}: forward / with gradient" for name in VARIANTS) + " |")
    print("|---" * (len(VARIANTS) + 1) + "|")
    for m, k, n in SHAPES:
        flops = 2 * m * k * n
        cells = []
        for dtype, dot in VARIANTS.values():
            a, b = jnp.ones((m, k), dtype), jnp.ones((k, n), dtype)
            forward, gradient = _programs(dot)
            # forward: one product; with gradient: the product and its two transposes
            rates = (flops / timed(forward, a, b, repeats=args.repeats),
                     3 * flops / timed(gradient, a, b, repeats=args.repeats))
            cells.append(" / ".join(f"{r / 1e9:,.0f}" for r in rates))
        print(f"| [{m}, {k}] x [{k}, {n}] | " + " | ".join(cells) + " |")
    print("GFLOP/s, medians of --repeats calls")
    return 0


if __name__ == "__main__":
    sys.exit(main())
