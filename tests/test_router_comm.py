"""The MoE router's softmax and top-k run where the tokens are: the compiled step of a small
Mixtral moves none of the router's probabilities between devices, with the batch split over
`expert` and `fsdp`, and under a pipeline over `stage` too.

XLA's TopK is partitioned only along its sorted axis, so `jax.lax.top_k` on batch-sharded router
probabilities gathered all of them to every device, once per layer and per recomputation
(docs/figures.md, "Qwen3 plans"); models/moe.py's `top_k_of_each` sorts instead."""

import os
import re
import subprocess
import sys

import pytest

SEQ, EXPERTS, D_MODEL = 32, 8, 64  # distinct, so a [..., SEQ, EXPERTS] shape is the router's


def _all_gathers(text: str) -> list[tuple[str, str]]:
    """(result shape, op_name) of every all-gather in an optimized HLO module's text."""
    found = []
    for line in text.splitlines():
        op = re.search(r"= (.*?) all-gather(?:-start)?\(", line)
        if op:
            name = re.search(r'op_name="([^"]*)"', line)
            found.append((op.group(1), name.group(1) if name else ""))
    return found


def _router_probabilities(shape: str) -> bool:
    """An f32 array [..., tokens of a sequence, experts]: the router's logits or probabilities."""
    for dims in re.findall(r"f32\[([\d,]*)\]", shape):
        sizes = [int(x) for x in filter(None, dims.split(","))]
        if sizes[-2:] == [SEQ, EXPERTS]:
            return True
    return False


def _optimized_step(tmp_path, mesh_axes: dict) -> str:
    """The optimized HLO of a small Mixtral's train step (dropless, fp32, remat full) for 8 GPUs
    with `mesh_axes`, as `python -m maxtext_rocm.compile` builds it, from XLA's dump."""
    dump = tmp_path / "dump"
    sizes = [f"--config.mesh.ici.{a}={mesh_axes.get(a, 1)}"
             for a in ("stage", "data", "fsdp", "expert", "sequence", "tensor")]
    result = subprocess.run(
        [sys.executable, "-m", "maxtext_rocm.compile", "tiny_mixtral", "--target=mi355x:8", *sizes,
         "--config.precision.policy=fp32", "--config.model.moe_impl=dropless", "--config.model.remat=full",
         f"--config.model.n_experts={EXPERTS}", "--config.model.experts_per_token=2",
         f"--config.model.d_model={D_MODEL}", "--config.model.n_layers=2", "--config.model.n_heads=4",
         "--config.model.n_kv_heads=2", "--config.model.head_dim=16", "--config.model.mlp_dim=32",
         "--config.model.vocab_size=128", "--config.model.scan_layers=true", "--config.data.source=synthetic",
         f"--config.train.seq_len={SEQ}", "--config.train.per_device_batch_size=1"],
        env={**os.environ, "XLA_FLAGS": f"--xla_dump_to={dump} --xla_dump_hlo_as_text", "JAX_PLATFORMS": "cpu"},
        capture_output=True, text=True, timeout=300, cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert result.returncode == 0, result.stderr[-2000:]
    (optimized,) = dump.glob("*jit_train_step*after_optimizations.txt")
    return optimized.read_text()


@pytest.mark.parametrize("mesh_axes", [{"expert": 4, "fsdp": 2},
                                       pytest.param({"stage": 2, "expert": 4}, marks=pytest.mark.slow)])
def test_no_collective_gathers_the_router_probabilities(mesh_axes, tmp_path):
    gathers = _all_gathers(_optimized_step(tmp_path, mesh_axes))
    # The step gathers the router's kernel [d_model, experts] (ZeRO-3; newer XLA names the gather
    # after the layer's slice of the stacked weights), and nothing routed.
    assert any(re.search(rf"f32\[(1,)?{D_MODEL},{EXPERTS}\]", shape) for shape, _ in gathers), gathers
    routed = [(shape, name) for shape, name in gathers
              if _router_probabilities(shape) or re.search(r"moe/(top_k|sort|softmax)", name)]
    assert routed == [], routed
