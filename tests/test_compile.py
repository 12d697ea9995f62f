"""The AOT fit check (python -m maxtext_rocm.compile) and the benchmark suites.

Subprocesses: the compile tool sets the fake device count before JAX starts a backend, and the
tests' own process already has 8 devices.
"""

import json
import os
import subprocess
import sys

import pytest

from conftest import small_config

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def fit_check(*args, timeout=600):
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # the tool sets its own
    return subprocess.run([sys.executable, "-m", "maxtext_rocm.compile", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=timeout)


def test_llama3_8b_fsdp8_compiles_and_fits_mi355x(tmp_path):
    out = tmp_path / "fit.json"
    result = fit_check("llama3_8b:fp8", "--target=mi355x:8", f"--json={out}")
    assert result.returncode == 0, result.stderr
    assert "mesh fsdp=8" in result.stdout and "verdict: FITS" in result.stdout
    report = json.loads(out.read_text())
    assert report["fp8_format"] == "ocp"  # gfx950: OCP formats
    # 8.03B fp32 parameters over 8 devices, Adam's two moments, gradients like the parameters.
    assert report["params_bytes"] == pytest.approx(8.03e9 * 4 / 8, rel=0.01)
    assert report["opt_state_bytes"] == pytest.approx(2 * report["params_bytes"], rel=0.01)
    assert report["xla_temp_bytes"] > report["gradients_bytes"]
    assert report["xla_argument_bytes"] >= report["params_bytes"] + report["opt_state_bytes"]
    # Analytic FLOPs: the whole stack, not cost_analysis's one scanned layer.
    assert report["flops_per_step"] == pytest.approx(report["flops_per_token"] * 16 * 8192)
    # The checksum of each checkpoint save reads the state once: no state-sized temporaries (issue 34).
    assert 0 < report["checkpoint_checksum_temp_bytes"] < 1e-3 * report["params_bytes"]
    assert "checkpoint checksum (at each save" in result.stdout


def test_mixtral_8x7b_expert8_compiles(tmp_path):
    out = tmp_path / "fit.json"
    result = fit_check("mixtral_8x7b", "--target=mi355x:8", "--config.mesh.ici.fsdp=1",
                       "--config.mesh.ici.expert=8", "--comm", f"--json={out}")
    assert result.returncode == 0, result.stderr
    assert "mesh expert=8" in result.stdout and "verdict: FITS" in result.stdout
    report = json.loads(out.read_text())
    assert report["params_bytes"] == pytest.approx(46.7e9 * 4 / 8, rel=0.01)
    # The GPU program's token exchange: XLA:CPU optimizes it but cannot emit its ragged
    # all-to-all, so there are no XLA memory figures and the traffic comes from XLA's dump.
    assert "xla_total_bytes" not in report and "ragged all-to-all" in report["xla_note"]
    assert "ragged-all-to-all" in result.stdout


@pytest.mark.slow  # CI budget (~30 s): a bounded search over every remat policy
def test_405b_on_one_h100_does_not_fit():
    result = fit_check("llama3_1_405b", "--target=h100:1")
    assert result.returncode == 0, result.stderr
    assert "verdict: DOES NOT FIT" in result.stdout
    assert "no batch fits under any remat policy" in result.stdout
    assert "H100s with FSDP" in result.stdout


def test_bad_target_is_a_user_error():
    result = fit_check("tiny_llama", "--target=tpu:8")
    assert result.returncode == 2 and "--target='tpu:8' is not valid" in result.stderr
    assert "Traceback" not in result.stderr


def test_analytic_activations_shrink_with_remat(devices):
    from maxtext_rocm.planner.report import analyse

    totals = {}
    for remat in ("none", "save_dots", "minimal", "full"):
        cfg = small_config(**{"model.remat": remat, "model.attention": "xla", "train.seq_len": 256})
        totals[remat] = analyse(cfg, "h100", 8, compile_it=False).memory.analytic_activations_bytes
    assert totals["none"] >= totals["save_dots"] > totals["minimal"] > totals["full"] > 0
    flash = analyse(small_config(**{"model.attention": "cudnn", "train.seq_len": 256}), "h100", 8,
                    compile_it=False).memory.analytic_activations_bytes
    assert flash < analyse(small_config(**{"model.attention": "xla", "train.seq_len": 256}), "h100", 8,
                           compile_it=False).memory.analytic_activations_bytes


def test_a_plan_needs_no_data_on_the_planning_machine(devices, tmp_path):
    """The cluster's data files are not on the machine that plans for it: the fit check analyses a
    config whose data.paths exist nowhere here, while a run of it stops at preflight, naming them."""
    from maxtext_rocm.errors import UserError
    from maxtext_rocm.planner.report import analyse
    from maxtext_rocm.trainer.preflight import check_run

    cfg = small_config(**{"data.source": "files", "data.paths": str(tmp_path / "cluster" / "*.jsonl"),
                          "model.vocab_size": 512, "model.attention": "xla", "train.seq_len": 256})
    assert analyse(cfg, "h100", 8, compile_it=False).memory.analytic_activations_bytes > 0
    with pytest.raises(UserError, match="data.paths: .* matches no file"):
        check_run(cfg, 8)


def test_70b_fits_mi300x_only_with_a_flash_attention(devices, tmp_path):
    """The [seq, seq] scores of the "xla" attention keep Llama 3 70B off 8 MI300X; the blockwise
    attention (what "auto", the default, is on AMD GPUs) fits, by the estimate and by XLA's
    buffer assignment of the compiled blockwise program."""
    from maxtext_rocm import config as config_lib
    from maxtext_rocm.planner.report import analyse, flash_attention_for

    assert flash_attention_for("mi300x") == "blockwise" and flash_attention_for("h100") == "cudnn"
    reports = {attention: analyse(config_lib.load("llama3_70b:bf16", {"model.attention": attention}), "mi300x", 8,
                                  compile_it=False) for attention in ("xla", "blockwise", "auto")}
    assert {a: r.fits for a, r in reports.items()} == {"xla": False, "blockwise": True, "auto": True}
    assert reports["auto"].memory.analytic_total_bytes == reports["blockwise"].memory.analytic_total_bytes
    out = tmp_path / "fit.json"
    result = fit_check("llama3_70b:bf16", "--target=mi300x:8", "--config.model.attention=blockwise", f"--json={out}")
    assert result.returncode == 0, result.stderr
    assert "verdict: FITS" in result.stdout
    assert json.loads(out.read_text())["xla_fits"]


def test_the_flash_attention_a_plan_suggests_takes_the_models_sinks():
    """gpt-oss's attention sinks have no input in cuDNN's kernel: where the scores do not fit, the
    search suggests the attention the resolve step would pick, blockwise on NVIDIA GPUs too."""
    from maxtext_rocm.planner.report import flash_attention_for

    assert flash_attention_for("h100", sinks=True) == "blockwise" == flash_attention_for("mi355x", sinks=True)
    assert flash_attention_for("h100", sinks=False) == "cudnn"


def bench(*args, timeout=900):
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    return subprocess.run([sys.executable, "scripts/benchmark.py", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=timeout)


@pytest.mark.slow
def test_seed_suite_without_gpus_aot_checks_and_skips(tmp_path):
    result = bench("--suite", "seed", "--rows", "llama3 8b fp8", "--out", str(tmp_path))
    assert result.returncode == 0, result.stderr
    record = json.loads((tmp_path / "results.json").read_text())
    (row,) = record["rows"]
    assert row["status"] == "skipped" and "AOT check for mi355x:8: fits" in row["note"]
    assert row["remat"] in ("none", "save_dots", "minimal", "full") and row["per_device_batch_size"] >= 1
    table = (tmp_path / "results.md").read_text()
    assert "| tokens/s/GPU | TFLOP/s/GPU | MFU |" in table and "Llama3 8B fp8" in table


@pytest.mark.slow
def test_cpu_suite_runs_the_tiny_presets(tmp_path):
    result = bench("--suite", "cpu", "--steps", "2", "--warmup", "0", "--out", str(tmp_path),
                   "--config.train.seq_len=64", "--config.train.per_device_batch_size=1",
                   "--config.checkpoint.enabled=false")
    assert result.returncode == 0, result.stderr
    rows = json.loads((tmp_path / "results.json").read_text())["rows"]
    assert [r["row"] for r in rows] == ["tiny_llama", "tiny_mixtral"]
    assert all(r["status"] == "ran" and r["tokens_per_s_per_device"] > 0 for r in rows)
    assert all(r["mfu"] is None for r in rows)  # no peak is known for a CPU
    assert all(r["glibc_tunables"] == os.environ.get("GLIBC_TUNABLES", "") for r in rows)
    assert "tiny_mixtral" in (tmp_path / "results.md").read_text()


# A tiny Llama for the one-device checks (a subprocess each: the tool sets its own device count).
TINY = ["--config.data.source=synthetic", "--config.model.vocab_size=128", "--config.model.d_model=64",
        "--config.model.n_layers=2", "--config.model.n_heads=4", "--config.model.n_kv_heads=2", "--config.model.head_dim=16",
        "--config.model.mlp_dim=128", "--config.train.per_device_batch_size=1", "--config.train.seq_len=32"]


def test_comm_on_one_device_reports_nothing_to_exchange(tmp_path):
    """One device moves nothing: no collective, a minimum of zero, and no ratio of 0 / 0 (it died
    with ZeroDivisionError in planner/comm.py)."""
    out = tmp_path / "report.json"
    result = fit_check("tiny_llama", "--target=mi300x:1", "--comm", f"--json={out}", *TINY)
    assert result.returncode == 0, result.stderr
    assert "measured communication: none (one device has nothing to exchange)" in result.stdout
    comm = json.loads(out.read_text())["comm"]
    assert comm["total_bytes"] == 0 and comm["minimum"]["cpu_bytes"] == 0 and comm["ratio"] is None


def test_plan_on_one_device_compiles_its_one_layout(tmp_path):
    out = tmp_path / "plan.json"
    result = fit_check("tiny_llama", "--target=mi300x:1", "--plan", "--max-compiles=1", f"--json={out}", *TINY)
    assert result.returncode == 0, result.stderr
    assert "communication none (one device has nothing to exchange)" in result.stdout
    best = json.loads(out.read_text())["ranked"][0]
    assert best["compiled"] and best["comm_s"] == 0 and best["comm_ratio"] is None


@pytest.mark.parametrize("flag, says", [
    ("--max-compiles=abc", "--max-compiles='abc' is not valid; use a whole number"),
    ("--usable=abc", "--usable='abc' is not valid"),
    ("--usable=1.5", "--usable='1.5' is not valid"),
])
def test_a_bad_number_flag_is_named(flag, says):
    """Without --plan too: `int()`'s own message named no flag."""
    result = fit_check("tiny_llama", "--target=mi300x:8", flag)
    assert result.returncode == 2 and result.stderr.startswith(f"error: {says}")
    assert "invalid literal" not in result.stderr and "Traceback" not in result.stderr
    assert result.stderr.count("\n") == 1
