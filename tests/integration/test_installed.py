"""Installed, not cloned: the wheel built from this tree, installed into a fresh venv that holds only its declared
dependencies (and theirs), runs the README's trainer block as written, on a plan shipped inside the wheel.

No network: the dependencies' files are linked from the running venv (the same files pip would install), and
`pip check` proves the fresh venv satisfies the wheel's declared requirements. The block is run from outside the
repository, so `shardplan` can only come from the wheel. Only the device ("cuda" -> "cpu"), the plan (layer 0 of the
rank: a whole Llama-3.1-8B rank is 8 GB) and NaN-poisoned params are changed; the bytes are checked against the
reference interpreter (shardplan.plan.interp, shipped in the wheel).
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from packaging.requirements import Requirement

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]
HEAVY = ("vllm", "sglang", "transformers", "safetensors", "ray", "mooncake", "nixl")


def readme_trainer_block() -> str:
    text = (ROOT / "README.md").read_text()
    found = re.search(r"<!-- trainer example -->\s*```python\n(.*?)```", text, re.S)
    assert found, "README.md lost its trainer example (the ```python block after <!-- trainer example -->)"
    block = found.group(1)
    for old, new in [
        ('device="cuda"', 'device="cpu"'),
        ("plan_file.rank(1)", "layer_zero(plan_file.rank(1))"),
        ('params_from_plan(plan, device="cpu")', 'params_from_plan(plan, device="cpu", fill=float("nan"))'),
    ]:
        assert old in block, f"README's trainer block no longer says {old!r}: update this test with it"
        block = block.replace(old, new)
    return block


PRELUDE = """
import sys
import torch
from shardplan.plan import ir
from shardplan.plan.file import load_plan as _load_plan


def layer_zero(plan):
    keep = {p.name for p in plan.params if ".layers.0." in p.name}
    writes = tuple(w for w in plan.writes if w.param in keep)
    return ir.RankPlan(plan.rank, tuple(p for p in plan.params if p.name in keep), writes)


_sources = _load_plan("llama-3.1-8b", tp=2).sources
_read = set()
for _w in layer_zero(_load_plan("llama-3.1-8b", tp=2).rank(1)).writes:
    ir.sources(_w.src.leaf, _read)
_g = torch.Generator().manual_seed(0)
trainer_tensors = {
    n: torch.randn(_sources[n].shape, generator=_g).to(torch.bfloat16) for n in sorted(_read)
}
"""

EPILOGUE = """
import json
import shardplan
from shardplan.plan.interp import apply_reference

want = params_from_plan(plan, device="cpu", fill=float("nan"))
apply_reference(plan, trainer_tensors, want)
for name, got in params.items():
    a, b = got.contiguous().view(torch.uint8), want[name].contiguous().view(torch.uint8)
    assert torch.equal(a, b), f"{name}: the README's lines wrote other bytes than the reference interpreter"
    assert not torch.isnan(got).any(), f"{name}: elements left unwritten"
heavy = sorted({m.split(".")[0] for m in sys.modules} & set(%r))
print(json.dumps({"shardplan": shardplan.__file__, "heavy": heavy, "params": len(params),
                  "bytes": int(buffer.numel() * buffer.element_size())}))
""" % (HEAVY,)


def _closure(requirements: list[str]) -> list[importlib.metadata.Distribution]:
    """The installed distributions these requirements pull in (markers evaluated, extras not taken)."""
    seen: dict[str, importlib.metadata.Distribution] = {}
    todo = [Requirement(r) for r in requirements]
    while todo:
        req = todo.pop()
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        key = re.sub(r"[-_.]+", "-", req.name).lower()
        if key in seen:
            continue
        dist = importlib.metadata.distribution(req.name)
        seen[key] = dist
        todo += [Requirement(r) for r in dist.requires or ()]
    return list(seen.values())


def _link_distribution(dist: importlib.metadata.Distribution, site: Path) -> None:
    """Link a distribution's top-level entries (packages, modules, its .dist-info) into `site`."""
    tops = {Path(str(f)).parts[0] for f in dist.files or () if not str(f).startswith("..")}
    source = Path(dist.locate_file(""))
    for top in tops:
        target = site / top
        if (source / top).exists() and not target.exists():
            target.symlink_to(source / top)


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    root = tmp_path_factory.mktemp("installed")
    # the tracked files alone (what a clean checkout holds), built outside the tree: setuptools leaves build/ behind
    tree = root / "tree"
    for name in subprocess.check_output(["git", "ls-files", "-z"], cwd=ROOT, text=True).split("\0"):
        if name and os.path.lexists(ROOT / name):
            (tree / name).parent.mkdir(parents=True, exist_ok=True)
            if (ROOT / name).is_symlink():
                (tree / name).symlink_to(os.readlink(ROOT / name))
            else:
                shutil.copy2(ROOT / name, tree / name)
    wheels = root / "wheels"
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(wheels), str(tree)],
        check=True,
        cwd=root,
    )
    (wheel,) = wheels.glob("shardplan-*.whl")
    venv = root / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    pip = [sys.executable, "-m", "pip", "--python", str(python)]
    subprocess.run([*pip, "install", "-q", "--no-deps", "--no-index", str(wheel)], check=True)
    purelib = "import sysconfig; print(sysconfig.get_paths()['purelib'])"
    site = Path(subprocess.check_output([str(python), "-c", purelib], text=True).strip())
    declared = importlib.metadata.distribution("shardplan").requires or []
    runtime = [r for r in declared if "extra ==" not in r]
    for dist in _closure(runtime):
        _link_distribution(dist, site)
    check = subprocess.run([*pip, "check"], capture_output=True, text=True)
    assert check.returncode == 0, f"the fresh venv lacks a declared dependency:\n{check.stdout}{check.stderr}"
    return venv, wheel, runtime


def _run(venv: Path, *args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "SHARDPLAN_PLAN_PATH", "VIRTUAL_ENV")}
    env["XDG_CACHE_HOME"] = str(cwd / "cache")  # no user cache: the plan can only come from the wheel
    return subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)


def test_readme_trainer_block_runs_from_the_installed_wheel(installed, tmp_path):
    venv, wheel, runtime = installed
    import zipfile

    inside = zipfile.ZipFile(wheel).namelist()
    shipped = sorted(p.name for p in (ROOT / "shardplan" / "plans").glob("*.plan"))
    assert sorted(Path(n).name for n in inside if n.startswith("shardplan/plans/")) == shipped
    assert "shardplan/__init__.pyi" in inside and "shardplan/py.typed" in inside
    assert sorted(Requirement(r).name for r in runtime) == ["msgpack", "numpy", "torch"], runtime

    script = tmp_path / "readme_trainer.py"
    script.write_text(PRELUDE + readme_trainer_block() + EPILOGUE)
    done = _run(venv, str(venv / "bin" / "python"), str(script), cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-4000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["shardplan"].startswith(str(venv)), result  # the wheel's copy, not the repository's
    assert result["heavy"] == [], result
    assert result["params"] > 0 and result["bytes"] > 0, result


def test_version_from_the_installed_console_script(installed, tmp_path):
    venv, _, _ = installed
    done = _run(venv, str(venv / "bin" / "shardplan"), "--version", cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-4000:]
    import shardplan

    lines = done.stdout.splitlines()
    assert lines[0] == f"shardplan {shardplan.__version__}", done.stdout
    assert re.match(r"shipped plans: \d+ in .*venv.*, recorded with vllm \d", lines[1]), done.stdout
    assert "installed: vllm not installed; sglang not installed" in lines[2], done.stdout
