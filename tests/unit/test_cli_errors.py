"""CLI input that used to be accepted silently or end in a traceback: a named error, a hint, exit code 2, and for
`record` the refusal comes before any recording starts."""

from __future__ import annotations

import subprocess
import sys

import pytest
from planfile_helpers import rich_bytes

from shardplan import cli
from shardplan.plan.layout import LayoutError, parse_ranks


def _main(capsys, *argv):
    code = cli.main(list(argv))
    return code, capsys.readouterr().err


@pytest.mark.parametrize(
    "text, match",
    [
        ("31-0", "reversed range"),
        ("3-1,5", "reversed range"),
        ("", "cannot parse ''"),
        ("0,,1", "cannot parse ''"),
        ("-1", "cannot parse"),
        ("0-40", "outside 0..31"),
    ],
)
def test_bad_rank_lists_are_refused(text, match):
    with pytest.raises(LayoutError, match=match):
        parse_ranks(text, 32)


def test_good_rank_lists():
    assert parse_ranks(None, 4) == parse_ranks("all", 4) == [0, 1, 2, 3]
    assert parse_ranks(" 3, 0-1 ,1", 4) == [0, 1, 3]


def _no_recording(monkeypatch):
    """Fail the test if recording starts: the CLI must refuse before it."""

    def boom(*a, **k):
        raise AssertionError("recording started")

    monkeypatch.setattr(cli, "RecordSession", boom)


def test_reversed_ranks_exit_2(capsys, monkeypatch):
    _no_recording(monkeypatch)
    code, err = _main(capsys, "record", "--model", "kimi-k2", "--tp", "32", "--ranks", "31-0")
    assert code == 2 and "reversed range" in err and "write 0-31" in err


@pytest.mark.slow  # builds the config through transformers: `make test`, not `make test-fast`
def test_unknown_override_key_names_the_closest(capsys, monkeypatch):
    _no_recording(monkeypatch)
    code, err = _main(capsys, "record", "--model", "llama-3.1-8b", "--override", "num_hiden_layers=2")
    assert code == 2 and "no config field 'num_hiden_layers'" in err and "did you mean 'num_hidden_layers'" in err
    code, err = _main(capsys, "verify", "--model", "llama-3.1-8b", "--override", "rope_scalin.factor=2")
    assert code == 2 and "did you mean 'rope_scaling'" in err


def test_known_override_keys_pass_the_check():
    # keys of the config, and defaults of its transformers config class that the config.json leaves out
    cli._check_override_keys("llama-3.1-8b", ["num_hidden_layers=2", "rope_scaling.factor=8", "use_cache=false"])


def test_unwritable_out_is_refused_before_recording(capsys, monkeypatch, tmp_path):
    _no_recording(monkeypatch)
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    code, err = _main(capsys, "record", "--model", "llama-3.1-8b", "--out", str(blocker / "sub"))
    assert code == 2 and "cannot write" in err and "nothing was recorded" in err
    taken = tmp_path / "out" / "llama-3.1-8b--tp1--bfloat16.plan"
    taken.mkdir(parents=True)
    code, err = _main(capsys, "record", "--model", "llama-3.1-8b", "--out", str(tmp_path / "out"))
    assert code == 2 and "taken by a directory" in err


def test_inspect_uncovered_rank(capsys, tmp_path):
    path = tmp_path / "a.plan"
    path.write_bytes(rich_bytes())
    code, err = _main(capsys, "inspect", str(path), "--rank", "7")
    assert code == 2 and "no plan for rank 7" in err and "covers ranks [0, 1]" in err
    assert cli.main(["inspect", str(path), "--rank", "1"]) == 0


@pytest.mark.slow  # subprocesses / whole shipped plans: `make test`, not `make test-fast`
@pytest.mark.parametrize("kind", ["fifo", "dev_zero", "directory", "truncated", "format1"])
def test_inspect_odd_files_exit_2_without_traceback(kind, tmp_path):
    import os

    path = {"dev_zero": "/dev/zero", "directory": str(tmp_path), "format1": "x"}.get(kind, str(tmp_path / "p.plan"))
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "truncated":
        open(path, "wb").write(rich_bytes()[:50])
    elif kind == "format1":
        path = str(tmp_path / "old.plan")
        open(path, "wb").write(b"SHRDPLAN\x01\x00\x00\x00" + bytes(40))
    out = subprocess.run(
        [sys.executable, "-m", "shardplan.cli", "inspect", path], capture_output=True, text=True, timeout=600
    )
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
    assert path in out.stderr and "docs/plan-format.md" in out.stderr
