"""record -> plan file -> replay -> pack -> apply == vLLM's real load_weights, bitwise, for random models, consumer
layouts (TP, EP) and trainer layouts (full tensors, or TP/EP/PP shards), destinations poisoned with NaN first."""

from __future__ import annotations

import functools
import os

import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from tiny_models import TINY

from shardplan.plan.compile.compiler import compile_plans
from shardplan.plan.file.format import PlanFile, decode, encode
from shardplan.plan.layout import Layout
from shardplan.plan.names import expert_of
from shardplan.record.build import build_model, loading_context
from shardplan.record.verify import RankVerdict, compare_models, poison, random_checkpoint
from shardplan.runtime.apply import Applier
from shardplan.runtime.replay import Replayer
from shardplan.runtime.shards import compose, ep_shards, layer_stage, local_tensors, plan_shards, pp_shards, tp_shards

MODELS = TINY


@functools.cache
def _plan_file(model: str, tp: int, ep: bool):
    from shardplan.record.session import RecordSession

    session = RecordSession(model, Layout(tp=tp, ep=ep), overrides=MODELS[model])
    plans = [session.record_rank(r)[0] for r in range(tp)]
    data = encode(
        compile_plans(plans, session.sources),
        model=model,
        architecture=session.spec.architecture,
        config_sha256=session.spec.config_sha256,
        layout=session.layout,
        dtype="bfloat16",
        vllm_version=session.vllm_version,
    )
    return session, PlanFile(*decode(data))


def _trainer_shards(kind: str, sources, num_layers: int, num_experts: int):
    def split_dim(name):
        meta = sources[name]
        return 0 if len(meta.shape) == 2 and meta.shape[0] % 2 == 0 else None

    tp2 = tp_shards(sources, 2, split_dim)
    if kind == "tp2":
        return tp2
    if kind == "ep2":
        return ep_shards(sources, 2, expert_of, num_experts)
    if kind == "pp2xtp2":
        return compose(pp_shards(sources, 2, layer_stage(num_layers, 2)), tp2, 2)
    raise ValueError(kind)


@settings(
    max_examples=int(os.environ.get("SHARDPLAN_E2E_EXAMPLES", "8")),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(
    model=st.sampled_from(sorted(MODELS)),
    tp=st.sampled_from([1, 2, 4]),
    ep=st.booleans(),
    trainer=st.sampled_from(["full", "tp2", "ep2", "pp2xtp2"]),
    data=st.data(),
)
def test_pack_apply_equals_real_loader(model, tp, ep, trainer, data):
    assume(not (ep and model == "llama-3.1-8b"))
    session, plan_file = _plan_file(model, tp, ep)
    rank = data.draw(st.integers(0, tp - 1), label="rank")
    plan = plan_file.rank(rank)
    checkpoint = random_checkpoint(session.tensors, data.draw(st.integers(0, 2**16), label="seed"))

    real = build_model(session.vllm_config, session.layout, rank, "cpu")
    poison(real)
    with torch.no_grad(), loading_context(session.vllm_config, session.layout, rank):
        real.load_weights(iter(list(checkpoint.items())))

    replayed = build_model(session.vllm_config, session.layout, rank, "cpu")
    poison(replayed)
    params = dict(replayed.named_parameters())
    params.update(dict(replayed.named_buffers()))
    with torch.no_grad():
        if trainer == "full":
            replayer = Replayer(plan, plan_file.sources)
            Applier(plan, replayer.layout, params).apply(replayer.pack(checkpoint))
        else:
            sources = {n: plan_file.sources[n] for n in checkpoint}
            num_layers = session.spec.config["num_hidden_layers"]
            num_experts = session.spec.config.get("n_routed_experts") or session.spec.config.get("num_experts") or 1
            shards = _trainer_shards(trainer, sources, num_layers, num_experts)
            sharded = plan_shards(plan, sources, shards)
            for t in sharded.trainer_ranks:
                replayer = Replayer(sharded.for_trainer(t), sharded.sources[t])
                buffer = replayer.pack(local_tensors(shards, t, checkpoint))
                for (tt, _), sub in sharded.plans.items():
                    if tt == t:
                        Applier(sub, replayer.layout, params).apply(buffer)
    verdict = RankVerdict(rank)
    compare_models(real, replayed, verdict)
    assert verdict.ok, verdict.mismatched
    for meta in plan.params:  # every element the plan covers was written
        assert not torch.isnan(params[meta.name].float()).any(), meta.name
