"""Every notebook in notebooks/ runs top to bottom on CPU, without errors (a cell that hangs fails after 3 minutes)."""

import nbformat
import pytest
from nbclient import NotebookClient

from tests.helpers import REPO_ROOT

NOTEBOOKS = sorted((REPO_ROOT / "notebooks").glob("*.ipynb"))


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_runs(path, hf_scale_cache, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # the other pytest-xdist worker has the other core
    monkeypatch.setenv("PYTHONPATH", str(REPO_ROOT))
    notebook = nbformat.read(path, as_version=4)
    # raises CellExecutionError, with the cell and its traceback, on the first failing cell
    NotebookClient(
        notebook, timeout=180, kernel_name="python3", resources={"metadata": {"path": str(REPO_ROOT)}}
    ).execute()
    errors = [o for cell in notebook.cells for o in cell.get("outputs", []) if o.get("output_type") == "error"]
    assert not errors


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_ships_with_its_outputs(path):
    """A walkthrough read on GitHub shows what it prints (04_conversations shipped without, 01-03 with theirs)."""
    notebook = nbformat.read(path, as_version=4)
    code = [cell for cell in notebook.cells if cell.cell_type == "code"]
    assert sum(bool(cell.get("outputs")) for cell in code) >= len(code) // 2, path.name
