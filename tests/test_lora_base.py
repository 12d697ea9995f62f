"""A LoRA run is bound to its base (finetune/lora_base.py, checkpoint/lora_run.py), and the readers take LoRA runs (issue 43).

Driven through what a user runs: `python -m maxtext_rocm.train`, `checkpoint verify|export`,
`generate` and `mr.load_params`, in this process (their `main`s) on a tiny model. The base's
checksums (and for a seed-made base, the seed) are recorded in every checkpoint's meta; a resume
or a reader on another base, another seed or other adapters' settings is one sentence, exit 2.
"""

import json
import shutil

import jax
import numpy as np
import pytest

import maxtext_rocm as mr
from maxtext_rocm.checkpoint import lora_run as lora_reader, main as checkpoint_main
from maxtext_rocm.convert.__main__ import main as convert_main
from maxtext_rocm.finetune import lora, lora_base
from maxtext_rocm.generate import main as generate_main
from maxtext_rocm.train import main as train_main

TINY = ["configs/tiny_llama.py", "--config.model.vocab_size=264", "--config.model.d_model=64",
        "--config.model.n_layers=2", "--config.model.n_heads=4", "--config.model.n_kv_heads=2",
        "--config.model.head_dim=16", "--config.model.mlp_dim=128", "--config.model.scan_layers=true",
        "--config.precision.policy=fp32",
        "--config.train.seq_len=32", "--config.train.per_device_batch_size=1", "--config.log.every=1",
        "--config.log.tensorboard=false", "--config.checkpoint.async_save=false", "--config.checkpoint.every=2",
        "--config.optimizer.lr=1e-2", "--config.optimizer.warmup_steps=0"]
LORA = ["--config.lora.rank=4", "--config.lora.alpha=8.0", "--config.lora.targets=('q','v')"]


def train(run, *overrides, steps=2) -> int:
    return train_main([*TINY, f"--config.output_dir={run}", f"--config.train.steps={steps}", *overrides])


def errors(capsys) -> list[str]:
    return [line for line in capsys.readouterr().err.splitlines() if line.strip()]


def snapshot(folder) -> dict:
    """Every file's bytes but the run lock's (rewritten by each launch that takes it)."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*"))
            if p.is_file() and p.name != "run.lock"}


@pytest.fixture(scope="module")
def bases(tmp_path_factory):
    """Two params exports of the same shapes and other values (seeds 0 and 1)."""
    root = tmp_path_factory.mktemp("bases")
    for seed in (0, 1):
        assert train(root / f"run{seed}", f"--config.train.seed={seed}") == 0
        assert checkpoint_main(["export", str(root / f"run{seed}"), str(root / f"base{seed}")]) == 0
    return root / "base0", root / "base1"


@pytest.fixture(scope="module")
def lora_run(bases, tmp_path_factory):
    """A LoRA run on base0, stopped at step 2 of 4."""
    run = tmp_path_factory.mktemp("lora") / "run"
    assert train(run, *LORA, f"--config.checkpoint.load_params_from={bases[0]}") == 0
    return run


def test_the_base_is_recorded_in_each_checkpoint(lora_run, bases):
    meta = json.loads((lora_run / "checkpoints" / "2" / "meta" / "metadata").read_text())
    record = meta["lora"]
    assert (record["rank"], record["alpha"], record["targets"]) == (4, 8.0, ["q", "v"])
    assert record["base"]["load_params_from"] == str(bases[0]) and record["base"]["seed"] is None
    sums = json.loads((bases[0] / "checksums.json").read_text())["checksums"]
    assert record["base"]["checksum"] == lora_reader.loaded_identity(bases[0], sums).checksum


def test_a_base_replaced_between_stop_and_resume_is_refused_by_the_resume_and_every_reader(
        lora_run, bases, tmp_path, capsys):
    run = tmp_path / "run"
    shutil.copytree(lora_run, run)
    moved = tmp_path / "base"
    shutil.copytree(bases[0], moved)
    overrides = [*LORA, f"--config.checkpoint.load_params_from={moved}"]
    # The run's own base moved elsewhere, the same parameters: accepted (identity is the checksums).
    assert train(run, *overrides, steps=3) == 0
    capsys.readouterr()
    shutil.rmtree(moved)
    shutil.copytree(bases[1], moved)  # same shapes, other values
    before = snapshot(run)
    assert train(run, *overrides, steps=4) == 2
    err = errors(capsys)
    assert len(err) == 1 and err[0].startswith(
        f"error: the LoRA adapters in {run / 'checkpoints' / '3'} do not go with this base: the base at "
        f"checkpoint.load_params_from={str(moved)!r} holds other parameters than when the run trained on it"), err
    assert "put the original base back there, or set lora.allow_base_change=True" in err[0]
    assert snapshot(run) == before  # nothing written, nothing moved

    # The readers say the same, exit 2.
    assert checkpoint_main(["verify", str(run)]) == 2
    assert "do not go with this base" in errors(capsys)[0]
    assert checkpoint_main(["export", str(run), str(tmp_path / "merged")]) == 2
    assert "do not go with this base" in errors(capsys)[0] and not (tmp_path / "merged").exists()
    assert generate_main([str(run), "--prompt", "ab", "--max-new-tokens", "2"]) == 2
    assert "do not go with this base" in errors(capsys)[0]
    for adapter in ([], ["--adapter"]):  # the merged model, and an adapter named for the original base
        assert convert_main(["to-hf", str(run), str(tmp_path / "hf"), *adapter]) == 2
        assert "do not go with this base" in errors(capsys)[0] and not (tmp_path / "hf").exists()
    # Said on purpose: the run goes on with the new base, and says so.
    assert train(run, *overrides, "--config.lora.allow_base_change=true", steps=4) == 0
    assert "going on with it as lora.allow_base_change=True asks" in capsys.readouterr().out


def test_a_seed_made_base_resumed_with_another_seed_is_refused(tmp_path, capsys):
    run = tmp_path / "run"
    assert train(run, *LORA, "--config.train.seed=3") == 0
    capsys.readouterr()
    assert train(run, *LORA, "--config.train.seed=4", steps=4) == 2
    err = errors(capsys)
    assert len(err) == 1 and ("the run's base was made from train.seed=3, but train.seed=4 makes another; give "
                              "train.seed=3, or set lora.allow_base_change=True") in err[0], err
    assert train(run, *LORA, "--config.train.seed=3", steps=4) == 0  # its own seed: resumes
    assert checkpoint_main(["verify", str(run)]) == 0
    assert "the base made from train.seed=3 is the one they were trained on" in capsys.readouterr().out


@pytest.mark.parametrize("override, needle", [
    ("--config.lora.alpha=16.0", "lora.alpha=16.0 differs from the lora.alpha=8.0 that the adapters in"),
    ("--config.lora.rank=2", "lora.rank=2 differs from the lora.rank=4"),
    ("--config.lora.targets=('q','k')", "lora.targets=('q', 'k') differs from the lora.targets=('q', 'v')"),
])
def test_other_adapter_settings_on_resume_are_refused_in_one_sentence(override, needle, lora_run, bases, tmp_path,
                                                                      capsys):
    run = tmp_path / "run"
    shutil.copytree(lora_run, run)
    before = snapshot(run)
    assert train(run, *LORA, override, f"--config.checkpoint.load_params_from={bases[0]}", steps=4) == 2
    err = errors(capsys)
    assert len(err) == 1 and needle in err[0] and "start a new run in another output_dir" in err[0], err
    assert snapshot(run) == before


def test_readers_take_a_lora_run_as_its_merged_model(lora_run, bases, tmp_path, capsys):
    """verify checks the adapters and the base; export writes the merged model as a params export,
    load_params gives the same merged model, and generate runs on it."""
    assert checkpoint_main(["verify", str(lora_run)]) == 0
    said = capsys.readouterr().out
    assert (f"the LoRA adapters in {lora_run / 'checkpoints' / '2'} are intact" in said
            and f"the base from checkpoint.load_params_from={str(bases[0])!r} is the one they were trained on" in said)

    cfg = mr.run_config(lora_run)
    base = mr.load_params(bases[0])
    from maxtext_rocm.checkpoint import restore_params

    adapters = restore_params(lora_run, lora_reader.initialised(cfg, lora.ADAPTERS, abstract_only=True))
    # An independent merge: W + (alpha / r) A B written out per layer.
    expected = jax.tree_util.tree_map(np.asarray, base)
    for name in cfg.lora.targets:
        a = np.asarray(adapters["layers"]["attention"][name]["dot"]["a"])  # [layers, d_model, r]
        b = np.asarray(adapters["layers"]["attention"][name]["dot"]["b"])  # [layers, r, heads, head_dim]
        kernel = expected["layers"]["attention"][name]["kernel"]
        product = np.einsum("ldr,lro->ldo", a, b.reshape(*b.shape[:2], -1)).reshape(kernel.shape)
        expected["layers"]["attention"][name]["kernel"] = kernel + 2.0 * product
        assert np.abs(product).max() > 0  # the adapters moved: the merge is seen

    merged = mr.load_params(lora_run)
    for got, want in zip(jax.tree_util.tree_leaves(merged), jax.tree_util.tree_leaves(expected)):
        np.testing.assert_allclose(np.asarray(got), want, rtol=1e-6, atol=1e-6)

    out = tmp_path / "merged"
    assert checkpoint_main(["export", str(lora_run), str(out)]) == 0
    record = json.loads((out / "config.json").read_text())
    assert record["config"]["lora"]["rank"] == 0 and record["merged_from_lora"]["rank"] == 4
    exported = mr.load_params(out)  # a plain export, verified against its checksums
    for got, want in zip(jax.tree_util.tree_leaves(exported), jax.tree_util.tree_leaves(expected)):
        np.testing.assert_allclose(np.asarray(got), want, rtol=1e-6, atol=1e-6)
    assert checkpoint_main(["verify", str(out)]) == 0

    capsys.readouterr()
    assert generate_main([str(lora_run), "--prompt", "ab", "--max-new-tokens", "3"]) == 0
    from_run = capsys.readouterr().out
    assert generate_main([str(out), "--prompt", "ab", "--max-new-tokens", "3"]) == 0
    assert capsys.readouterr().out == from_run  # the adapters applied: the merged model's text


def test_allow_base_change_lets_a_new_base_through_with_a_warning():
    import ml_collections

    was = lora_base.BaseIdentity("", 3, "x", "train on cpu fsdp=8")
    now = lora_base.BaseIdentity("", 4, "y", "train on cpu fsdp=8")
    record = {"base": was.to_record()}
    cfg = ml_collections.ConfigDict({"allow_base_change": False})
    with pytest.raises(lora_base.BaseChanged, match="train.seed=4 makes another"):
        lora_base.check_base(record, now, cfg, "RUN", resuming=True)
    cfg.allow_base_change = True
    assert "going on with it as lora.allow_base_change=True asks" in lora_base.check_base(record, now, cfg, "RUN",
                                                                                         resuming=True)
    # A reader takes no overrides and trusts the checkpoint's record, not a config.json that once allowed a change.
    with pytest.raises(lora_base.BaseChanged, match=r"or train the run on with the new base on purpose "
                                                    r"\(--config.lora.allow_base_change=true and a higher train.steps\)"):
        lora_base.check_base(record, now, cfg, "RUN", resuming=False)
    # A seed-made base made by another program: the seed alone is compared (the init differs in the last bit).
    assert lora_base.check_base(record, lora_base.BaseIdentity("", 3, "z", "reader on cpu 1 device"),
                                ml_collections.ConfigDict(), "RUN", resuming=False) is None
    with pytest.raises(lora_base.BaseChanged, match="its checksums differ"):  # on the same mesh: the checksum too
        lora_base.check_base(record, lora_base.BaseIdentity("", 3, "z", "train on cpu fsdp=8"),
                             ml_collections.ConfigDict(), "RUN", resuming=True)
    # The adapters are keyed by name: the targets in another order are the same adapters.
    settings = {"rank": 4, "alpha": 8.0, "targets": ["q", "v"]}
    lora_base.check_hyperparameters(settings, ml_collections.ConfigDict({**settings, "targets": ("v", "q")}), "RUN")
    with pytest.raises(lora_base.BaseChanged, match=r"lora.targets=\('q', 'k'\) differs"):
        lora_base.check_hyperparameters(settings, ml_collections.ConfigDict({**settings, "targets": ("q", "k")}), "RUN")


@pytest.mark.parametrize("below", [("out",), ("missing", "out")])
def test_export_into_a_place_that_cannot_be_written_is_one_sentence(below, bases, tmp_path, capsys):
    """A file where a directory should be: one sentence naming it (a NotADirectoryError traceback
    before); a read-only directory takes the same path (os.access), untestable as root."""
    run = bases[0].parent / "run0"
    (tmp_path / "file").write_text("kept")
    out = tmp_path.joinpath("file", *below)
    assert checkpoint_main(["export", str(run), str(out)]) == 2
    assert errors(capsys) == [f"error: cannot write the export to {out}: {tmp_path / 'file'} is a file, not a "
                              "directory; choose an OUT_DIR in a directory"]
    assert (tmp_path / "file").read_text() == "kept" and sorted(p.name for p in tmp_path.iterdir()) == ["file"]
    # Missing parents are made, as before.
    assert checkpoint_main(["export", str(run), str(tmp_path / "new" / "out")]) == 0


def test_a_step_that_is_not_a_number_names_the_flag(bases, tmp_path, capsys):
    assert checkpoint_main(["export", str(bases[0].parent / "run0"), str(tmp_path / "out"), "--step", "abc"]) == 2
    assert errors(capsys) == ["error: --step 'abc' is not a step number; give a saved step such as --step 100, or "
                              "leave --step out for the newest intact checkpoint"]
