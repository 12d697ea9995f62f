"""A key that a resume overrides is not ignored silently (issue 34, item 9): with checkpoints in
output_dir, checkpoint.load_params_from gives way to the resume, and the run says so in one line."""

import pytest

from maxtext_rocm import train
from test_bad_inputs import SMALL


@pytest.mark.slow  # two short trainings: ~30 s alone on 2 cores
def test_load_params_from_ignored_by_a_resume_is_named(tmp_path, capsys):
    run, other = tmp_path / "run", tmp_path / "other"
    args = ["configs/tiny_llama.py", *SMALL, "--config.checkpoint.every=2", "--config.checkpoint.async_save=false",
            "--config.train.compilation_cache=off"]
    assert train.main([*args, f"--config.output_dir={run}"]) == 0
    other.mkdir()  # (another run's directory; never read, since the resume wins)
    capsys.readouterr()
    assert train.main([*args, "--config.train.steps=3", f"--config.output_dir={run}",
                       f"--config.checkpoint.load_params_from={other}"]) == 0
    out = capsys.readouterr().out.splitlines()
    warnings = [line for line in out if line.startswith("warning: checkpoint.load_params_from")]
    assert warnings == [f"warning: checkpoint.load_params_from={str(other)!r} is ignored: output_dir {run} holds "
                        "checkpoint 2, which this run resumes from; give the run a new output_dir to start from "
                        "those parameters"], out
