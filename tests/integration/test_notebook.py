"""examples/notebooks/grpo_gsm8k_unsloth.ipynb executed top to bottom by a Jupyter kernel (nbclient), as a user
runs it: it trains, shows its progress bar as a notebook output (no terminal escapes), its log history, an
inline plot, an evaluation and a chat reply, and saves the adapter. Only OUTPUT_DIR is changed, by a cell
injected after the notebook's ``parameters`` cell (papermill's convention)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

import grpo

pytestmark = [pytest.mark.integration, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
NOTEBOOK = REPO / "examples" / "notebooks" / "grpo_gsm8k_unsloth.ipynb"
ESCAPE = "\x1b"  # every ANSI colour, cursor or erase sequence starts with it


def kernel_manager(folder: Path):
    """A kernel of this interpreter (so it imports this grpo), one thread as the tests' subprocesses."""
    from jupyter_client.kernelspec import KernelSpecManager
    from jupyter_client.manager import KernelManager

    spec = folder / "kernels" / "grpo-test"
    spec.mkdir(parents=True)
    source = str(Path(grpo.__file__).resolve().parents[1])
    env = {"PYTHONPATH": os.pathsep.join([source, os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    (spec / "kernel.json").write_text(json.dumps({
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "grpo test", "language": "python", "env": env}))
    return KernelManager(kernel_name="grpo-test",
                         kernel_spec_manager=KernelSpecManager(kernel_dirs=[str(folder / "kernels")]))


def execute(notebook, folder: Path):
    from nbclient import NotebookClient

    NotebookClient(notebook, km=kernel_manager(folder), timeout=300,
                   resources={"metadata": {"path": str(NOTEBOOK.parent)}}).execute()
    return notebook


def cell_outputs(notebook, source_start: str) -> list[dict]:
    [cell] = [c for c in notebook.cells if c.cell_type == "code" and c.source.startswith(source_start)]
    return cell.outputs


def strings(value) -> list[str]:
    """Every string inside the nested lists and dicts of cell outputs."""
    if isinstance(value, str):
        return [value]
    items = value.values() if isinstance(value, dict) else value if isinstance(value, list) else []
    return [s for item in items for s in strings(item)]


def test_the_gsm8k_notebook_runs_top_to_bottom_in_a_jupyter_kernel(tmp_path):
    nbformat = pytest.importorskip("nbformat")
    pytest.importorskip("nbclient")
    pytest.importorskip("ipykernel")
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    assert all(not c.get("outputs") for c in notebook.cells), "commit the notebook with its outputs cleared"
    [index] = [i for i, c in enumerate(notebook.cells) if "parameters" in c.metadata.get("tags", [])]
    parameters: dict = {}
    exec(notebook.cells[index].source, parameters)
    out = tmp_path / "run"
    notebook.cells.insert(index + 1, nbformat.v4.new_code_cell(f"OUTPUT_DIR = {str(out)!r}",
                                                               metadata={"tags": ["injected-parameters"]}))
    execute(notebook, tmp_path)  # a failing cell raises CellExecutionError with its traceback

    assert ESCAPE not in "".join(strings([c.get("outputs", []) for c in notebook.cells]))
    training = cell_outputs(notebook, "trainer.train()")
    # rich's live display (which only warns without ipywidgets) is not used; tqdm's own warning at import is
    # transformers', under TRL as well.
    assert "ipywidgets" not in "".join(strings(training))

    steps = parameters["MAX_STEPS"]
    [bar] = [o for o in training if o.output_type == "display_data"]
    assert bar.data["text/plain"].startswith("GRPO") and f"{steps}/{steps}" in bar.data["text/plain"]
    assert bar.data["text/html"].startswith("<pre") and f"{steps}/{steps}" in bar.data["text/html"]
    assert "reward" in bar.data["text/plain"]

    [table] = cell_outputs(notebook, "import pandas")
    assert all(f"<th>{step}</th>" in table.data["text/html"] for step in range(1, steps + 1))
    [plot] = cell_outputs(notebook, "trainer.plot()")
    assert plot.data["image/png"]  # base64 of plots/summary.png
    assert (out / "plots" / "summary.png").exists()
    [scores] = cell_outputs(notebook, "trainer.evaluate")
    assert "'eval_accuracy'" in scores.data["text/plain"]
    [reply] = cell_outputs(notebook, "import torch")
    assert reply.name == "stdout" and reply.text.strip()
    assert (out / "final" / "adapter_config.json").exists()
