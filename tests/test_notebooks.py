"""Execute the repository's notebooks top to bottom and fail on any cell error.

Each notebook is read into memory and run there (cwd = notebooks/), so the
committed file and its outputs are never modified by the test.
"""

import pathlib

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")  # provides the 'python3' kernel for this interpreter

NOTEBOOK_DIR = pathlib.Path(__file__).resolve().parent.parent / "notebooks"

# Notebooks to execute; a listed notebook that does not exist yet is skipped.
NOTEBOOKS = ["theory.ipynb", "demo.ipynb"]

CELL_TIMEOUT_S = 300


# jupyter_client resolves 'python3' to this interpreter whenever ipykernel is
# importable (native-kernel fallback, and a spec's 'python' argv is rewritten to
# sys.executable), so a fresh venv needs no `ipykernel install`.
KERNEL_NAME = "python3"


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_notebook_executes(name, monkeypatch):
  # The kernel inherits the environment: keep the demo sweep short in tests
  # (two γ: every cell still runs, on fewer compiled loops).
  monkeypatch.setenv("DEMO_NUM_EXAMPLES", "3")
  monkeypatch.setenv("DEMO_GAMMAS", "2,3")
  monkeypatch.setenv("JAX_PLATFORMS", "cpu")
  path = NOTEBOOK_DIR / name
  if not path.exists():
    pytest.skip(f"{path} does not exist yet")
  nb = nbformat.read(path, as_version=4)
  client = nbclient.NotebookClient(
    nb,
    timeout=CELL_TIMEOUT_S,
    kernel_name=KERNEL_NAME,
    resources={"metadata": {"path": str(NOTEBOOK_DIR)}},
  )
  client.execute()  # raises CellExecutionError on the first failing cell
  errors = [
    out
    for cell in nb.cells
    if cell.cell_type == "code"
    for out in cell.get("outputs", [])
    if out.get("output_type") == "error"
  ]
  assert not errors, errors
