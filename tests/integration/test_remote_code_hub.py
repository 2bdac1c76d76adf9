"""--trust-remote-code runs only code inside the given directory, and recording never contacts the hub.

A stand-in hub on loopback (HF_ENDPOINT points at it) records every request and serves a configuration_x.py that
writes a marker file when imported; another copy of that file lies outside the model directory. A config.json whose
model_type transformers knows ("llama") but whose auto_map names code elsewhere (a hub repository, an absolute path, a
../ path) must be refused with RemoteCodeError before anything resolves it, in process and from the CLI: the stand-in
hub sees no request and the marker never appears. Code inside a trusted directory that asks the hub for a file gets
no answer either, whatever the environment says about offline mode."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import huggingface_hub.constants
import pytest

from shardplan.plan.layout import Layout
from shardplan.record import remote
from shardplan.record.remote import RemoteCodeError
from shardplan.record.session import RecordSession

REPO_ROOT = Path(__file__).resolve().parents[2]
SIZES = {
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_hidden_layers": 2,
    "vocab_size": 300,
    "max_position_embeddings": 256,
    "tie_word_embeddings": False,
}

MY_CONFIG = "from transformers import LlamaConfig\n\n\nclass MyConfig(LlamaConfig):\n    pass\n"


def _code_writing(marker: Path) -> str:
    """A configuration module that leaves `marker` behind when it is imported."""
    return (
        "from pathlib import Path\n\n"
        "from transformers import LlamaConfig\n\n"
        f"Path({str(marker)!r}).write_text('ran')\n\n\n"
        "class XConfig(LlamaConfig):\n"
        '    model_type = "llama"\n'
    )


class StandInHub:
    """An HTTP server on 127.0.0.1 answering like the hub's resolve endpoint: every request is recorded, any .py file
    is served as the marker-writing module."""

    def __init__(self, marker: Path):
        self.requests: list[tuple[str, str]] = []
        body = _code_writing(marker).encode()
        requests = self.requests

        class Handler(BaseHTTPRequestHandler):
            def _answer(self):
                requests.append((self.command, self.path))
                data = body if self.path.endswith(".py") else b"{}"
                self.send_response(200)
                self.send_header("Content-Length", str(len(data)))
                self.send_header("ETag", '"0123456789abcdef"')
                self.send_header("X-Repo-Commit", "0" * 40)
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)

            do_GET = do_HEAD = do_POST = _answer

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_port}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()
        self.thread.join()


@pytest.fixture
def hub(tmp_path, monkeypatch):
    """The stand-in hub, with this process pointed at it and online (HF_HUB_OFFLINE unset, whatever the caller's
    environment says): only shardplan may switch the hub off. huggingface_hub reads its endpoint, cache and offline
    flag at import, so its constants are pointed here too."""
    marker = tmp_path / "MARKER"
    server = StandInHub(marker)
    server.marker = marker
    for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HF_ENDPOINT", server.url)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))  # shardplan's config copies for vLLM
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", server.url)
    template = server.url + "/{repo_id}/resolve/{revision}/{filename}"
    monkeypatch.setattr(huggingface_hub.constants, "HUGGINGFACE_CO_URL_TEMPLATE", template)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub-cache"))
    yield server
    server.close()


def _model_dir(tmp_path: Path, auto_map: dict, files: dict[str, str] | None = None) -> Path:
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({**SIZES, "model_type": "llama", "auto_map": auto_map}))
    for name, text in (files or {}).items():
        (model / name).write_text(text)
    return model


def _outside_reference(tmp_path: Path, kind: str, marker: Path) -> str:
    """The auto_map entry of each kind: a hub repository's module, or a marker-writing file outside the directory."""
    if kind == "hub":
        return "someorg/somerepo--configuration_x.XConfig"
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "configuration_x.py").write_text(_code_writing(marker))
    if kind == "absolute":
        return f"{outside}/configuration_x.XConfig"
    return "../outside/configuration_x.XConfig"  # model/../outside


KINDS = ["hub", "absolute", "parent"]
WHAT = {"hub": "hub repository 'someorg/somerepo'", "absolute": "absolute path", "parent": "'..'"}


@pytest.mark.parametrize("kind", KINDS)
def test_auto_map_outside_the_directory_is_refused_in_process(tmp_path, hub, kind):
    reference = _outside_reference(tmp_path, kind, hub.marker)
    model = _model_dir(tmp_path, {"AutoConfig": reference})
    with pytest.raises(RemoteCodeError) as refused:
        RecordSession(str(model), Layout(tp=1), trust_remote_code=True)
    message = str(refused.value)
    assert "auto_map['AutoConfig']" in message and repr(reference) in message and WHAT[kind] in message
    assert str(model) in message and "Copy" in message
    assert hub.requests == []
    assert not hub.marker.exists()


@pytest.mark.slow
@pytest.mark.parametrize("kind", KINDS)
def test_auto_map_outside_the_directory_is_refused_by_the_cli(tmp_path, hub, kind):
    reference = _outside_reference(tmp_path, kind, hub.marker)
    model = _model_dir(tmp_path, {"AutoConfig": reference})
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}
    env.update(HF_ENDPOINT=hub.url, HF_HOME=str(tmp_path / "hf-home"), XDG_CACHE_HOME=str(tmp_path / "cache"))
    command = [sys.executable, "-m", "shardplan.cli", "record", "--model", str(model), "--trust-remote-code"]
    command += ["--out", str(tmp_path / "plans")]
    done = subprocess.run(command, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "auto_map['AutoConfig']" in done.stderr and WHAT[kind] in done.stderr, done.stderr
    assert hub.requests == []
    assert not hub.marker.exists()


def test_every_auto_map_key_is_checked_lists_included(tmp_path, hub):
    """AutoTokenizer's (slow, fast) pair is checked too, though recording never loads a tokenizer."""
    files = {"configuration_my.py": MY_CONFIG}
    pair = ["configuration_my.MyConfig", "someorg/somerepo--tokenization_x.XTokenizerFast"]
    model = _model_dir(tmp_path, {"AutoConfig": "configuration_my.MyConfig", "AutoTokenizer": pair}, files)
    with pytest.raises(RemoteCodeError, match=r"auto_map\['AutoTokenizer'\] entry 'someorg/somerepo--tokenization_x"):
        RecordSession(str(model), Layout(tp=1), trust_remote_code=True)
    assert hub.requests == []


def test_a_module_missing_from_the_directory_is_refused(tmp_path):
    files = {"configuration_my.py": MY_CONFIG}
    auto_map = {"AutoConfig": "configuration_my.MyConfig", "AutoModelForCausalLM": "modeling_gone.MyModel"}
    model = _model_dir(tmp_path, auto_map, files)
    with pytest.raises(RemoteCodeError, match=r"auto_map\['AutoModelForCausalLM'\].*modeling_gone\.py, which is not"):
        RecordSession(str(model), Layout(tp=1), trust_remote_code=True)


@pytest.mark.parametrize(
    "entry, problem",
    [
        ("sub/configuration_my.MyConfig", "subdirectory"),
        ("configuration_my", "not of the form"),
        (42, "not a 'module.Class' string"),
        ("..\\outside\\configuration_x.XConfig", "'..'"),
    ],
)
def test_check_auto_map_names_each_problem(tmp_path, entry, problem):
    (tmp_path / "configuration_my.py").write_text("")
    remote.check_auto_map({"auto_map": {"AutoConfig": "configuration_my.MyConfig"}}, str(tmp_path), "here")
    remote.check_auto_map({"auto_map": {"AutoTokenizer": ["configuration_my.T", None]}}, str(tmp_path), "here")
    with pytest.raises(RemoteCodeError, match=f"auto_map\\['AutoModel'\\] entry .*{problem}"):
        remote.check_auto_map({"text_config": {"auto_map": {"AutoModel": entry}}}, str(tmp_path), "here")


def test_the_copy_for_vllm_is_checked_and_holds_only_the_directory_code(tmp_path, hub):
    files = {"configuration_my.py": MY_CONFIG}
    model = _model_dir(tmp_path, {"AutoConfig": "configuration_my.MyConfig"}, files)
    session = RecordSession(str(model), Layout(tp=1), overrides=["num_hidden_layers=1"], trust_remote_code=True)
    target = Path(session.vllm_config.model_config.model)
    assert sorted(p.name for p in target.glob("*.py")) == ["configuration_my.py"]
    (target / "stale_helper.py").write_text("raise SystemExit('not this directory')\n")
    remote.copy_code(session.spec, str(target))
    assert sorted(p.name for p in target.glob("*.py")) == ["configuration_my.py"]
    config = json.loads((target / "config.json").read_text())
    config["auto_map"]["AutoModel"] = "someorg/somerepo--modeling_x.XModel"
    (target / "config.json").write_text(json.dumps(config))
    with pytest.raises(RemoteCodeError, match=r"copy of .*auto_map\['AutoModel'\]"):
        remote.copy_code(session.spec, str(target))
    assert hub.requests == []


def test_code_inside_the_directory_cannot_reach_the_hub_while_recording(tmp_path, hub, monkeypatch):
    """The hub is off while recording by construction: the directory's own code asking huggingface_hub for a file is
    answered from nothing, though this process's environment says online; the setting is restored afterwards."""
    log = tmp_path / "fetches.log"
    asks = (
        "import huggingface_hub\n"
        "from transformers import LlamaConfig\n\n"
        "try:\n"
        '    huggingface_hub.hf_hub_download("someorg/somerepo", "configuration_x.py")\n'
        '    outcome = "fetched"\n'
        "except Exception as exc:\n"
        "    outcome = type(exc).__name__\n"
        f"with open({str(log)!r}, 'a') as f:\n"
        "    f.write(outcome + '\\n')\n\n\n"
        "class MyConfig(LlamaConfig):\n"
        '    model_type = "llama"\n'
    )
    model = _model_dir(tmp_path, {"AutoConfig": "configuration_my.MyConfig"}, {"configuration_my.py": asks})
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    session = RecordSession(str(model), Layout(tp=1), overrides=["num_hidden_layers=1"], trust_remote_code=True)
    session.record_rank(0)
    outcomes = log.read_text().split()
    assert outcomes and "fetched" not in outcomes, outcomes
    assert hub.requests == []
    assert not hub.marker.exists()
    assert huggingface_hub.constants.HF_HUB_OFFLINE is False and os.environ["HF_HUB_OFFLINE"] == "0"
    assert "TRANSFORMERS_OFFLINE" not in os.environ
