"""`convert from-hf` / `to-hf` into a folder that cannot be written: one sentence naming the path,
exit status 2, nothing left behind (no OUT_DIR, no temporary folder beside it)."""

import errno
import os
import pathlib
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")
from test_convert import REPO, make_hf  # noqa: E402

from maxtext_rocm.convert.__main__ import main as convert_main  # noqa: E402


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    """A tiny Hugging Face folder and its export (the sources of from-hf and to-hf)."""
    root = tmp_path_factory.mktemp("sources")
    make_hf(root / "hf")
    assert convert_main(["from-hf", str(root / "hf"), str(root / "export")]) == 0
    return {"from-hf": root / "hf", "to-hf": root / "export"}


def cli(command, source, out):
    return subprocess.run([sys.executable, "-m", "maxtext_rocm.convert", command, str(source), str(out)],
                          cwd=REPO, capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("command", ["from-hf", "to-hf"])
def test_output_under_a_file_or_a_missing_folder_is_one_sentence(command, sources, tmp_path, capsys):
    (tmp_path / "a_file").write_text("not a folder")
    cases = {tmp_path / "a_file" / "out": "a_file is a file, not a directory",
             tmp_path / "missing" / "out": "missing does not exist"}
    for out, needle in cases.items():  # as a user runs it
        result = cli(command, sources[command], out)
        assert result.returncode == 2, result.stderr
        assert "Traceback" not in result.stderr and result.stderr.count("\n") == 1, result.stderr
        assert needle in result.stderr and str(out) in result.stderr, result.stderr
    nested = tmp_path / "a_file" / "sub" / "out"  # the file is further up
    capsys.readouterr()
    assert convert_main([command, str(sources[command]), str(nested)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"{tmp_path / 'a_file'} is a file, not a directory" in err, err
    assert sorted(os.listdir(tmp_path)) == ["a_file"]


@pytest.mark.parametrize("command", ["from-hf", "to-hf"])
def test_unwritable_parent_is_one_sentence(command, sources, tmp_path, monkeypatch, capsys):
    """A parent the user may not write to (root may write anywhere, so permission is simulated:
    first as os.access reports it, then as a filesystem that refuses the mkdir, as a read-only
    mount does even for root)."""
    locked = tmp_path / "locked"
    locked.mkdir()
    real_access = os.access
    monkeypatch.setattr(os, "access", lambda path, mode, **kw: Path(path) != locked and real_access(path, mode, **kw))
    capsys.readouterr()
    assert convert_main([command, str(sources[command]), str(locked / "out")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"{locked} is not writable" in err, err
    monkeypatch.undo()

    real_mkdir = pathlib.Path.mkdir

    def refusing_mkdir(self, *args, **kwargs):
        if self.parent == locked:
            raise PermissionError(errno.EACCES, "Permission denied", str(self))
        return real_mkdir(self, *args, **kwargs)

    monkeypatch.setattr(pathlib.Path, "mkdir", refusing_mkdir)
    assert convert_main([command, str(sources[command]), str(locked / "out")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"could not write {locked / 'out'}: Permission denied" in err, err
    assert os.listdir(locked) == []


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into a read-only folder")
def test_read_only_parent_for_a_user(sources, tmp_path):
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o555)
    try:
        result = cli("to-hf", sources["to-hf"], locked / "out")
    finally:
        locked.chmod(0o755)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    assert f"{locked} is not writable" in result.stderr and os.listdir(locked) == []


def test_a_full_disk_while_writing_leaves_nothing(sources, tmp_path, monkeypatch, capsys):
    import safetensors.numpy

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(safetensors.numpy, "save_file", full)
    capsys.readouterr()
    assert convert_main(["to-hf", str(sources["to-hf"]), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"could not write {tmp_path / 'out'}: No space left on device" in err, err
    assert os.listdir(tmp_path) == []
