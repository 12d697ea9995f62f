"""The quickstart notebook runs top to bottom, and is committed without outputs."""

from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

NOTEBOOKS = Path(__file__).resolve().parent.parent / "notebooks"


@pytest.mark.slow  # ~1 min (100 training steps in a kernel); CI budget
def test_quickstart_runs_top_to_bottom(tmp_path, monkeypatch):
    path = NOTEBOOKS / "quickstart.ipynb"
    notebook = nbformat.read(path, as_version=4)
    code = [cell for cell in notebook.cells if cell.cell_type == "code"]
    assert all(not cell.outputs and cell.execution_count is None for cell in code), \
        f"{path} has outputs; strip them before committing (jupyter nbconvert --clear-output --inplace)"
    monkeypatch.setenv("TMPDIR", str(tmp_path))  # the notebook's mkdtemp run directory: here, not /tmp
    # A fresh kernel (not this process: XLA flags must be set before its jax starts), cwd notebooks/.
    NotebookClient(notebook, timeout=300, kernel_name="python3",
                   resources={"metadata": {"path": str(NOTEBOOKS)}}).execute()
    text = "\n".join(out.get("text", "") for cell in code for out in cell.outputs)
    assert "loss of one batch" in text and "spec P(" in text
    assert any("image/png" in out.get("data", {}) for cell in code for out in cell.outputs)  # the plot
