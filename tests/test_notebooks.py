"""The analysis notebooks and the report run on real CPU smoke sweeps, and the notebooks' two
forms agree.

The ``results_dirs`` fixture runs the ``*_cpu_smoke`` experiments (``python run.py -m
+experiment=...``, a few steps per job). Each ``notebooks/*.ipynb`` is executed in a fresh kernel
of this interpreter (a kernelspec made for the test, so nothing needs installing first) with
``MEMO_RESULTS`` set to those sweeps.
"""

import base64
import json
import os
import subprocess
import sys
from pathlib import Path

import jupytext
import nbclient
import nbformat
import pytest

from conftest import PYTHON, REPO

NOTEBOOKS = sorted((Path(__file__).resolve().parents[1] / "notebooks").glob("*.ipynb"))
KERNEL = "memo-tests"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


# The smoke sweeps the notebooks show, made smaller still (one length each, 256 tokens, and a
# vocabulary of 1000 tokens, whose output layer no longer takes most of a step: tables and figures
# of many lengths are tested on rows made by hand in test_analysis.py): CI runs them all.
SMALL = ["seq=256", "model.vocab_size=1000"]
SWEEPS = {
    "ablation_cpu_smoke": ["train.steps=2", *SMALL],
    "alpha_sweep_cpu_smoke": ["train.steps=2", *SMALL, "alpha=0,0.5,1"],
    "convergence_cpu_smoke": ["train.steps=4", *SMALL],
    "end_to_end_cpu_smoke": ["train.steps=2", *SMALL],
}


@pytest.fixture(scope="module")
def results_dirs(tmp_path_factory) -> list[Path]:
    """The sweep directories the notebooks read: real CPU smoke sweeps, one per experiment, run
    side by side (one thread each)."""
    root = tmp_path_factory.mktemp("multirun")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    logs = root.parent / f"{root.name}-logs"
    logs.mkdir()
    sweeps = {}
    for experiment, overrides in SWEEPS.items():
        with open(logs / f"{experiment}.txt", "w") as log:
            sweeps[experiment] = subprocess.Popen(
                [PYTHON, str(REPO / "run.py"), "-m", f"+experiment={experiment}", "train.warmup_steps=1",
                 f"hydra.sweep.dir={root / experiment}", *overrides],
                cwd=root, env=env, stdout=log, stderr=subprocess.STDOUT,
            )
    for experiment, sweep in sweeps.items():
        sweep.wait(timeout=600)
        assert sweep.returncode == 0, (logs / f"{experiment}.txt").read_text()[-3000:]
    return [root]


@pytest.fixture
def jupyter_env(tmp_path, monkeypatch, results_dirs):
    """A kernelspec running this interpreter, and Jupyter's and IPython's state kept in tmp."""
    spec = tmp_path / "jupyter" / "kernels" / KERNEL
    spec.mkdir(parents=True)
    argv = [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"]
    (spec / "kernel.json").write_text(json.dumps(
        {"argv": argv, "display_name": KERNEL, "language": "python"}))
    monkeypatch.setenv("JUPYTER_PATH", str(tmp_path / "jupyter"))
    monkeypatch.setenv("JUPYTER_RUNTIME_DIR", str(tmp_path / "runtime"))
    monkeypatch.setenv("IPYTHONDIR", str(tmp_path / "ipython"))
    monkeypatch.setenv("MEMO_RESULTS", ",".join(map(str, results_dirs)))


def test_there_are_notebooks():
    assert {p.stem for p in NOTEBOOKS} >= {"ablation", "end_to_end"}


@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=lambda p: p.stem)
def test_paired_script_matches_the_notebook(notebook):
    script = jupytext.read(notebook.with_suffix(".py"))
    stored = nbformat.read(notebook, as_version=4)
    assert [(c.cell_type, c.source) for c in script.cells] == [
        (c.cell_type, c.source) for c in stored.cells
    ], f"run: jupytext --sync {notebook.with_suffix('.py')}"
    # Outputs depend on whoever ran it last and bloat diffs: the repository keeps none.
    assert not [c for c in stored.cells if c.cell_type == "code" and c.outputs]


@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_runs_and_draws(notebook, jupyter_env):
    nb = nbformat.read(notebook, as_version=4)
    client = nbclient.NotebookClient(
        nb, kernel_name=KERNEL, timeout=120, resources={"metadata": {"path": str(notebook.parent)}}
    )
    client.execute()  # raises CellExecutionError, with the traceback, if a cell fails
    outputs = [o for cell in nb.cells if cell.cell_type == "code" for o in cell.outputs]
    assert not [o for o in outputs if o.output_type == "error"]
    images = [base64.b64decode(o.data["image/png"]) for o in outputs
              if o.output_type in ("display_data", "execute_result") and "image/png" in o.data]
    assert images, f"{notebook.name} drew no figure"
    assert all(image.startswith(PNG_MAGIC) and len(image) > 1000 for image in images)


@pytest.mark.slow
def test_the_report_turns_a_smoke_sweep_into_the_ablation_table_and_figures(results_dirs, tmp_path):
    sweep = results_dirs[0] / "ablation_cpu_smoke"
    done = subprocess.run([PYTHON, "-m", "analysis.report", str(sweep), "--out", str(tmp_path)],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "ablation_cpu_smoke: 5 runs (ok 5)" in done.stdout
    table = (tmp_path / "ablation_cpu_smoke.md").read_text()
    mfu_rows = [line for line in table.splitlines() if line.startswith("| mfu ")]
    assert [line.split("|")[2].strip() for line in mfu_rows] == ["full_recompute", "full_recompute+plan",
                                                                 "full_swap+plan", "memo", "memo+plan"]
    cells = [cell.strip() for line in mfu_rows for cell in line.split("|")[3:-1]]
    assert len(cells) == 5 and all(cell.endswith("%") for cell in cells)  # one length: 1k
    for figure in ("mfu_vs_seq", "tgs_vs_seq", "step_time"):
        png = (tmp_path / f"ablation_cpu_smoke_{figure}.png").read_bytes()
        assert png.startswith(PNG_MAGIC) and len(png) > 1000
        assert (tmp_path / f"ablation_cpu_smoke_{figure}.svg").read_text().lstrip().startswith("<?xml")
