"""Fixtures the integration tests share (helpers live in modules beside them, never in another test module)."""

from __future__ import annotations

import os

import pytest


@pytest.fixture(scope="module")
def ray_session():
    ray = pytest.importorskip("ray")
    here = os.path.dirname(os.path.abspath(__file__))  # workers import sync_worlds (the rank builder) by name
    root = os.path.dirname(os.path.dirname(here))
    path = os.pathsep.join([here, root, os.environ.get("PYTHONPATH", "")])
    ray.init(
        num_cpus=2,
        include_dashboard=False,
        _node_ip_address="127.0.0.1",
        log_to_driver=False,
        configure_logging=False,
        runtime_env={"env_vars": {"PYTHONPATH": path}},
    )
    yield ray
    ray.shutdown()


@pytest.fixture(scope="session")
def arch_root(tmp_path_factory):
    """Where the extra architectures' checkpoint directories are written (arch_sessions.arch_spec)."""
    return tmp_path_factory.mktemp("arch-checkpoints")
