"""Every bad input is one sentence, exit status 2, and leaves the run directory as it was (issue 24).

Most cases call `train.main` in this process (the errors come before any compilation, so they
cost well under a second each); the cases that are about the process itself (a traceback from
an import, a signal) start `python -m maxtext_rocm.train`.
"""

import json
import os
import subprocess
import sys
import threading

import numpy as np
import pytest

from maxtext_rocm import config as config_lib
from maxtext_rocm.trainer import launch
from maxtext_rocm import train

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# tiny_llama shrunk to compile in a few seconds on 8 fake CPU devices.
SMALL = ["--config.model.d_model=64", "--config.model.n_layers=2", "--config.model.n_heads=4",
         "--config.model.n_kv_heads=2", "--config.model.head_dim=16", "--config.model.mlp_dim=128",
         "--config.precision.policy=fp32", "--config.train.seq_len=32", "--config.train.per_device_batch_size=1",
         "--config.train.steps=2", "--config.log.every=1", "--config.log.tensorboard=false"]


def snapshot(folder) -> dict:
    """Every file under `folder` with its bytes (the compilation cache aside: XLA's, not the run's)."""
    out = {}
    for root, dirs, files in os.walk(folder):
        dirs[:] = [d for d in dirs if d != "compilation_cache"]
        for name in files:
            path = os.path.join(root, name)
            with open(path, "rb") as f:
                out[os.path.relpath(path, folder)] = f.read()
    return out


def run_main(capsys, *args):
    """(exit status, stderr lines) of train.main in this process."""
    status = train.main(list(args))
    err = capsys.readouterr().err.strip().splitlines()
    return status, err


def assert_one_sentence(status, err, *fragments):
    assert status == 2, err
    assert len(err) == 1, err
    assert err[0].startswith("error: ") and "Traceback" not in err[0]
    for fragment in fragments:
        assert fragment in err[0], err[0]


def write_jsonl(path, texts):
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    return path


# ----------------------------------------------------------------------------------------------
# Config files (finding 6, 7)


def write_preset(tmp_path, body, name="preset.py"):
    path = tmp_path / name
    path.write_text("from maxtext_rocm.config import defaults\n\n\ndef get_config(variant=''):\n"
                    "    cfg = defaults()\n" + body + "    return cfg\n")
    return path


def test_preset_with_a_syntax_error_names_file_and_line(tmp_path, capsys):
    path = write_preset(tmp_path, "    cfg.train.steps = (3\n")
    status, err = run_main(capsys, str(path), f"--config.output_dir={tmp_path / 'run'}")
    assert_one_sentence(status, err, str(path), "line 6", "is not valid Python")
    assert not (tmp_path / "run").exists()


def test_preset_whose_get_config_raises_names_file_and_line(tmp_path, capsys):
    path = write_preset(tmp_path, "    cfg.train.steps = int('many')\n")
    status, err = run_main(capsys, str(path), f"--config.output_dir={tmp_path / 'run'}")
    assert_one_sentence(status, err, str(path), "line 6", "ValueError", "invalid literal")


def test_unknown_key_set_inside_a_preset_names_the_preset_and_the_close_key(tmp_path, capsys):
    path = write_preset(tmp_path, "    cfg.model.dmodel = 64\n")
    status, err = run_main(capsys, str(path), f"--config.output_dir={tmp_path / 'run'}")
    assert_one_sentence(status, err, str(path), "line 6", "unknown config key 'dmodel'", "did you mean 'd_model'")
    assert not (tmp_path / "run").exists()


def test_unknown_key_in_a_preset_that_another_builds_on_names_the_inner_file(tmp_path):
    inner = write_preset(tmp_path, "    cfg.train.setps = 3\n", name="inner.py")
    outer = tmp_path / "outer.py"
    outer.write_text(f"from maxtext_rocm.config import load_preset\n\n\ndef get_config(variant=''):\n"
                     f"    return load_preset({str(inner)!r})\n")
    with pytest.raises(config_lib.ConfigError, match=r"inner.py' line 6 sets the unknown config key 'setps'"):
        config_lib.load(str(outer))


def test_the_config_is_locked_but_its_keys_stay_writable():
    cfg = config_lib.defaults()
    cfg.model.d_model = 128  # an existing key: fine
    with pytest.raises(AttributeError, match="d_model"):
        cfg.model.dmodel = 128
    config_lib.set_key(cfg, "model.rope_scaling", {"factor": 8.0, "low_freq_factor": 1.0,
                                                   "high_freq_factor": 4.0, "original_max_position": 8192})
    assert cfg.model.rope_scaling.factor == 8.0


def test_rope_scaling_with_string_values_is_one_sentence(tmp_path, capsys):
    scaling = "{'factor': '8', 'low_freq_factor': 1.0, 'high_freq_factor': 4.0, 'original_max_position': 8192}"
    status, err = run_main(capsys, "configs/tiny_llama.py", f"--config.model.rope_scaling={scaling}",
                           f"--config.output_dir={tmp_path / 'run'}")
    assert_one_sentence(status, err, "model.rope_scaling.factor='8' is a str; it takes a number")


@pytest.mark.parametrize("key, value", [("model.d_model", 10**9), ("train.per_device_batch_size", 10**6),
                                        ("train.seq_len", 10**8)])
def test_sizes_that_cannot_fit_stop_before_allocating(tmp_path, capsys, key, value):
    status, err = run_main(capsys, "configs/tiny_llama.py", f"--config.{key}={value}",
                           f"--config.output_dir={tmp_path / 'run'}", "--config.train.compilation_cache=off")
    assert_one_sentence(status, err, f"{key}={value}", "this host's available memory",
                        "python -m maxtext_rocm.compile")
    assert not (tmp_path / "run").exists() or snapshot(tmp_path / "run") == {}


def test_data_epochs_below_zero_is_refused(tmp_path, capsys):
    status, err = run_main(capsys, "configs/tiny_llama.py", "--config.data.epochs=-1",
                           f"--config.output_dir={tmp_path / 'run'}")
    assert_one_sentence(status, err, "data.epochs=-1 is not valid")


def test_output_dir_that_is_a_file_is_blamed_not_the_compilation_cache(tmp_path, capsys):
    blocker = tmp_path / "taken"
    blocker.write_text("precious")
    for where in (blocker, blocker / "sub"):
        status, err = run_main(capsys, "configs/tiny_llama.py", f"--config.output_dir={where}")
        assert_one_sentence(status, err, f"output_dir={str(where)!r}", "set output_dir to a writable directory")
        assert "compilation" not in err[0]
    assert blocker.read_text() == "precious"


# ----------------------------------------------------------------------------------------------
# Data files (findings 4, 6, 7, 8)


def files_args(paths, *extra):
    return ["configs/tiny_llama.py", *SMALL, "--config.data.source=files", f"--config.data.paths={paths}", *extra]


def test_documents_that_yield_no_tokens_name_the_file(tmp_path, capsys):
    data = write_jsonl(tmp_path / "empty.jsonl", [""] * 50)
    status, err = run_main(capsys, *files_args(data, "--config.data.add_bos=false", "--config.data.add_eos=false",
                                               f"--config.output_dir={tmp_path / 'run'}"))
    assert_one_sentence(status, err, "empty.jsonl", "yields the two tokens")
    assert not (tmp_path / "run").exists()


def test_the_packer_never_spins_on_documents_without_tokens():
    """A process whose share holds only token-less documents (the others' shares did not) stops
    with a sentence instead of looping for ever."""
    from maxtext_rocm.data.checks import DataError
    from maxtext_rocm.data.packing import DocumentStream, RowPacker

    dataset = [np.zeros(1, np.int32) for _ in range(6)]  # one token each: nothing to predict
    packer = RowPacker(DocumentStream(dataset, seed=0, process_index=0, process_count=2), seq_len=16,
                       name="data.paths (x.jsonl)")
    raised = []

    def take():
        try:
            packer.row()
        except DataError as error:
            raised.append(str(error))

    worker = threading.Thread(target=take, daemon=True)
    worker.start()
    worker.join(timeout=10)
    assert not worker.is_alive(), "the packer is still looping"
    assert raised and "data.paths (x.jsonl)" in raised[0] and "yields two tokens" in raised[0]


def test_every_jsonl_line_is_checked_before_the_run_and_the_run_record_is_kept(tmp_path, capsys):
    good = write_jsonl(tmp_path / "good.jsonl", [f"document number {i} " * 5 for i in range(40)])
    run = tmp_path / "run"
    status, _ = run_main(capsys, *files_args(good, f"--config.output_dir={run}", "--config.checkpoint.every=0"))
    assert status == 0
    before = snapshot(run)
    lines = good.read_text().splitlines()
    lines[20] = '{"text": "cut off'
    bad = tmp_path / "bad.jsonl"
    bad.write_text("\n".join(lines) + "\n")
    status, err = run_main(capsys, *files_args(bad, f"--config.output_dir={run}", "--config.train.steps=4"))
    assert_one_sentence(status, err, "bad.jsonl line 21 is not valid JSON")
    assert snapshot(run) == before


def test_an_error_mid_run_keeps_the_previous_launchs_config_json(tmp_path, capsys):
    data = write_jsonl(tmp_path / "few.jsonl", ["short text " * 3 for _ in range(8)])
    run = tmp_path / "run"
    status, _ = run_main(capsys, *files_args(data, f"--config.output_dir={run}", "--config.checkpoint.every=0"))
    assert status == 0
    record = (run / "config.json").read_bytes()
    # A relaunch that runs out of data mid-run (one epoch, far more steps): config.json unchanged.
    status, err = run_main(capsys, *files_args(data, f"--config.output_dir={run}", "--config.train.steps=400",
                                               "--config.data.epochs=1", "--config.checkpoint.every=0"))
    assert_one_sentence(status, err, "the data ran out after data.epochs=1")
    assert (run / "config.json").read_bytes() == record


def test_corrupt_or_truncated_parquet_is_one_sentence(tmp_path, capsys):
    import pyarrow as pa
    import pyarrow.parquet as pq

    whole = tmp_path / "whole.parquet"
    pq.write_table(pa.table({"text": [f"text {i} " * 20 for i in range(200)]}), whole)
    data = whole.read_bytes()
    cut = tmp_path / "cut.parquet"
    cut.write_bytes(data[: len(data) // 2])
    scrambled = tmp_path / "scrambled.parquet"
    scrambled.write_bytes(data[:4] + bytes(len(data) - 8) + data[-4:])  # magic kept, contents zeroed
    for path in (cut, scrambled):
        status, err = run_main(capsys, *files_args(path, f"--config.output_dir={tmp_path / 'run'}"))
        assert_one_sentence(status, err, str(path), "cannot be read as Parquet")


@pytest.mark.parametrize("content, message", [
    (bytes(range(256)) * 4, "holds a NUL byte at offset 0"),
    ("caf\u00e9 au lait ".encode("latin-1") * 10, "is not UTF-8 text (invalid byte at offset 3)"),
])
def test_binary_or_non_utf8_text_files_are_refused(tmp_path, capsys, content, message):
    path = tmp_path / "doc.txt"
    path.write_bytes(content)
    status, err = run_main(capsys, *files_args(path, f"--config.output_dir={tmp_path / 'run'}"))
    assert_one_sentence(status, err, str(path), message)


def test_non_utf8_jsonl_line_is_named(tmp_path, capsys):
    path = tmp_path / "latin.jsonl"
    path.write_bytes(b'{"text": "fine"}\n{"text": "caf\xe9"}\n')
    status, err = run_main(capsys, *files_args(path, f"--config.output_dir={tmp_path / 'run'}"))
    assert_one_sentence(status, err, "latin.jsonl line 2 is not UTF-8 text")


# ----------------------------------------------------------------------------------------------
# Resuming (finding 7)


def test_train_steps_below_the_resumed_step_is_one_sentence(tmp_path, capsys):
    run = tmp_path / "run"
    status, _ = run_main(capsys, "configs/tiny_llama.py", *SMALL, "--config.train.steps=3",
                         f"--config.output_dir={run}")
    assert status == 0
    before = snapshot(run)
    status, err = run_main(capsys, "configs/tiny_llama.py", *SMALL, "--config.train.steps=1",
                           f"--config.output_dir={run}")
    assert_one_sentence(status, err, "train.steps=1 is below step 3 of the checkpoint", "raise train.steps above 3")
    assert snapshot(run) == before


# ----------------------------------------------------------------------------------------------
# The command line itself


def test_preset_errors_have_no_traceback_from_the_command_line(tmp_path):
    path = write_preset(tmp_path, "    cfg.model.dmodel = 64\n")
    result = subprocess.run([sys.executable, "-m", "maxtext_rocm.train", str(path)], cwd=REPO,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [result.stderr.strip()]
    assert "did you mean 'd_model'" in result.stderr


@pytest.mark.parametrize("preset, objective", [("tiny_llama", "lm"), ("tiny_mixtral", "lm"), ("tiny_llama", "dpo")])
def test_memory_lower_bounds_stay_below_what_the_run_holds(preset, objective, devices):
    """The refusal above rests on lower bounds: each must stay under the real figure (the state's
    bytes from its abstract arrays, compile.py's activation estimate) and be of its size."""
    import jax

    from maxtext_rocm.planner import report as compile_lib
    from maxtext_rocm.config import memory_fit
    from maxtext_rocm.parallel import sharding
    from maxtext_rocm.models import build_model
    from maxtext_rocm.numerics.precision import policy_from_config
    from maxtext_rocm.resolve import Target, resolve

    cfg = config_lib.load(preset)
    cfg.train.objective = objective  # dpo: the state holds the frozen reference too (finetune/dpo.py)
    bounds = memory_fit.lower_bounds(cfg, len(devices))
    mesh = sharding.make_mesh(cfg.mesh, devices)
    cfg = resolve(cfg, mesh, Target.of_device(devices[0]))
    model = build_model(cfg.model, policy_from_config(cfg.precision, devices[0]))
    abstract = launch.stored_state(cfg, model, mesh).abstract
    state_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree_util.tree_leaves(abstract))
    assert 0.95 * state_bytes <= bounds["state"] <= state_bytes  # what is left out: norms, fp8 scales
    shape = config_lib.mesh_shape(cfg.mesh, len(devices))
    estimate = compile_lib.analytic_activations(cfg, config_lib.axis_sizes(shape), len(devices))
    assert bounds["activations"] <= estimate["layers"] * len(devices)


# ----------------------------------------------------------------------------------------------
# Layouts the expert exchange cannot serve


@pytest.mark.parametrize("overrides, fragments", [
    (["--config.mesh.ici.expert=8", "--config.model.n_experts=4", "--config.model.experts_per_token=2"],
     ["model.n_experts=4 does not divide"]),
    (["--config.model.moe_impl=capacity", "--config.model.moe_capacity_factor=0.01"],
     ["model.moe_capacity_factor=0.01 gives each expert 0.08 slots", "model.moe_impl='dropless'"]),
])
def test_a_layout_the_expert_layer_cannot_serve_is_one_sentence(capsys, tmp_path, overrides, fragments):
    status, err = run_main(capsys, "configs/tiny_mixtral.py", *SMALL, *overrides, f"--config.output_dir={tmp_path / 'run'}")
    assert_one_sentence(status, err, *fragments)
    assert not (tmp_path / "run").exists()  # before anything runs or is written
