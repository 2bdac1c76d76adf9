"""The simulator reproduces the measured 2 x H200 NCCL syncs (bench/results/) within 10%, from the bandwidths
measured in the same runs (shardplan/simulate/calibration.py says what it is given). Prints by how much."""

from __future__ import annotations

from pathlib import Path

import pytest

from shardplan.simulate.calibration import CASES, calibrate

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_simulator_reproduces_measured_h200_sync(case, capsys):
    cal = calibrate(case, ROOT)
    with capsys.disabled():
        print(
            f"\n{case.name}: {cal.nbytes / 1e9:.2f} GB over {cal.link_GBps:.0f} GB/s "
            f"(raw {cal.measured_ms['raw']:.2f} "
            f"ms): sharded measured {cal.measured_ms['sharded']:.2f} ms, simulated {cal.simulated_ms['sharded']:.2f} "
            f"ms ({cal.error('sharded'):+.1%}); end to end measured {cal.measured_ms['e2e']:.2f} ms, simulated "
            f"{cal.simulated_ms['e2e']:.2f} ms ({cal.error('e2e'):+.1%})"
        )
    assert abs(cal.error("e2e")) <= 0.10
    assert abs(cal.error("sharded")) <= 0.10
    # and the simulated pipeline is not the raw send: it pays for parts, packing and applying, as the machine did
    assert cal.simulated_ms["e2e"] > cal.measured_ms["raw"]
