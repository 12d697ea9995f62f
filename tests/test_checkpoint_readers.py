"""Every reader of a checkpoint verifies it, and paths are paths (issue 34 items 5 and 6).

The readers: `checkpoint export`, `convert to-hf`, `load_params`, `generate` and
`checkpoint.load_params_from`. A damaged newest step of a run is passed over for the newest intact
one with a warning; a damaged step or export that was named is refused in one sentence (exit 2);
no reader ever returns the damaged numbers, and no message advises deleting anything.
"""

import shutil
from pathlib import Path

import jax
import numpy as np
import pytest

import maxtext_rocm as mr
from maxtext_rocm import checkpoint
from maxtext_rocm.config import CheckpointError
from maxtext_rocm.convert.__main__ import main as convert_main
from maxtext_rocm.generate import main as generate_main
from maxtext_rocm.train import Trainer

from conftest import small_config
from test_checkpoint_integrity import array_files, flip_bytes

PROMPT = ["--prompt", "ab", "--max-new-tokens", "2"]


def host(tree) -> list[np.ndarray]:
    return [np.asarray(x) for x in jax.tree_util.tree_leaves(tree)]


def hf_tensors(folder: Path) -> list[np.ndarray]:
    from safetensors.numpy import load_file

    tensors = {}
    for shard in sorted(folder.glob("*.safetensors")):
        tensors.update(load_file(shard))
    return list(tensors.values())


@pytest.fixture(scope="module")
def run(tmp_path_factory, devices_module):
    """A byte-tokenized run with checkpoints at steps 2 and 4, and the params of each."""
    out = tmp_path_factory.mktemp("run") / "run"
    cfg = small_config(**{"model.vocab_size": 264, "model.tie_embeddings": False, "output_dir": str(out),
                          "train.steps": 4, "checkpoint.every": 2, "checkpoint.async_save": False})
    trainer = Trainer(cfg, devices=devices_module[:2], log=lambda *_: None)
    trainer.run(2)
    at_2 = host(trainer.state.params)
    trainer.run()
    at_4 = host(trainer.state.params)
    trainer.checkpointer.close()
    trainer.writer.close()
    return out, cfg, at_2, at_4


@pytest.fixture(scope="module")
def devices_module():
    return jax.devices()


def damaged_copy(run, tmp_path, how="flipped") -> Path:
    """A copy of the run whose newest checkpoint (step 4) is damaged: "flipped", 64 bytes flipped in
    the middle of each array data file (OCDBT packs several arrays in a file, so the parameters
    are hit too); "other numbers", arrays that read back without error but are not the ones
    saved (step 2's state under step 4's record: what zstd gives when a flip decompresses)."""
    out = tmp_path / "damaged"
    shutil.copytree(run[0], out)
    step = out / "checkpoints" / "4"
    if how == "flipped":
        for path in array_files(step):
            if path.stat().st_size > 4096:
                flip_bytes(path, 64)
    else:
        shutil.rmtree(step / "state")
        shutil.copytree(out / "checkpoints" / "2" / "state", step / "state")
    return out


def assert_one_sentence(err: str, *names: str) -> None:
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:"), err
    assert "delete" not in err.lower() and "remove" not in err.lower(), err
    for name in names:
        assert name in err, (name, err)


def test_every_reader_passes_over_a_damaged_newest_checkpoint_for_the_older_intact_one(run, tmp_path, capsys):
    _, cfg, at_2, at_4 = run
    out = damaged_copy(run, tmp_path)
    assert not all(np.array_equal(a, b) for a, b in zip(at_2, at_4))

    def warned():
        err = capsys.readouterr().err
        assert "checkpoints/4 " in err and "checkpoints/2 instead" in err and "error" not in err, err
        assert f"maxtext_rocm.checkpoint verify {out / 'checkpoints' / '4'} checks it" in err, err
        assert "delete" not in err.lower()

    # checkpoint export: exit 0, the export holds step 2's parameters
    assert checkpoint.main(["export", str(out), str(tmp_path / "export")]) == 0
    warned()
    assert all(np.array_equal(a, b) for a, b in zip(host(mr.load_params(tmp_path / "export")), at_2))
    assert not capsys.readouterr().err  # the export carries checksums: verified, no warning

    # convert to-hf: finite weights, step 2's
    assert convert_main(["to-hf", str(out), str(tmp_path / "hf")]) == 0
    warned()
    tensors = hf_tensors(tmp_path / "hf")
    assert tensors and all(np.isfinite(t).all() for t in tensors)
    total = sum(float(np.abs(t.astype(np.float64)).sum()) for t in tensors)
    assert total == pytest.approx(sum(float(np.abs(a.astype(np.float64)).sum()) for a in at_2), rel=1e-9)

    # load_params (the notebook API)
    assert all(np.array_equal(a, b) for a, b in zip(host(mr.load_params(out)), at_2))
    warned()

    # generate
    assert generate_main([str(out), *PROMPT]) == 0
    warned()

    # checkpoint.load_params_from
    fresh = small_config(**{"model.vocab_size": 264, "model.tie_embeddings": False,
                            "output_dir": str(tmp_path / "fine_tune"), "checkpoint.load_params_from": str(out)})
    trainer = Trainer(fresh, devices=jax.devices()[:2], log=lambda *_: None)
    warned()
    # checkpoint verify: the run's newest intact step (with the warning), and step 4 refused
    assert checkpoint.main(["verify", str(out)]) == 0
    assert "are intact" in capsys.readouterr().out
    assert checkpoint.main(["verify", str(out / "checkpoints" / "4")]) == 2
    assert_one_sentence(capsys.readouterr().err, str(out / "checkpoints" / "4"))
    assert all(np.array_equal(a, b) for a, b in zip(host(trainer.state.params), at_2))


@pytest.mark.parametrize("how", ["flipped", "other numbers"])
def test_every_reader_refuses_a_named_damaged_checkpoint_in_one_sentence(how, run, tmp_path, capsys):
    out = damaged_copy(run, tmp_path, how)
    step = out / "checkpoints" / "4"
    why = "failed verification" if how == "other numbers" else "cannot be read"

    assert checkpoint.main(["export", str(out), str(tmp_path / "export"), "--step", "4"]) == 2
    assert_one_sentence(capsys.readouterr().err, str(step), why)
    assert not (tmp_path / "export").exists()

    assert convert_main(["to-hf", str(step), str(tmp_path / "hf")]) == 2
    assert_one_sentence(capsys.readouterr().err, str(step), why)
    assert not (tmp_path / "hf").exists()

    assert generate_main([str(step), *PROMPT]) == 2
    assert_one_sentence(capsys.readouterr().err, str(step))

    with pytest.raises(CheckpointError, match=why) as raised:
        mr.load_params(step)
    assert "delete" not in str(raised.value).lower()

    fresh = small_config(**{"model.vocab_size": 264, "model.tie_embeddings": False,
                            "output_dir": str(tmp_path / "fine_tune"), "checkpoint.load_params_from": str(step)})
    with pytest.raises(CheckpointError, match=why):
        Trainer(fresh, devices=jax.devices()[:2], log=lambda *_: None)


def test_a_damaged_export_is_refused_in_one_sentence(run, tmp_path, capsys):
    out, _, _, _ = run
    export = tmp_path / "export"
    assert checkpoint.main(["export", str(out), str(export)]) == 0
    capsys.readouterr()
    biggest = max((p for p in (export / "params").rglob("*") if p.is_file() and "/d/" in str(p)),
                  key=lambda p: p.stat().st_size)
    flip_bytes(biggest, 64)
    assert convert_main(["to-hf", str(export), str(tmp_path / "hf")]) == 2
    assert_one_sentence(capsys.readouterr().err, str(export))
    with pytest.raises(CheckpointError, match="params export"):
        mr.load_params(export)


def test_relative_symlinked_and_spaced_paths_are_paths(run, tmp_path, monkeypatch, capsys):
    out, cfg, _, at_4 = run
    monkeypatch.chdir(tmp_path)
    shutil.copytree(out, tmp_path / "my runs" / "x")
    (tmp_path / "link").symlink_to(tmp_path / "my runs" / "x")

    assert checkpoint.main(["export", "my runs/x", "out 1"]) == 0
    assert checkpoint.main(["export", "link", "out2", "--step", "4"]) == 0
    assert convert_main(["to-hf", "link", "hf out"]) == 0
    assert convert_main(["to-hf", "out 1", "hf2"]) == 0
    assert generate_main(["my runs/x", *PROMPT]) == 0
    assert generate_main(["link/checkpoints/4", *PROMPT]) == 0
    assert checkpoint.main(["verify", "out 1"]) == 0 and checkpoint.main(["verify", "link/checkpoints/2"]) == 0
    err = capsys.readouterr().err
    assert "error" not in err and "warning" not in err, err
    for source in ("my runs/x", "link", "out 1", "out2", "link/checkpoints/4"):
        assert all(np.array_equal(a, b) for a, b in zip(host(mr.load_params(source)), at_4)), source
    assert all(np.isfinite(t).all() for t in hf_tensors(tmp_path / "hf out"))
