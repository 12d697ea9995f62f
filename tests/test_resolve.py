"""The resolve step (maxtext_rocm/resolve.py): one table of its decisions, written from the
documented rules (docs/configs.md, docs/precision.md, docs/parallelism.md, the module docstrings),
and no "auto" left in any preset's resolved config."""

import json
from pathlib import Path

import jax
import ml_collections
import pytest

from conftest import small_config
from maxtext_rocm import config as config_lib
from maxtext_rocm.config.choices import PRECISION_VARIANTS
from maxtext_rocm.parallel import sharding
from maxtext_rocm.planner.gpu_nodes import resolve_target
from maxtext_rocm.resolve import Target, resolve

ROOT = Path(__file__).resolve().parents[1]
CPU = Target("cpu")
MI300X, MI355X, H100 = resolve_target("mi300x"), resolve_target("mi355x"), resolve_target("h100")
FSDP8 = {"mesh.ici.fsdp": 8}

# (target, overrides, expected resolved values). Meshes are over the 8 fake CPU devices.
DECISIONS = [
    # precision.fp8_format (docs/precision.md): FNUZ on gfx942 (MI300X/MI325X), OCP elsewhere, CPU included
    (MI300X, {"precision.policy": "fp8"}, {"precision.fp8_format": "fnuz"}),
    (resolve_target("mi325x"), {"precision.policy": "fp8"}, {"precision.fp8_format": "fnuz"}),
    (MI355X, {"precision.policy": "fp8"}, {"precision.fp8_format": "ocp"}),
    (H100, {"precision.policy": "fp8"}, {"precision.fp8_format": "ocp"}),
    (CPU, {"precision.policy": "fp8"}, {"precision.fp8_format": "ocp"}),
    (MI300X, {"precision.policy": "fp8", "precision.fp8_format": "ocp"}, {"precision.fp8_format": "ocp"}),
    # under bf16 the format fp8 would use there, which nothing reads
    (MI300X, {"precision.policy": "bf16"}, {"precision.fp8_format": "fnuz"}),
    (CPU, {"precision.policy": "bf16"}, {"precision.fp8_format": "ocp"}),
    # model.attention (docs/configs.md#attention): cuDNN on CUDA in bf16 (fp32: blockwise), blockwise
    # on ROCm, on the CPU blockwise from 1024-token sequences and xla below
    (H100, {"precision.policy": "bf16"}, {"model.attention": "cudnn"}),
    (H100, {"precision.policy": "fp8"}, {"model.attention": "cudnn"}),
    (H100, {"precision.policy": "fp32"}, {"model.attention": "blockwise"}),
    (MI300X, {"precision.policy": "bf16"}, {"model.attention": "blockwise"}),
    (MI355X, {"precision.policy": "fp32"}, {"model.attention": "blockwise"}),
    (CPU, {"train.seq_len": 1023}, {"model.attention": "xla"}),
    (CPU, {"train.seq_len": 1024}, {"model.attention": "blockwise"}),
    (H100, {"model.attention": "xla"}, {"model.attention": "xla"}),
    (MI300X, {"model.attention": "pallas"}, {"model.attention": "pallas"}),
    # model.fuse_projections (docs/parallelism.md): on when mesh tensor > 1
    (CPU, FSDP8, {"model.fuse_projections": "off"}),
    (CPU, {"mesh.ici.fsdp": 4, "mesh.ici.tensor": 2}, {"model.fuse_projections": "on"}),
    (CPU, {"mesh.ici.fsdp": 4, "mesh.ici.tensor": 2, "model.fuse_projections": "off"},
     {"model.fuse_projections": "off"}),
    (CPU, {**FSDP8, "model.fuse_projections": "on"}, {"model.fuse_projections": "on"}),
    # pipeline.microbatches (docs/parallelism.md): 0 takes the most, up to 4 per stage, that split
    # each batch shard's sequences; interleaved 1F1B in multiples of the stages where it can
    (CPU, FSDP8, {"pipeline.microbatches": 1}),  # no pipeline: the batch is one microbatch
    # 2 stages x 4 batch shards, 32 sequences: 8 per shard, and 8 is 4 x 2 stages
    (CPU, {"mesh.ici.stage": 2, "mesh.ici.fsdp": 4, "train.per_device_batch_size": 4}, {"pipeline.microbatches": 8}),
    # 16 sequences in 2 micro-batches of 8, 2 per batch shard
    (CPU, {"mesh.ici.stage": 2, "mesh.ici.fsdp": 4, "train.per_device_batch_size": 2, "train.grad_accum": 2},
     {"pipeline.microbatches": 2}),
    # 4 stages x 2 shards, 40 sequences, 20 per shard: at most 16, of which 10 divides 20
    (CPU, {"mesh.ici.stage": 4, "mesh.ici.fsdp": 2, "train.per_device_batch_size": 5, "model.n_layers": 8},
     {"pipeline.microbatches": 10}),
    # the same, interleaved (1f1b, 2 repeats): a multiple of the 4 stages, so 4
    (CPU, {"mesh.ici.stage": 4, "mesh.ici.fsdp": 2, "train.per_device_batch_size": 5, "model.n_layers": 8,
           "pipeline.schedule": "1f1b", "pipeline.repeats": 2}, {"pipeline.microbatches": 4}),
    # 12 per shard under 2 stages: 6 of them divides it; no multiple of 4 stages' groups needed
    (CPU, {"mesh.ici.stage": 2, "mesh.ici.fsdp": 4, "train.per_device_batch_size": 6}, {"pipeline.microbatches": 6}),
    (CPU, {"mesh.ici.stage": 2, "mesh.ici.fsdp": 4, "train.per_device_batch_size": 4, "pipeline.microbatches": 2},
     {"pipeline.microbatches": 2}),
    # model.moe_impl (docs/configs.md#mixtral-mixture-of-experts): dropless on every backend
    (CPU, {"model.family": "mixtral", "model.n_experts": 4, "model.experts_per_token": 2}, {"model.moe_impl": "dropless"}),
    (H100, {"model.family": "mixtral", "model.n_experts": 4, "model.experts_per_token": 2}, {"model.moe_impl": "dropless"}),
    (CPU, {"model.moe_impl": "capacity"}, {"model.moe_impl": "capacity"}),
    # model.context_parallel (docs/parallelism.md, parallel/context.py): all_gather
    (CPU, {"mesh.ici.sequence": 8, "mesh.ici.fsdp": 1}, {"model.context_parallel": "all_gather"}),
    (MI300X, {"mesh.ici.sequence": 8, "mesh.ici.fsdp": 1, "model.context_parallel": "ring"},
     {"model.context_parallel": "ring"}),
]


@pytest.mark.parametrize("target, overrides, expected", DECISIONS,
                         ids=[f"{t.platform}{'-fnuz' if t.fp8_fnuz else ''}-" + "-".join(f"{k}={v}" for k, v in o.items())
                              for t, o, _ in DECISIONS])
def test_resolve_decides(target, overrides, expected):
    cfg = small_config(**{**FSDP8, **overrides})
    resolved = resolve(cfg, sharding.make_mesh(cfg.mesh, jax.devices()), target)
    got = {key: resolved[key.split(".")[0]][key.split(".")[1]] for key in expected}
    assert got == expected


def test_targets_of_devices_and_gpu_kinds():
    assert Target.of_device(jax.devices()[0]) == Target("cpu", fp8_fnuz=False)
    assert [resolve_target(k) for k in ("mi300x", "mi355x", "h100")] == [
        Target("rocm", True), Target("rocm", False), Target("cuda", False)]
    with pytest.raises(ValueError, match="unknown GPU kind 'a100'"):
        resolve_target("a100")


def test_resolved_config_is_read_only_and_the_input_unchanged():
    cfg = small_config(**FSDP8)
    resolved = resolve(cfg, sharding.make_mesh(cfg.mesh, jax.devices()), CPU)
    assert isinstance(resolved, ml_collections.FrozenConfigDict)
    assert cfg.model.attention == "auto" and cfg.pipeline.microbatches == 0
    with pytest.raises((AttributeError, TypeError, ValueError)):
        resolved.model.attention = "xla"
    assert resolve(resolved, sharding.make_mesh(cfg.mesh, jax.devices()), CPU) == resolved


def test_an_unresolved_config_is_refused_by_the_model():
    from maxtext_rocm.models import build_model
    from maxtext_rocm.numerics.precision import policy_from_config

    cfg = small_config(**FSDP8)
    with pytest.raises(ValueError, match=r"fuse_projections='auto' .*resolve\(\) was skipped"):
        build_model(cfg.model, policy_from_config(cfg.precision))
    cfg.precision.policy = "fp8"
    with pytest.raises(ValueError, match=r"fp8_format='auto' .*resolve\(\) was skipped"):
        policy_from_config(cfg.precision)


# Run-time policies, not decisions about the program: where the compilation cache lives is
# decided from $JAX_COMPILATION_CACHE_DIR and output_dir when the Trainer starts it, and which
# checkpoint a run resumes from by what is on disk when it opens (a recorded config re-run must
# look again). config.json keeps them as asked.
RUN_TIME_AUTOS = {"train.compilation_cache", "checkpoint.resume"}


def autos(tree, prefix=""):
    """The dotted keys of every leaf that says "auto"."""
    found = []
    for key, value in tree.items():
        path = f"{prefix}{key}"
        if isinstance(value, dict):
            found += autos(value, path + ".")
        elif isinstance(value, (list, tuple)):
            found += [f"{path}[{i}]" for i, v in enumerate(value) if v == "auto"]
        elif value == "auto":
            found.append(path)
    return found


PRESETS = sorted(p.stem for p in (ROOT / "configs").glob("*.py"))


@pytest.mark.parametrize("variant", PRECISION_VARIANTS)
@pytest.mark.parametrize("preset", PRESETS)
def test_no_auto_is_left_in_any_preset(preset, variant):
    cfg = config_lib.load(f"configs/{preset}.py" + (f":{variant}" if variant else ""))
    try:
        mesh = sharding.make_mesh(cfg.mesh, jax.devices())
    except config_lib.ConfigError:  # a mesh for more devices than the 8 here: the default's
        mesh = sharding.make_mesh(config_lib.defaults().mesh, jax.devices())
    assert "auto" in json.dumps(cfg.to_dict())  # there is something to resolve
    resolved = resolve(cfg, mesh, CPU)
    assert set(autos(resolved.to_dict())) <= RUN_TIME_AUTOS
    assert resolved.pipeline.microbatches >= 1


def test_config_json_of_a_cli_run_records_the_resolved_config(tmp_path):
    from maxtext_rocm import train

    out = tmp_path / "run"
    code = train.main(["configs/tiny_llama.py:fp8", "--config.train.steps=1", "--config.train.seq_len=64",
                       "--config.train.per_device_batch_size=1", "--config.data.source=synthetic",
                       "--config.checkpoint.enabled=false", "--config.log.tensorboard=false",
                       f"--config.output_dir={out}"])
    assert code in (0, None)
    recorded = json.loads((out / "config.json").read_text())["config"]
    assert set(autos(recorded)) <= RUN_TIME_AUTOS
    assert recorded["precision"]["fp8_format"] == "ocp"  # the CPU's
    assert recorded["model"]["attention"] == "xla"  # 64 tokens on the CPU
    assert recorded["model"]["fuse_projections"] == "off"  # mesh tensor = 1
    assert recorded["pipeline"]["microbatches"] == 1
