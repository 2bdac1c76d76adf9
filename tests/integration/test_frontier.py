"""The frontier built-ins (docs/configs.md): Kimi-Linear's interleaved layer classes (KDA, KDA, KDA, MLA) sample
to the same plan as recording every layer, byte for byte (members of a class between the sampled layers used to be
written twice), and its shrunk built-in verifies bitwise against vLLM's loader at its published TP 4."""

from __future__ import annotations

import pytest

from shardplan.plan.layout import Layout
from shardplan.record.session import RecordSession
from shardplan.record.verify import random_checkpoint, verify_rank

KIMI_LINEAR_12 = [
    "num_hidden_layers=12",
    "linear_attn_config.kda_layers=[1,2,3,5,6,7,9,10,11]",
    "linear_attn_config.full_attn_layers=[4,8,12]",
    "num_experts=8",
]


def test_kimi_linear_sampled_equals_exhaustive_byte_for_byte():
    session = RecordSession("kimi-linear-48b-a3b", Layout(tp=2), overrides=KIMI_LINEAR_12)
    sampled = session.record_plans([0, 1])
    assert sampled.how.startswith("sampled"), sampled.how
    exhaustive = session.record_plans([0, 1], exhaustive=True)
    assert session.encode(sampled.body) == session.encode(exhaustive.body)
    assert all(s.num_not_needed >= 0 for s in sampled.stats)


SHRUNK = {
    "kimi-linear-48b-a3b": [
        "num_hidden_layers=4",
        "linear_attn_config.kda_layers=[1,2,3]",
        "linear_attn_config.full_attn_layers=[4]",
        "num_experts=8",
    ],
    "minimax-m2": ["num_hidden_layers=2", "attn_type_list=[1,1]", "num_local_experts=8"],
}


@pytest.mark.parametrize("model, tp, ep", [("kimi-linear-48b-a3b", 4, False), ("minimax-m2", 2, True)])
def test_shrunk_frontier_builtins_verify_bitwise(model, tp, ep):
    layout = Layout(tp=tp, ep=ep)
    session = RecordSession(model, layout, overrides=SHRUNK[model])
    checkpoint = random_checkpoint(session.tensors, 0)
    for rank in range(tp):
        plan, _ = session.record_rank(rank)
        assert verify_rank(session.vllm_config, layout, rank, plan, checkpoint).ok
