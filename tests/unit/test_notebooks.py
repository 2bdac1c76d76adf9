"""The committed notebooks are executed, show their plots as images and carry no third-party noise.

CI re-executes every notebook (`pytest --nbmake notebooks`); this checks what readers see on the page: the outputs
committed in the files."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

NOTEBOOKS = sorted((Path(__file__).resolve().parents[2] / "notebooks").glob("*.ipynb"))


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_committed_outputs_show_plots_and_no_noise(path):
    cells = [c for c in json.loads(path.read_text())["cells"] if c["cell_type"] == "code"]
    assert cells, f"{path.name} has no code"
    for i, cell in enumerate(cells):
        source = "".join(cell["source"])
        outputs = cell.get("outputs", [])
        assert cell.get("execution_count") is not None, f"{path.name} code cell {i} was not executed before commit"
        assert not [o for o in outputs if o["output_type"] == "error"], f"{path.name} code cell {i} failed"
        noise = [
            "".join(o.get("text", "")).splitlines()[0]
            for o in outputs
            if o["output_type"] == "stream" and o.get("name") == "stderr"
        ]
        assert not noise, f"{path.name} code cell {i} shows stderr output (third-party noise?): {noise}"
        if "plt.show()" in source:
            images = [o for o in outputs if "image/png" in o.get("data", {})]
            assert images, f"{path.name} code cell {i} calls plt.show() but its committed output has no image"
