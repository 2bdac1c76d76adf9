"""Every `shardplan.x.y` name, repo path and command quoted in the package (error messages included), docs/, the
README and the notebooks resolves: a rename that leaves a stale reference behind fails here, naming where.

Resolved from the source text (no imports: tests/unit stays free of vLLM). Commands are read where text is quoted
as code: `inline`, fenced blocks, notebook code cells."""

from __future__ import annotations

import ast
import functools
import json
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "shardplan"
STAGES = ("plan", "runtime", "transport", "sync", "record", "simulate", "engine")
# paths that stand for what a user makes, or a set of files, not for one file of this repository
EXAMPLES = ("my-model", "out/", "/tmp/", "DIR", "<", "*", "{")


def _texts():
    """(where, all text, code text) of every file whose references must resolve."""
    for path in sorted(PACKAGE.rglob("*.py")):
        text = path.read_text()
        yield path.relative_to(ROOT).as_posix(), text, "\n".join(re.findall(r"`([^`\n]+)`", text))
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        text = path.read_text()
        fenced = re.findall(r"^```[^\n]*\n(.*?)^```", text, flags=re.M | re.S)
        inline = re.findall(r"`([^`\n]+)`", re.sub(r"^```.*?^```", "", text, flags=re.M | re.S))
        yield path.relative_to(ROOT).as_posix(), text, "\n".join(fenced + inline)
    for path in sorted((ROOT / "notebooks").glob("*.ipynb")):
        cells = json.loads(path.read_text())["cells"]
        text = "\n".join("".join(c["source"]) for c in cells)
        code = [("".join(c["source"])) for c in cells if c["cell_type"] == "code"]
        md = "\n".join("".join(c["source"]) for c in cells if c["cell_type"] != "code")
        yield path.relative_to(ROOT).as_posix(), text, "\n".join(code + re.findall(r"`([^`\n]+)`", md))


def _line(text: str, pos: int) -> int:
    return text.count("\n", 0, pos) + 1


@functools.cache
def _top_level(path: pathlib.Path) -> dict[str, ast.AST]:
    """Names a module defines at its top level (def, class, assignment, import), and the node of each."""
    names: dict[str, ast.AST] = {}
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names[node.name] = node
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                for n in ast.walk(target):
                    if isinstance(n, ast.Name):
                        names[n.id] = node
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            for a in node.names:
                names[(a.asname or a.name).split(".")[0]] = node
    return names


def _resolves(dotted: str) -> bool:
    parts = dotted.split(".")[1:]
    here = PACKAGE
    for i, part in enumerate(parts):
        if (here / part).is_dir():
            here = here / part
            continue
        module = here / f"{part}.py" if (here / f"{part}.py").exists() else here / "__init__.py"
        rest = parts[i + 1 :] if module.name != "__init__.py" else parts[i:]
        if not module.exists():
            return False
        if not rest:
            return True
        node = _top_level(module).get(rest[0])
        if node is None:
            return False
        if isinstance(node, ast.ClassDef) and len(rest) > 1:
            members = {
                n.name for n in node.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
            }
            members |= {
                t.id
                for n in node.body
                if isinstance(n, (ast.Assign, ast.AnnAssign))
                for t in ast.walk(n.targets[0] if isinstance(n, ast.Assign) else n.target)
                if isinstance(t, ast.Name)
            }
            return rest[1] in members
        return True
    return True


def _subcommands() -> set[str]:
    names = set()
    for path in (PACKAGE / "cli.py", PACKAGE / "simulate" / "cli.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, ast.Call)
                and getattr(node.func, "attr", "") == "add_parser"
                and node.args
                and isinstance(node.args[0], ast.Constant)
            ):
                names.add(node.args[0].value)
    return names


def _make_targets() -> set[str]:
    return set(re.findall(r"^([a-z][\w-]*):", (ROOT / "Makefile").read_text(), flags=re.M))


DOTTED = re.compile(r"(?<![\w/.+-])shardplan(?:\.[A-Za-z_]\w*)+")
# a path inside the repository (a top-level folder) or inside the package (a stage folder)
PATH = re.compile(
    r"(?<![\w/.-])((?:shardplan|docs|tests|bench|scripts|notebooks)/[\w./-]*\w|(?:%s)/[\w/-]*\.py)" % "|".join(STAGES)
)
COMMAND = re.compile(r"(?:^|[`$!]\s*|\bpython3? )(shardplan|make|-m) ([\w.-]+)", flags=re.M)


def _problems():
    subcommands, targets = _subcommands(), _make_targets()
    for where, text, code in _texts():
        for m in DOTTED.finditer(text):
            name = m.group(0).rstrip(".")
            if not _resolves(name):
                yield f"{where}:{_line(text, m.start())}: {name} does not resolve"
        for m in PATH.finditer(text):
            path = m.group(1).rstrip(".")
            tail = re.match(r"[^\s`'\"),]*", text[m.end() :]).group(0)  # `x.{json,log}`, `x-<commit>.log`
            if any(e in path + tail for e in EXAMPLES):
                continue
            if not ((ROOT / path).exists() or (PACKAGE / path).exists()):
                yield f"{where}:{_line(text, m.start())}: path {path} does not exist"
        for m in COMMAND.finditer(code):
            tool, word = m.group(1), m.group(2)
            if tool == "shardplan" and word[0].isalpha() and word not in subcommands:
                yield f"{where}: `shardplan {word}` is not a subcommand of shardplan/cli.py"
            elif tool == "make" and word not in targets:
                yield f"{where}: `make {word}` is not a Makefile target"
            elif tool == "-m" and word.startswith("shardplan"):
                parts = word.split(".")
                module = PACKAGE.joinpath(*parts[1:])
                main = module / "__main__.py" if module.is_dir() else module.with_suffix(".py")
                if not main.exists() or "__main__" not in main.read_text():
                    yield f"{where}: `python -m {word}` runs nothing"


def test_quoted_names_paths_and_commands_resolve():
    problems = sorted(set(_problems()))
    assert not problems, "stale references:\n" + "\n".join(problems)
