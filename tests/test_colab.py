"""examples/colab_dpo.ipynb runs top to bottom (nbclient, CPU, its small configuration)."""

import os
from pathlib import Path

import pytest
from xla_flags import with_devices

nbclient = pytest.importorskip("nbclient")
nbformat = pytest.importorskip("nbformat")

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOK = ROOT / "examples" / "colab_dpo.ipynb"


def test_install_cell_installs_the_package_with_its_tpu_extra():
    source = "".join(c.source for c in nbformat.read(NOTEBOOK, as_version=4).cells)
    # jax[tpu] at our jax pin comes with the `tpu` extra (tests/test_install_extras.py), so the
    # notebook names no jax version of its own.
    assert 'os.environ.get("JAXRL_PACKAGE", "jaxrl[tpu]")' in source
    assert '"pip", "install", "-q", JAXRL_PACKAGE]' in source
    assert "jax[tpu]==" not in source and "JAX_VERSION" not in source
    assert "/content/jaxrl" not in source  # installs the package, not an uploaded checkout
    # Nothing imports jax before the install cell has run (no restart needed).
    first_code = next(c.source for c in nbformat.read(NOTEBOOK, as_version=4).cells if c.cell_type == "code")  # fmt: skip
    assert "pip" in first_code and "import jax" not in first_code


@pytest.mark.slow
def test_notebook_runs_top_to_bottom_on_cpu(tmp_path, monkeypatch):
    monkeypatch.setenv("JAXRL_NOTEBOOK_SKIP_INSTALL", "1")
    monkeypatch.setenv("JAXRL_NOTEBOOK_SMALL", "1")
    monkeypatch.setenv("JAXRL_NOTEBOOK_OUT", str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    monkeypatch.setenv("XLA_FLAGS", with_devices(2))
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    client = nbclient.NotebookClient(
        notebook,
        timeout=600,
        kernel_name="python3",
        resources={"metadata": {"path": str(tmp_path)}},
    )
    client.execute()  # raises CellExecutionError naming the failing cell
    assert (tmp_path / "dpo_tiny" / "metrics.jsonl").read_text()
    assert (tmp_path / "dpo_model" / "config.json").exists()
    last = notebook.cells[-1].outputs[0]["data"]["text/plain"]
    assert "(2," in last  # the metrics of step 2 are shown
