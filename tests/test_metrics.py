"""Analytic FLOPs, the peak table, MFU and the metric writers."""

import json
import math
import struct

import pytest

from maxtext_rocm import config, metrics


def _model(**dims):
    m = config.defaults().model
    for key, value in dims.items():
        m[key] = value
    return m


def test_matmul_params_small_config():
    m = _model(vocab_size=100, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, mlp_dim=128)
    # Per layer: q 64*64=4096, k 64*32=2048, v 2048, o 4096, gate/up/down 3*64*128=24576 -> 36864.
    # Two layers 73728, LM head 64*100=6400.
    assert metrics.matmul_params(m) == 80_128


def test_matmul_params_counts_lm_head_when_tied():
    untied = _model(tie_embeddings=False)
    tied = _model(tie_embeddings=True)
    assert metrics.matmul_params(tied) == metrics.matmul_params(untied)


def test_unknown_family_is_refused():
    m = _model()
    m.family = "gpt2"
    with pytest.raises(NotImplementedError):
        metrics.matmul_params(m)


def test_llama3_8b_train_flops_per_token():
    m = _model(vocab_size=128256, d_model=4096, n_layers=32, n_heads=32, n_kv_heads=8,
               head_dim=128, mlp_dim=14336)
    # Matmul params: 32 layers x 218,103,808 + LM head 525,336,576 = 7,504,658,432.
    assert metrics.matmul_params(m) == 7_504_658_432
    # 6 x 7,504,658,432 = 45,027,950,592; attention 6*8192*32*128*32 = 6,442,450,944.
    assert metrics.train_flops_per_token(m, 8192) == 51_470_401_536
    assert "6" in metrics.FLOPS_CONVENTION and "\n" not in metrics.FLOPS_CONVENTION


@pytest.mark.parametrize("kind, policy, expected", [
    ("NVIDIA H100 80GB HBM3", "bf16", 989.4),
    ("NVIDIA H100 PCIe", "bf16", 756.0),
    ("NVIDIA H100 PCIe", "fp8", 1513.0),
    ("NVIDIA H200", "fp8", 1978.9),
    ("NVIDIA B200", "bf16", 2250.0),
    ("AMD Instinct MI300X", "bf16", 1307.4),
    ("MI300X", "fp8", 2614.9),
    ("AMD Instinct MI325X", "bf16", 1307.4),
    ("AMD Instinct MI355X", "fp8", 5033.2),
    ("AMD Instinct MI350X", "bf16", 2306.9),
    ("gfx942", "bf16", None),  # architecture alone is ambiguous (MI300X/MI325X/MI308X)
    ("AMD Instinct MI308X", "bf16", None),
    ("cpu", "bf16", None),
    ("AMD Instinct MI300X", "fp32", None),
])
def test_peak_tflops_lookup(kind, policy, expected):
    assert metrics.peak_tflops(kind, policy) == expected


def test_peak_tflops_override_wins():
    assert metrics.peak_tflops("cpu", "bf16", override=123.0) == 123.0
    assert metrics.peak_tflops("NVIDIA H100 PCIe", "fp32", override=60.0) == 60.0
    assert metrics.peak_tflops("AMD Instinct MI300X", "bf16", override=0.0) == 1307.4


def test_mfu():
    assert metrics.mfu(653.7, 1307.4) == pytest.approx(0.5)
    assert metrics.mfu(100.0, 400.0) == pytest.approx(0.25)
    assert metrics.mfu(100.0, None) is None


def test_writer_jsonl_and_tensorboard(tmp_path):
    out = tmp_path / "run"
    with metrics.MetricsWriter(str(out)) as writer:
        writer.write(10, {"loss": 2.5, "lr": 1e-3, "mfu": None})
        writer.write(20, {"loss": float("nan"), "lr": 5e-4, "mfu": 0.4})
    lines = (out / "metrics.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines]  # json.loads rejects nothing strict readers would
    assert "NaN" not in lines[1]
    assert records[0] == {"step": 10, "loss": 2.5, "lr": 1e-3, "mfu": None}
    assert set(records[1]) == {"step", "loss", "lr", "mfu"}
    assert records[1]["step"] == 20 and records[1]["loss"] is None and records[1]["mfu"] == 0.4
    events = list((out / "tensorboard").glob("events.out.tfevents*"))
    assert len(events) == 1
    scalars = read_scalars(events[0])
    assert scalars[10] == {"loss": 2.5, "lr": pytest.approx(1e-3)}
    assert scalars[20]["lr"] == pytest.approx(5e-4) and scalars[20]["mfu"] == pytest.approx(0.4)
    assert math.isnan(scalars[20]["loss"])  # kept: TensorBoard shows where a run diverged


def read_scalars(path):
    """{step: {tag: value}} decoded with TensorBoard's own protocol buffers (from tensorboardX, a
    test dependency), after checking every record's framing and CRC-32C against crc32c below."""
    from tensorboardX.proto import event_pb2

    data, scalars, offset = path.read_bytes(), {}, 0
    while offset < len(data):
        (length,) = struct.unpack_from("<Q", data, offset)
        (length_crc,) = struct.unpack_from("<I", data, offset + 8)
        payload = data[offset + 12: offset + 12 + length]
        (payload_crc,) = struct.unpack_from("<I", data, offset + 12 + length)
        assert length_crc == masked_crc32c(data[offset: offset + 8]) and payload_crc == masked_crc32c(payload)
        event = event_pb2.Event.FromString(payload)
        if event.file_version:
            assert event.file_version == "brain.Event:2" and offset == 0
        for value in event.summary.value:
            scalars.setdefault(event.step, {})[value.tag] = value.simple_value
        offset += 16 + length
    return scalars


def masked_crc32c(data: bytes) -> int:
    """TFRecord's masked CRC-32C, bit by bit (independent of the table in tensorboard.py)."""
    crc = 0xFFFFFFFF
    for byte in data:
        crc ^= byte
        for _ in range(8):
            crc = (crc >> 1) ^ (0x82F63B78 * (crc & 1))
    crc ^= 0xFFFFFFFF
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def test_crc32c_known_value():
    from maxtext_rocm.tensorboard import crc32c

    assert crc32c(b"123456789") == 0xE3069283  # the CRC-32C check value (RFC 3720)


def test_writer_without_tensorboard(tmp_path):
    with metrics.MetricsWriter(str(tmp_path), tensorboard=False) as writer:
        writer.write(1, {"loss": 1.0})
    assert (tmp_path / "metrics.jsonl").exists()
    assert not (tmp_path / "tensorboard").exists()


def test_disabled_writer_writes_nothing(tmp_path):
    out = tmp_path / "run"
    writer = metrics.MetricsWriter(str(out), enabled=False)
    writer.write(1, {"loss": 1.0})
    writer.close()
    assert not out.exists()


def test_format_line():
    line = metrics.format_line(120, 300, {
        "loss": 2.3451, "lr": 1.2e-3, "grad_norm": 0.812, "step_time_s": 0.152,
        "tokens_per_s_per_device": 6730.4, "tflops_per_s_per_device": 0.123, "mfu": None,
    })
    assert "120/300" in line and "40%" in line
    assert "loss 2.3451" in line and "lr 1.20e-03" in line and "6,730 tok/s/dev" in line
    assert "n/a" in line
    assert "eta 0:00:27" in line  # 180 remaining steps x 0.152 s = 27.4 s
    assert "MFU 41.2%" in metrics.format_line(1, 10, {"mfu": 0.412})


def test_format_line_tolerates_missing_keys():
    line = metrics.format_line(0, 5, {})
    assert "0/5" in line and "0%" in line


def test_memory_probes():
    import jax

    assert metrics.peak_rss_mib() > 1.0
    assert metrics.device_peak_memory_mib(jax.devices("cpu")[0]) is None


def test_analytic_flops_agree_with_xla_on_an_unrolled_forward():
    """XLA counts every FLOP of an unscanned forward pass; the analytic formula must agree.

    The training formula is 3x the forward with the causal half of attention skipped, while
    XLA's plain attention computes the full square, so compare forward FLOPs with full attention.
    """
    import jax
    import jax.numpy as jnp

    from maxtext_rocm.models import build_model
    from maxtext_rocm.precision import policy_from_config

    cfg = config.load("tiny_llama", overrides={"model.scan_layers": False})
    m, batch, seq = cfg.model, 2, 64
    model = build_model(m, policy_from_config(cfg.precision))
    tokens = jnp.zeros((batch, seq), jnp.int32)
    params = model.init(jax.random.key(0), tokens)
    xla_flops = jax.jit(model.apply).lower(params, tokens).compile().cost_analysis()["flops"]
    tokens_n = batch * seq
    causal_attention = (metrics.train_flops_per_token(m, seq) - 6 * metrics.matmul_params(m)) / 3
    analytic_forward = tokens_n * (2 * metrics.matmul_params(m) + 2 * causal_attention)
    assert xla_flops == pytest.approx(analytic_forward, rel=0.03)
