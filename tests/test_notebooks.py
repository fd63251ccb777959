"""The demo notebooks (percent-format .py, jupytext) run top to bottom."""

import glob
import os

import pytest

jupytext = pytest.importorskip("jupytext")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("matplotlib")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NOTEBOOKS = sorted(glob.glob(os.path.join(ROOT, "notebooks", "*.py")))


@pytest.mark.parametrize("path", NOTEBOOKS, ids=os.path.basename)
def test_notebook_runs(path, monkeypatch):
  if "pytorch" in path:
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
  monkeypatch.setenv("MPLBACKEND", "Agg")
  monkeypatch.setenv("JAX_PLATFORMS", os.environ.get("JAX_PLATFORMS", "cpu"))
  monkeypatch.setenv("CG_JAX_COMPILATION_CACHE", "off")
  notebook = jupytext.read(path)
  client = nbclient.NotebookClient(notebook, timeout=600, kernel_name="python3",
                                   resources={"metadata": {"path": ROOT}})
  client.execute()


def test_all_four_notebooks_exist():
  assert [os.path.basename(p) for p in NOTEBOOKS] == [
      "01_quickstart.py", "02_cuda_graphs.py", "03_pallas_attention.py",
      "04_accuracy_vs_pytorch.py"]
