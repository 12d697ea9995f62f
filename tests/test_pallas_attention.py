"""The Pallas flash attention (models/pallas_attention.py) against the "xla" reference, in Pallas'
interpreter on the CPU: values and the gradients of q, k and v, causal, grouped-query, packed
documents, sliding windows, head_dim 64 and 128, fp32 and bf16; its block ranges against a brute
force mask; its Triton lowering for CUDA and ROCm (lowered here, not compiled); its split over a
mesh without communication; the trainer with it; and the errors for what it cannot serve."""

import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import jax
import jax.extend.core
import jax.numpy as jnp
import numpy as np
import pytest

from maxtext_rocm.config import ConfigError
from maxtext_rocm.models import pallas_attention as pa
from maxtext_rocm.models.attention import attention_mask, masked_attention, resolve_implementation
from maxtext_rocm.trainer.preflight import check_run

# Small tiles, different in the forward and the backward, so that every sequence below spans
# several of each and both the masked and the unmasked block loops run.
SMALL_BLOCKS = pa.BlockSizes(forward_q=32, forward_k=16, backward_q=16, backward_k=32)


def inputs(seq, heads, kv_heads, head_dim, dtype, documents, batch=2):
    keys = jax.random.split(jax.random.key(0), 4)
    q = jax.random.normal(keys[0], (batch, seq, heads, head_dim), jnp.float32).astype(dtype)
    k = jax.random.normal(keys[1], (batch, seq, kv_heads, head_dim), jnp.float32).astype(dtype)
    v = jax.random.normal(keys[2], (batch, seq, kv_heads, head_dim), jnp.float32).astype(dtype)
    cotangent = jax.random.normal(keys[3], q.shape, jnp.float32)
    segments = None
    if documents:  # uneven boundaries, a different split per row, one document longer than a block
        bounds = np.array([[seq // 3, seq // 3 + 5], [7, seq - 9]])
        rows = [np.searchsorted(bounds[row % 2], np.arange(seq), side="right") for row in range(batch)]
        segments = jnp.asarray(np.stack(rows), jnp.int32)
    return (q, k, v), cotangent, segments


def value_and_grads(attend, qkv, cotangent):
    """[out, dq, dk, dv] as fp32 numpy, from one compiled program."""
    def run(q, k, v):
        out, vjp = jax.vjp(attend, q, k, v)
        return (out, *vjp(cotangent.astype(out.dtype)))

    return [np.asarray(x, np.float32) for x in jax.jit(run)(*qkv)]


CASES = {  # name: (seq, heads, kv_heads, head_dim, documents, window)
    "causal_gqa_d128": (64, 8, 2, 128, False, None),
    "documents_gqa_d64": (64, 4, 2, 64, True, None),
    "window_gqa_d64": (64, 4, 2, 64, False, 20),
    "documents_window_mqa_d128": (64, 4, 1, 128, True, 24),
    "padded_seq_window_mha_d64": (40, 2, 2, 64, False, 7),  # 40 tokens: padded to 48 inside
}


# CI runs two cases that between them cover GQA, MQA, documents and windows; `-m slow` all.
FAST_CASES = ("documents_gqa_d64", "documents_window_mqa_d128")


@pytest.mark.parametrize("case", [c if c in FAST_CASES else pytest.param(c, marks=pytest.mark.slow) for c in CASES])
def test_matches_xla_in_fp32(case):
    seq, heads, kv_heads, head_dim, documents, window = CASES[case]
    qkv, cotangent, segments = inputs(seq, heads, kv_heads, head_dim, jnp.float32, documents)
    got = value_and_grads(lambda q, k, v: pa.pallas_attention(
        q, k, v, segment_ids=segments, sliding_window=window, blocks=SMALL_BLOCKS), qkv, cotangent)
    mask = attention_mask(seq, segments, window)
    want = value_and_grads(lambda q, k, v: masked_attention(q, k, v, mask), qkv, cotangent)
    for name, g, w in zip(("out", "dq", "dk", "dv"), got, want):
        np.testing.assert_allclose(g, w, atol=1e-5 * np.abs(w).max(), rtol=1e-5, err_msg=name)


def test_matches_xla_in_bf16():
    """bf16 inputs, fp32 statistics: within bf16 rounding of the fp32 reference of the same
    (bf16-rounded) inputs, and no further from it than the "xla" attention run in bf16 is, give
    or take one bf16 rounding step."""
    qkv, cotangent, segments = inputs(64, 4, 2, 128, jnp.bfloat16, documents=True)
    cotangent = cotangent.astype(jnp.bfloat16).astype(jnp.float32)  # the same for every run
    window = 24
    mask = attention_mask(64, segments, window)
    got = value_and_grads(lambda q, k, v: pa.pallas_attention(
        q, k, v, segment_ids=segments, sliding_window=window, blocks=SMALL_BLOCKS), qkv, cotangent)
    xla_bf16 = value_and_grads(lambda q, k, v: masked_attention(q, k, v, mask), qkv, cotangent)
    reference = value_and_grads(lambda q, k, v: masked_attention(q, k, v, mask),
                                [x.astype(jnp.float32) for x in qkv], cotangent)
    for name, g, x, r in zip(("out", "dq", "dk", "dv"), got, xla_bf16, reference):
        scale = np.abs(r).max()
        error, xla_error = np.abs(g - r).max() / scale, np.abs(x - r).max() / scale
        assert error < 2e-2, (name, error)
        assert error <= xla_error + 2 ** -8, (name, error, xla_error)


def test_default_blocks_and_dot_product_attention_entry_point():
    """model.attention="pallas" through the one entry point, with the default tiles (one block of
    the 64 tokens here), equals "xla"."""
    from maxtext_rocm.models.attention import dot_product_attention

    qkv, cotangent, segments = inputs(64, 4, 2, 64, jnp.float32, documents=True)
    got, want = (value_and_grads(lambda q, k, v, impl=impl: dot_product_attention(
        q, k, v, segment_ids=segments, implementation=impl), qkv, cotangent) for impl in ("pallas", "xla"))
    for name, g, w in zip(("out", "dq", "dk", "dv"), got, want):
        np.testing.assert_allclose(g, w, atol=1e-5 * np.abs(w).max(), rtol=1e-5, err_msg=name)


def test_kv_heads_are_indexed_not_repeated():
    """Every kernel takes K and V at kv_heads width, and dK/dV come out at that width: the query
    head's kv head is picked by the BlockSpec index map, never by repeating K/V to heads width."""
    qkv, cotangent, _ = inputs(64, 8, 2, 64, jnp.float32, documents=False, batch=1)

    def loss(q, k, v):
        return jnp.sum(pa.pallas_attention(q, k, v) * cotangent)

    kernels = {}

    def collect(jaxpr):
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "pallas_call":
                kernels.setdefault(eqn.params["name"], eqn)
                continue
            for param in eqn.params.values():
                for sub in param if isinstance(param, (list, tuple)) else [param]:
                    if isinstance(sub, (jax.extend.core.Jaxpr, jax.extend.core.ClosedJaxpr)):
                        collect(getattr(sub, "jaxpr", sub))

    collect(jax.make_jaxpr(jax.grad(loss, argnums=(0, 1, 2)))(*qkv).jaxpr)
    assert set(kernels) == {"flash_attention_forward", "flash_attention_dq", "flash_attention_dkv"}
    kv_shape = (1, 64, 2, 64)
    for name, eqn in kernels.items():
        assert [tuple(v.aval.shape) for v in eqn.invars[1:3]] == [kv_shape, kv_shape], name
    assert [tuple(v.aval.shape) for v in kernels["flash_attention_dkv"].outvars] == [kv_shape, kv_shape]


def test_splits_over_batch_and_heads_without_communication(devices):
    """On a (data 4, tensor 2) mesh, batch over data and kv heads over tensor: the kernels run on
    each device's own rows and heads (pallas_sharding.py), the compiled program holds no
    collective, its results keep that sharding, and they equal the unsharded "xla" attention."""
    from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

    qkv, cotangent, segments = inputs(64, 4, 2, 64, jnp.float32, documents=True, batch=4)
    mesh = jax.make_mesh((4, 2), ("data", "tensor"), axis_types=(AxisType.Auto,) * 2, devices=devices)
    heads = NamedSharding(mesh, P("data", None, "tensor", None))
    sharded = [jax.device_put(x, heads) for x in qkv]

    def run(q, k, v, segments):
        out, vjp = jax.vjp(lambda q, k, v: pa.pallas_attention(
            q, k, v, segment_ids=segments, sliding_window=30, blocks=SMALL_BLOCKS), q, k, v)
        return (out, *vjp(cotangent))

    compiled = jax.jit(run).lower(*sharded, jax.device_put(segments, NamedSharding(mesh, P("data")))).compile()
    hlo = compiled.as_text()
    for collective in ("all-gather", "all-reduce", "all-to-all", "collective-permute", "reduce-scatter"):
        assert collective not in hlo, collective
    got = compiled(*sharded, jax.device_put(segments, NamedSharding(mesh, P("data"))))
    mask = attention_mask(64, segments, 30)
    want = value_and_grads(lambda q, k, v: masked_attention(q, k, v, mask), qkv, cotangent)
    for name, g, w in zip(("out", "dq", "dk", "dv"), got, want):
        assert g.sharding.spec[:3] == ("data", None, "tensor"), name
        np.testing.assert_allclose(np.asarray(g), w, atol=1e-5 * np.abs(w).max(), rtol=1e-5, err_msg=name)


@pytest.mark.parametrize("block_q, block_k", [(16, 16), (32, 16), (16, 32)])
@pytest.mark.parametrize("window", [0, 5, 16, 40])
@pytest.mark.parametrize("segmented", [False, True])
def test_block_ranges_cover_the_mask(block_q, block_k, window, segmented):
    """The blocks each kernel visits are exactly those the causal/window mask touches, each once,
    and those it visits without a mask are wholly visible (none with documents)."""
    seq = 96
    q_pos, k_pos = np.arange(seq)[:, None], np.arange(seq)[None, :]
    visible = (k_pos <= q_pos) & ((q_pos - k_pos < window) if window else True)
    n_q, n_k = seq // block_q, seq // block_k

    def tile(i, j):
        return visible[i * block_q:(i + 1) * block_q, j * block_k:(j + 1) * block_k]

    def visited(bounds):
        first, lo, hi, last = (int(b) for b in bounds)
        assert first <= lo <= hi <= last
        return set(range(first, lo)) | set(range(hi, last)), set(range(lo, hi))

    for i in range(n_q):
        masked, whole = visited(pa._key_blocks(i, block_q, block_k, window, segmented))
        assert masked | whole == {j for j in range(n_k) if tile(i, j).any()}, i
        assert all(tile(i, j).all() for j in whole), i
        assert not (segmented and whole)
    for j in range(n_k):
        masked, whole = visited(pa._query_blocks(j, block_q, block_k, n_q, window, segmented))
        assert masked | whole == {i for i in range(n_q) if tile(i, j).any()}, j
        assert all(tile(i, j).all() for i in whole), j
        assert not (segmented and whole)


def _named_gpu(platform, monkeypatch):
    """Names the GPU that Pallas' Triton lowering asks about, on a host without one. jax 0.10 fell
    back by itself; jax >= 0.12 asks the default device (or an abstract mesh's device, which this
    export cannot use: pallas_call needs devices present at lowering) and raises "No supported GPU
    devices found" on a CPU. So answer for an H100 (CUDA) or an MI300X, gfx942 (ROCm). The module
    moved: jax 0.12.0 kept it beside the Triton lowering, 0.12.1 in jax._src."""
    from jax._src.pallas.triton import pallas_call_registration
    gpu_info = getattr(pallas_call_registration, "gpu_info_lib", None)
    if gpu_info is None:  # jax 0.10: no gpu_info module, nothing to name
        return
    if platform == "cuda":
        info = gpu_info.get_gpu_info_from_version(gpu_info.GpuVersion.H100)
    else:
        info = gpu_info.GpuInfo(gpu_version=None, arch_name="gfx942", compute_capability=0)
    monkeypatch.setattr(gpu_info, "get_gpu_info", lambda: info)


@pytest.mark.parametrize("platform", ["cuda", "rocm"])
def test_gpu_path_lowers_to_three_triton_kernels(platform, monkeypatch):
    """The GPU branch is lowered here for CUDA and ROCm without a GPU (jax.export): Pallas' Triton
    lowering accepts every kernel (its power-of-two tiles, the GQA index maps, documents and the
    window) at Llama 3 8B's heads, and only the GPU branch is kept. Compiling the Triton IR to a
    GPU binary happens on the device (scripts/gpu_check.py)."""
    from jax import export

    def grads(q, k, v, segments):
        def loss(q, k, v):
            out = pa.pallas_attention(q, k, v, segment_ids=segments, sliding_window=300)
            return jnp.sum(out.astype(jnp.float32))
        return jax.grad(loss, argnums=(0, 1, 2))(q, k, v)

    q = jax.ShapeDtypeStruct((2, 1024, 32, 128), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((2, 1024, 8, 128), jnp.bfloat16)
    segments = jax.ShapeDtypeStruct((2, 1024), jnp.int32)
    triton = "__gpu$xla.gpu.triton"
    _named_gpu(platform, monkeypatch)
    exported = export.export(jax.jit(grads), platforms=[platform],
                             disabled_checks=[export.DisabledSafetyCheck.custom_call(triton)])(q, kv, kv, segments)
    module = exported.mlir_module()
    assert module.count(f"stablehlo.custom_call @{triton}") == 3  # forward, dQ, dK/dV
    for name in ("flash_attention_forward", "flash_attention_dq", "flash_attention_dkv"):
        assert name in module
    assert "stablehlo.while" not in module  # the interpreter's grid loop is not in the GPU program


@pytest.mark.slow  # 47-113 s on the shared 2-core machine: two trainers compiled
def test_tiny_model_training_step_equals_xla(devices, tmp_path):
    """One optimizer step of the small model (scanned layers, GQA, head_dim 16) with
    model.attention="pallas": the same loss and the same updated parameters as with "xla"."""
    from conftest import small_config
    from helpers import assert_trees_close
    from maxtext_rocm.train import Trainer

    results = {}
    for implementation in ("xla", "pallas"):
        cfg = small_config(**{"model.attention": implementation, "mesh.ici.fsdp": 1,
                              "output_dir": str(tmp_path / implementation), "checkpoint.enabled": False})
        trainer = Trainer(cfg, devices=devices[:1], log=lambda *_: None)
        loss = float(trainer.step()["loss"])
        results[implementation] = loss, jax.tree_util.tree_map(np.asarray, trainer.state.params)
    (xla_loss, xla_params), (pallas_loss, pallas_params) = results["xla"], results["pallas"]
    assert abs(pallas_loss - xla_loss) <= 1e-5 * abs(xla_loss)
    assert_trees_close(pallas_params, xla_params, atol=1e-6)


def test_pallas_is_refused_on_a_tpu_and_auto_never_picks_it():
    def device(platform, version):
        return SimpleNamespace(platform=platform, client=SimpleNamespace(platform_version=version))

    with pytest.raises(ConfigError, match="model.attention='pallas' runs on GPUs .* not on tpu; use model.attention='blockwise'"):
        resolve_implementation("pallas", device("tpu", "tpu"))
    assert resolve_implementation("pallas", device("gpu", "PJRT C API\nrocm 6.4.1")) == "pallas"
    assert resolve_implementation("pallas", device("cpu", "cpu")) == "pallas"
    for platform, version in (("gpu", "cuda 13000"), ("gpu", "rocm 6.4.1"), ("cpu", "cpu")):
        assert resolve_implementation("auto", device(platform, version), seq_len=8192) != "pallas"


def test_unsupported_head_dim_is_a_config_error():
    from conftest import small_config
    from maxtext_rocm import config as config_lib

    check_run(small_config(**{"model.attention": "pallas"}))  # head_dim 16: served
    with pytest.raises(ConfigError, match=r"model.attention='pallas' needs model.head_dim to be a power of two "
                                          r"from 16 to 256 .*, got 96; use model.attention='blockwise' or 'xla'"):
        check_run(small_config(**{"model.attention": "pallas", "model.head_dim": 96}))


def test_unsupported_head_dim_exits_2_from_the_command_line(tmp_path):
    result = subprocess.run([sys.executable, "-m", "maxtext_rocm.train", "configs/tiny_llama.py",
                             "--config.model.attention=pallas", "--config.model.head_dim=96",
                             f"--config.output_dir={tmp_path / 'run'}"],
                            capture_output=True, text=True, timeout=300,
                            cwd=Path(__file__).resolve().parents[1])
    assert result.returncode == 2
    assert result.stderr.startswith("error: model.attention='pallas' needs model.head_dim")
    assert len(result.stderr.strip().splitlines()) == 1 and "Traceback" not in result.stderr
    assert not (tmp_path / "run").exists()
