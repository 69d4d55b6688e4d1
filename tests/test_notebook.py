"""``examples/quickstart.ipynb`` runs end to end in a fresh kernel on a local Ray cluster of its
own: no cell errors, and the outputs hold the timeline plot, the per-epoch table and the sweep's
comparison."""

import base64
import shutil
from pathlib import Path

import pytest

pytestmark = [pytest.mark.ray, pytest.mark.timeout(600)]

NOTEBOOK = Path(__file__).resolve().parents[1] / "examples" / "quickstart.ipynb"


def _text(cell) -> str:
    parts = []
    for out in cell.get("outputs", []):
        if out.get("output_type") == "stream":
            parts.append(out["text"])
        elif "data" in out and "text/plain" in out["data"]:
            parts.append(out["data"]["text/plain"])
    return "".join(parts)


def test_quickstart_notebook_runs(tmp_path, monkeypatch):
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    pytest.importorskip("ipykernel")

    # The notebook starts its own local cluster unless RAY_ADDRESS names one.
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    monkeypatch.setenv("RAY_USAGE_STATS_ENABLED", "0")
    work = tmp_path / "nb"
    work.mkdir()
    shutil.copy(NOTEBOOK, work / NOTEBOOK.name)
    nb = nbformat.read(work / NOTEBOOK.name, as_version=4)
    client = nbclient.NotebookClient(nb, timeout=540, kernel_name="python3",
                                     resources={"metadata": {"path": str(work)}})
    client.execute()  # raises CellExecutionError naming the cell on any error

    code = [c for c in nb.cells if c.cell_type == "code"]
    assert all(c.get("execution_count") for c in code)
    assert not [o for c in code for o in c.get("outputs", []) if o.output_type == "error"]

    # The run wrote its files where the notebook ran.
    run = work / "runs" / "quickstart"
    assert (run / "summary.json").is_file() and (run / "report.png").is_file()

    # The plot, inline.
    pngs = [o["data"]["image/png"] for c in code for o in c.get("outputs", [])
            if o.get("output_type") == "display_data" and "image/png" in o.get("data", {})]
    assert len(pngs) == 1
    raw = base64.b64decode(pngs[0])
    assert raw[:8] == b"\x89PNG\r\n\x1a\n" and len(raw) > 30_000

    # The per-epoch table: a header and 4 epoch rows.
    tables = [_text(c) for c in code if "frozen/L" in _text(c) and "ideal speedup" in _text(c)]
    assert len(tables) == 1
    # Then every rank's memory under each layout, below the epochs.
    epochs, memory = tables[0].split("memory per rank")
    rows = [ln.split() for ln in epochs.splitlines()]
    assert [r[0] for r in rows if r and r[0].isdigit()] == ["1", "2", "3", "4"]
    assert "estimate" in memory

    # The sweep's comparison: one row per alpha.
    sweep = _text(code[-2])
    assert "alpha=0.2" in sweep and "alpha=0.5" in sweep and "ideal" in sweep
    for alpha in ("0.2", "0.5"):
        assert (work / "runs" / f"alpha-{alpha}" / "summary.json").is_file()
