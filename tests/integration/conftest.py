"""Fixtures the integration tests share (helpers live in modules beside them, never in another test module)."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # LOOPBACK ONLY: every byte of the tests stays on 127.0.0.1,
# spawned ranks and Ray workers included (they inherit this environment)
os.environ.setdefault("UCX_NET_DEVICES", "lo")
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")


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
