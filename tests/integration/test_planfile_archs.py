"""Every architecture the recorder supports, recorded at TP2 (and TP2+EP for MoE), goes through the format-2 writer and
reader: the strict reader accepts every real recording (Calls, in-place updates, constants, ordered writes, fallbacks)
and gives back exactly the recorded plan. Sessions and plans are shared with test_record_archs when both run
(arch_sessions.py)."""

from __future__ import annotations

import arch_sessions
import pytest
from reference import canonical

from shardplan.plan.compile.compiler import compile_plans
from shardplan.plan.file.format import PlanFile, decode
from shardplan.plan.layout import Layout

CASES = [(arch, Layout(tp=2)) for arch in arch_sessions.ALL_ARCHS] + [
    (arch, Layout(tp=2, ep=True)) for arch in arch_sessions.ALL_ARCHS if arch_sessions.arch_experts(arch)
]


@pytest.mark.parametrize("arch, layout", CASES, ids=[f"{a}-{lay.tag()}" for a, lay in CASES])
def test_real_recordings_pass_the_strict_reader(arch, layout, arch_root):
    model, overrides = arch_sessions.arch_spec(arch, "bfloat16", arch_root)
    session = arch_sessions.get_session(model, overrides, layout, "bfloat16")
    assert session is not None, f"vLLM rejects {layout.tag()} for {arch}"
    key = (model, overrides, layout, "bfloat16")
    plans = [arch_sessions.get_plan(session, key, rank)[0] for rank in range(layout.world_size)]
    plan_file = PlanFile(*decode(session.encode(compile_plans(plans, session.sources)), arch))
    for plan in plans:
        got, want = plan_file.rank(plan.rank), canonical(plan)
        # by repr: a NaN constant (unwritten memory of a param created while loading, Phi's lm_head.bias) decodes as a
        # new float object, and nan != nan, while its repr is exact
        assert [repr(w) for w in got.writes] == [repr(w) for w in want.writes]
        assert got.params == want.params and got.fallbacks == want.fallbacks
