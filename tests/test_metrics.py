"""Analytic FLOPs, the peak table, MFU and the metric writers."""

import json
import math
import subprocess
import sys

import pytest

from maxtext_rocm import config
from maxtext_rocm.reporting import metrics


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
    """{step: {tag: value}} as TensorBoard itself reads the event file (its loader checks every
    record's framing and CRC-32C)."""
    from tensorboard.backend.event_processing.event_file_loader import LegacyEventFileLoader

    scalars = {}
    for event in LegacyEventFileLoader(str(path)).Load():
        if event.HasField("file_version"):
            assert event.file_version == "brain.Event:2"
        for value in event.summary.value:
            scalars.setdefault(event.step, {})[value.tag] = value.simple_value
    return scalars


def read_wandb_records(path):
    """Every record of a W&B run file (run-*.wandb), decoded with wandb's own protocol buffers.

    wandb (0.2x+) no longer ships a Python reader; its files keep LevelDB's log framing: a 7-byte
    header (":W&B", magic 0xBEE1, version 0), then 32 KiB blocks of chunks, each with a CRC-32 of
    its type byte and data, a 2-byte length and a type (1 full, 2 first, 3 middle, 4 last); a
    block's tail shorter than a chunk header is padding. Every checksum is verified here."""
    import struct
    import zlib

    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B" and struct.unpack_from("<HB", data, 4) == (0xBEE1, 0)
    block, offset, pending, records = 32768, 7, b"", []
    while offset + 7 <= len(data):
        if block - offset % block < 7:  # padding at a block's end
            offset += block - offset % block
            continue
        crc, length, kind = struct.unpack_from("<IHB", data, offset)
        chunk = data[offset + 7: offset + 7 + length]
        if crc == 0 and length == 0 and kind == 0:  # zero-filled tail of a file being written
            break
        assert zlib.crc32(chunk, zlib.crc32(bytes([kind]))) == crc and len(chunk) == length
        offset += 7 + length
        pending = chunk if kind in (1, 2) else pending + chunk
        if kind in (1, 4):
            records.append(wandb_internal_pb2.Record.FromString(pending))
    return records


def wandb_scalars(records):
    """{step: {key: value}} of a run's history records, without W&B's own underscored keys."""
    scalars = {}
    for record in records:
        if record.WhichOneof("record_type") == "history":
            for item in record.history.item:
                key = item.key or "/".join(item.nested_key)
                if not key.startswith("_"):
                    scalars.setdefault(record.history.step.num, {})[key] = float(json.loads(item.value_json))
    return scalars


def wandb_run_file(output_dir):
    runs = list((output_dir / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(runs) == 1, runs
    return runs[0]


def finished_wandb_records(output_dir, timeout_s: float = 120.0):
    """The run file's records once it holds the run's exit record. run.finish() returns when wandb's
    service has the records, and on a heavily loaded machine its writer can still be behind (a
    3.12 run under load 20 read a file without the history): wait for the file, not a fixed time."""
    import time

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            records = read_wandb_records(wandb_run_file(output_dir))
        except AssertionError:  # not there yet, or a chunk still being written
            records = []
        if any(r.WhichOneof("record_type") == "exit" for r in records) or time.monotonic() > deadline:
            return records or read_wandb_records(wandb_run_file(output_dir))
        time.sleep(0.5)


def test_the_same_scalars_land_in_tensorboard_and_an_offline_wandb_run(tmp_path, monkeypatch, fresh_wandb):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    out = tmp_path / "run"
    run_config = {"model": {"d_model": 64, "family": "llama"}, "train": {"steps": 20}}
    steps = {10: {"loss": 2.5, "lr": 1e-3, "mfu": None}, 20: {"loss": float("nan"), "lr": 5e-4, "mfu": 0.4}}
    with metrics.MetricsWriter(str(out), wandb_project="house-test", wandb_run_name="tiny",
                               run_config=run_config) as writer:
        for step, values in steps.items():
            writer.write(step, values)
    tensorboard = read_scalars(next((out / "tensorboard").glob("events.out.tfevents*")))
    records = finished_wandb_records(out)
    wandb = wandb_scalars(records)
    assert set(wandb) == set(tensorboard) == {10, 20}
    for step in steps:
        assert set(wandb[step]) == set(tensorboard[step]) == {k for k, v in steps[step].items() if v is not None}
        for key, value in wandb[step].items():
            # TensorBoard keeps float32, W&B float64: equal to float32's precision, NaN to NaN.
            assert value == pytest.approx(tensorboard[step][key], rel=1e-7, nan_ok=True), (step, key)
    assert math.isnan(wandb[20]["loss"]) and wandb[10]["lr"] == 1e-3
    (run,) = [r.run for r in records if r.WhichOneof("record_type") == "run"]
    assert run.project == "house-test" and run.display_name == "tiny"
    config = {item.key: json.loads(item.value_json) for item in run.config.update}
    assert {k: v for k, v in config.items() if not k.startswith("_")} == run_config


def test_a_training_run_logs_the_same_scalars_everywhere(tmp_path, monkeypatch, devices, fresh_wandb):
    """The trainer's wiring: log.wandb_project and log.wandb_run_name reach W&B, with the resolved
    config; metrics.jsonl, TensorBoard and W&B hold the same logged scalars."""
    from conftest import small_config
    from maxtext_rocm.train import Trainer

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    out = tmp_path / "run"
    cfg = small_config(**{"log.tensorboard": True, "log.wandb_project": "house-train", "log.wandb_run_name": "two",
                          "log.every": 2, "output_dir": str(out), "mesh.ici.fsdp": 1})
    trainer = Trainer(cfg, devices=devices[:1], log=lambda *_: None)
    trainer.run()
    trainer.writer.close()
    jsonl = {row.pop("step"): {k: v for k, v in row.items() if v is not None}
             for row in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())}
    tensorboard = read_scalars(next((out / "tensorboard").glob("events.out.tfevents*")))
    records = finished_wandb_records(out)
    wandb = wandb_scalars(records)
    assert set(jsonl) == set(tensorboard) == set(wandb) == {2, 4}
    for step, row in jsonl.items():
        assert set(row) == set(tensorboard[step]) == set(wandb[step]) and "loss" in row
        for key, value in row.items():
            assert wandb[step][key] == pytest.approx(value, rel=1e-12), (step, key)
            assert tensorboard[step][key] == pytest.approx(value, rel=1e-7), (step, key)
    (run,) = [r.run for r in records if r.WhichOneof("record_type") == "run"]
    config = {item.key: json.loads(item.value_json) for item in run.config.update}
    assert run.project == "house-train" and run.display_name == "two"
    assert config["model"]["d_model"] == 64 and config["log"]["wandb_project"] == "house-train"
    assert config["precision"] == json.loads((out / "config.json").read_text())["config"]["precision"]


def test_wandb_project_without_wandb_installed_is_one_clear_error(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # `import wandb` now raises ImportError
    with pytest.raises(config.UserError, match=r"log.wandb_project='p' needs the wandb package.*\[wandb\]"):
        metrics.MetricsWriter(str(tmp_path / "run"), wandb_project="p")
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


@pytest.fixture
def fresh_wandb():
    """wandb keeps the settings of its first run in a process-wide singleton (WANDB_MODE included):
    each test that starts a run starts from a new one and leaves none behind."""
    import wandb

    wandb.teardown()
    yield
    wandb.teardown()


def test_wandb_online_without_a_login_is_one_clear_error(tmp_path, monkeypatch, fresh_wandb):
    for name in ("WANDB_API_KEY", "WANDB_MODE", "WANDB_DISABLED"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.netrc, no saved login
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb_config"))
    monkeypatch.setenv("WANDB_SILENT", "true")
    with pytest.raises(config.UserError, match=r"log.wandb_project='p': W&B could not start a run .*WANDB_MODE=offline"):
        metrics.MetricsWriter(str(tmp_path / "run"), wandb_project="p")
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_tensorboardx_is_imported_without_torch():
    """tensorboardX imports torch when it can (~1.3 s and 230 MiB at start-up); the writer keeps it out."""
    code = ("import sys; from maxtext_rocm.reporting import sinks; sinks._import_tensorboardx(); "
            "assert 'tensorboardX' in sys.modules and 'torch' not in sys.modules; import torch")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


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
    from maxtext_rocm.numerics.precision import policy_from_config

    from maxtext_rocm.resolve import resolve_here

    cfg = resolve_here(config.load("tiny_llama", overrides={"model.scan_layers": False}))
    m, batch, seq = cfg.model, 2, 64
    model = build_model(m, policy_from_config(cfg.precision))
    tokens = jnp.zeros((batch, seq), jnp.int32)
    params = model.init(jax.random.key(0), tokens)
    xla_flops = jax.jit(model.apply).lower(params, tokens).compile().cost_analysis()["flops"]
    tokens_n = batch * seq
    causal_attention = (metrics.train_flops_per_token(m, seq) - 6 * metrics.matmul_params(m)) / 3
    analytic_forward = tokens_n * (2 * metrics.matmul_params(m) + 2 * causal_attention)
    assert xla_flops == pytest.approx(analytic_forward, rel=0.03)
