"""The front (`from shardplan import ...`): every name is its home's object, the stub declares exactly the same
names, and importing the whole front loads no vLLM, SGLang, transformers or safetensors."""

from __future__ import annotations

import ast
import importlib
import pathlib

from blocked_imports import run_without_vllm

import shardplan

STUB = pathlib.Path(shardplan.__file__).with_name("__init__.pyi")


def test_every_front_name_is_its_homes_object():
    for name, home in shardplan._FRONT.items():
        assert getattr(shardplan, name) is getattr(importlib.import_module(home), name), name
    assert set(shardplan.__all__) == {"__version__", *shardplan._FRONT}
    assert set(shardplan._FRONT) <= set(dir(shardplan))


def test_the_stub_declares_the_same_names_from_the_same_homes():
    declared = {}
    for node in ast.parse(STUB.read_text()).body:
        if isinstance(node, ast.ImportFrom):
            for alias in node.names:
                assert alias.asname == alias.name, f"{alias.name}: a stub re-exports only as `X as X`"
                declared[alias.name] = node.module
    assert declared == shardplan._FRONT


def test_an_unknown_name_is_an_attribute_error():
    try:
        shardplan.Replayerr  # noqa: B018
    except AttributeError as e:
        assert "Replayerr" in str(e)
    else:
        raise AssertionError("shardplan.Replayerr resolved")


def test_the_whole_front_imports_no_engine_or_hub_library():
    out = run_without_vllm(
        """
        import shardplan
        from shardplan import *  # noqa: F403
        heavy = sorted({m.split('.')[0] for m in sys.modules} & {'sglang', 'ray', 'mooncake', 'nixl'})
        assert not heavy, heavy
        print(len(shardplan.__all__))
        """
    )
    assert int(out) == len(shardplan._FRONT) + 1
