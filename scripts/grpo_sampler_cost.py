"""GRPO's sampler on 8 fake CPU devices (mesh fsdp=8), its two weight layouts side by side.

    python scripts/grpo_sampler_cost.py [--rows=8] [--max-new-tokens=32] [--repeats=5]

For grpo.sampler_weights "training" (decode from the sharded training layout) and "gathered"
(the default: the weights gathered over fsdp once per step), prints the all-gathers XLA left
inside the decode loop's body (each runs once per generated token) and in the whole program, and
the median time of one sampling call. A tiny_llama-shaped model (d_model 256, 4 layers) in bf16.
On a CPU the 8 "devices" share the host's cores, so the time mostly shows the work the gathers
add; on GPUs each gather crosses the interconnect at every token.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import time

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import ml_collections  # noqa: E402
import numpy as np  # noqa: E402
from flax import linen as nn  # noqa: E402

from maxtext_rocm import config as config_lib  # noqa: E402
from maxtext_rocm.data.prompts import Prompt  # noqa: E402
from maxtext_rocm.finetune.grpo import rollout  # noqa: E402
from maxtext_rocm.finetune.grpo.sampler import Sampler  # noqa: E402
from maxtext_rocm.numerics.precision import policy_from_config  # noqa: E402
from maxtext_rocm.parallel import sharding  # noqa: E402
from maxtext_rocm.resolve import Target, resolve  # noqa: E402
from maxtext_rocm.trainer import launch  # noqa: E402


def gathers(hlo: str) -> tuple[int, int]:
    """(all-gathers inside while-loop bodies, all-gathers in the program) of optimized HLO text."""
    bodies = set(re.findall(r"body=%?([\w.\-]+)", hlo))
    inside = 0
    for computation in re.split(r"\n(?=\S)", hlo):
        name = computation.split(" ", 1)[0].lstrip("%")
        if name in bodies:
            inside += len(re.findall(r"all-gather(?:-start)?\(", computation))
    return inside, len(re.findall(r"all-gather(?:-start)?\(", hlo))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    cfg = config_lib.load_preset("tiny_llama")
    cfg.model.update(scan_layers=True)
    cfg.train.update(seq_len=2 * args.max_new_tokens, per_device_batch_size=1)
    cfg.grpo.update(max_new_tokens=args.max_new_tokens, temperature=1.0)
    mesh = sharding.make_mesh(cfg.mesh, jax.devices())
    cfg = resolve(cfg, mesh, Target.of_device(jax.devices()[0]))
    policy = policy_from_config(cfg.precision)
    model = launch.model_for_mesh(cfg, launch.run_policy(cfg, jax.devices()[0]), mesh)
    layout = launch.stored_state(cfg, model, mesh)
    state = jax.jit(lambda k: nn.meta.unbox(layout.init(k)), out_shardings=layout.sharding)(layout.key)
    prompts = [Prompt({}, "", np.arange(3, 3 + args.max_new_tokens // 2, dtype=np.int32))] * args.rows
    tokens, positions = rollout.left_padded(prompts, 1, cfg.train.seq_len - args.max_new_tokens)
    print(f"tiny_llama (d_model {cfg.model.d_model}, {cfg.model.n_layers} layers, bf16), mesh fsdp=8, "
          f"{args.rows} rows, {args.max_new_tokens} new tokens")
    for weights in ("training", "gathered"):
        c = ml_collections.ConfigDict(cfg)
        c.grpo.sampler_weights = weights
        sampler = Sampler(ml_collections.FrozenConfigDict(c), policy, mesh, layout.sharding, args.rows, ())
        with sharding.rules_context(mesh):
            placed = [jax.device_put(a, sharding.batch_sharding(mesh)) for a in (tokens, positions)]
            hlo = sampler._jitted.lower(state.params, {}, state.fp8, *placed, jax.random.key(0)).compile().as_text()
        inside, total = gathers(hlo)
        sampler(state, tokens, positions, jax.random.key(0))[0].block_until_ready()  # compiled and warm
        times = []
        for i in range(args.repeats):
            start = time.perf_counter()
            sampler(state, tokens, positions, jax.random.key(i + 1))[0].block_until_ready()
            times.append(time.perf_counter() - start)
        print(f"  sampler_weights={weights:9s} all-gathers in the decode loop {inside:3d}, in the program "
              f"{total:3d}; {statistics.median(times):.3f} s per sampling call (median of {args.repeats})")


if __name__ == "__main__":
    main()
