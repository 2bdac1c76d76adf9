"""The fleet simulator: the coordinator's view equals the engine's Packers, the pipeline follows the engine's rules
(closed form for one group; slot reuse and two groups in flight for many), rates are max-min fair, named errors."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from blocked_imports import run_without_vllm

from shardplan import cli
from shardplan.plan.file.format import PlanFile
from shardplan.runtime.shards import plan_shards
from shardplan.simulate import (
    CoverageError,
    Fleet,
    FleetError,
    LinkParameterError,
    Links,
    UnreachableConsumerError,
    Workload,
    extrapolate,
    simulate,
    trainers,
    workload,
)
from shardplan.simulate.engine import max_min_rates
from shardplan.simulate.workload import restrict
from shardplan.sync import ReplayPacker, ShardedPacker, Span, build_schedule, spans_of

ROOT = Path(__file__).resolve().parents[2]
LLAMA_TP2 = ROOT / "plans" / "llama-3.1-8b--tp2--bfloat16.plan"


@pytest.fixture(scope="module")
def llama():
    return PlanFile.read(LLAMA_TP2)


def _nonempty(layouts):
    return {c: {g: segs for g, segs in lay.items() if segs} for c, lay in layouts.items()}


def _pieces(schedule):
    return {k: [(p.trainer, p.lo, p.hi) for p in v] for k, v in schedule.pieces.items()}


# ---- the coordinator's view is the engine's ---------------------------------------------------------------------
def test_whole_tensor_workload_is_replay_packers_layout(llama):
    part = 32 << 20  # small parts, so layers are split as the engine splits them
    work = workload.whole_tensors(llama, num_trainers=3, layers=[0, 1], part_bytes=part)
    # the simulator does not model direct sends (Span.direct: which messages leave staging), only who sends what
    plans = [restrict(llama.rank(r), [0, 1]) for r in llama.ranks]
    packer = ReplayPacker(plans, llama.sources, max_group_bytes=part, direct_bytes=None)
    assert work.groups == tuple(packer.groups())
    assert _nonempty(work.layouts) == _nonempty(spans_of(packer))
    assert any("/" in g for g in work.groups)


def test_sharded_workload_schedules_the_same_pieces_as_sharded_packer(llama):
    """Merging a trainer's consecutive pinned segments changes nothing the schedule builder decides."""
    layers = [0, 1]
    sources = dict(llama.sources)
    shards = trainers.megatron(sources, num_layers=32, pp=2, tp=2)
    work = workload.sharded(llama, shards, replicas=2, layers=layers)
    plans = [restrict(llama.rank(r), layers, rank=c) for c, r in sorted(work.plan_rank.items())]
    needed = set().union(*(p.sources_read() for p in plans))
    sharded_plan = plan_shards(plans, {n: sources[n] for n in sorted(needed)}, shards)
    packer = ShardedPacker(sharded_plan, 0)
    real = build_schedule(
        spans_of(packer), packer.groups(), {t: frozenset() for t in work.trainers}, work.trainers, work.consumers
    )
    ours = work.schedule()
    assert ours.groups == real.groups
    assert _pieces(ours) == _pieces(real)
    assert sum(len(s) for lay in work.layouts.values() for s in lay.values()) < sum(
        len(s) for lay in spans_of(packer).values() for s in lay.values()
    )


# ---- the pipeline --------------------------------------------------------------------------------------------
def _synthetic(num_groups: int, nbytes: int, num_consumers: int = 1) -> Workload:
    groups = tuple(f"layers.{i}" for i in range(num_groups))
    layouts = {c: {g: (Span(0, nbytes, (f"{g}.w",)),) for g in groups} for c in range(num_consumers)}
    return Workload(groups, layouts, (0,), {0: None}, {c: c for c in range(num_consumers)}, "synthetic")


def test_block_fp8_plans_are_simulated_from_bf16_trainers_quantizing_their_own_boxes():
    """A Kimi-K2 FP8 TP8+EP plan from Megatron-style TP8 x EP8 trainers (whole 128-blocks): the spans are
    ShardedPacker's of the quantizing sharded plan (trainers hold no scales); FSDP over 8 ranks cuts
    kv_a_proj_with_mqa's 576 rows into 72-row boxes (its holders exchange block amaxes) and is simulated: its spans
    are ShardedPacker's too, pinned to all 8 trainers."""
    plan_file = PlanFile.read(ROOT / "plans" / "kimi-k2-fp8--tp8-ep--bfloat16.plan")
    sources = dict(plan_file.sources)
    shards = trainers.megatron(sources, num_layers=workload.num_decoder_layers(plan_file), tp=8, ep=8)
    assert any(s.name.endswith("_scale_inv") for s in shards)  # the layout covers every source; scales are dropped
    work = workload.sharded(plan_file, shards, ranks=[0], layers=[3])
    plans = [restrict(plan_file.rank(0), (3,))]
    needed = {n: sources[n] for n in sorted(set().union(*(p.sources_read() for p in plans)))}
    held = [s for s in shards if not s.name.endswith("_scale_inv")]
    packer = ShardedPacker(plan_shards(plans, needed, held, quantizer=plan_file.header.quantizer), 0)
    real = build_schedule(
        spans_of(packer), packer.groups(), {t: frozenset() for t in work.trainers}, work.trainers, work.consumers
    )
    assert _pieces(work.schedule()) == _pieces(real)
    assert len({s.only for lay in work.layouts.values() for spans in lay.values() for s in spans}) == 8
    fsdp = [s for s in trainers.fsdp(sources, 8) if not s.name.endswith("_scale_inv")]
    cut = workload.sharded(plan_file, fsdp, ranks=[0], layers=[3], description="FSDP")
    packer = ShardedPacker(plan_shards(plans, needed, fsdp, quantizer=plan_file.header.quantizer), 0)
    kv_a = "model.layers.3.self_attn.kv_a_proj_with_mqa.weight"
    assert [packer.sharded.cut[r][kv_a].held[0] for r in range(8)] == [(72 * r, 72 * r + 72) for r in range(8)]
    real = build_schedule(
        spans_of(packer), packer.groups(), {t: frozenset() for t in cut.trainers}, cut.trainers, cut.consumers
    )
    assert _pieces(cut.schedule()) == _pieces(real)
    assert len({s.only for lay in cut.layouts.values() for spans in lay.values() for s in spans}) == 8


def test_one_group_takes_the_closed_form_time():
    n = 10 << 20
    links = Links(
        nic_GBps=40.0,
        pcie_GBps=55.0,
        nic_latency_us=7.0,
        pack_GBps=100.0,
        apply_GBps=80.0,
        post_us=50.0,
        launch_us=20.0,
        poll_us=25.0,
        start_us=100.0,
        finish_us=60.0,
    )
    result = simulate(_synthetic(1, n), Fleet.disaggregated(1, 1, 1), links, rate_quantum_s=0.0)
    us = 1e-6
    t0 = 100 * us
    send_ready = max(t0 + 20 * us + 50 * us, t0 + 20 * us + n / 100e9)  # posted after the pack's launch; pack done
    recv_ready = t0 + 50 * us
    arrived = max(send_ready, recv_ready) + 7 * us + n / 40e9
    noticed = arrived + 25 * us
    expected = max(noticed + 20 * us + n / 80e9, noticed + 20 * us + 60 * us)
    assert result.seconds == pytest.approx(expected, rel=1e-9)
    assert result.speed_of_light.network_s == pytest.approx(n / 40e9)


def test_slots_are_reused_only_after_apply_and_two_groups_in_flight():
    links = Links(nic_GBps=50.0, pack_GBps=5.0, apply_GBps=2.0)  # slow kernels, so the rules bind
    result = simulate(_synthetic(6, 8 << 20), Fleet.disaggregated(1, 1, 1), links, rate_quantum_s=0.0)
    by = {(a.kind, a.group): a for a in result.activities if a.kind in ("pack", "transfer", "apply")}
    for g in range(2, 6):
        assert by[("transfer", g)].start >= by[("apply", g - 2)].end - 1e-12  # receive slot freed by the apply
        assert by[("pack", g)].start >= by[("transfer", g - 2)].end - 1e-12  # staging slot freed by the send
        assert by[("apply", g)].start >= by[("transfer", g)].end - 1e-12
    assert result.seconds > result.speed_of_light.seconds
    kinds = result.critical_breakdown()
    assert sum(kinds.values()) == pytest.approx(result.seconds, rel=1e-6)
    assert kinds.get("apply", 0) > 0  # slow applies are on the critical path


def test_max_min_fair_rates():
    caps = np.array([10.0, 10.0, 4.0])
    rates = max_min_rates(np.array([0, 0]), np.array([1, 2]), caps)
    assert rates.tolist() == pytest.approx([6.0, 4.0])  # the flow capped elsewhere leaves its share to the other
    rates = max_min_rates(np.array([0, 0, 0]), np.array([1, 1, 1]), caps)
    assert rates.tolist() == pytest.approx([10 / 3] * 3)


def test_fleet_run_on_a_real_plan_is_at_or_above_its_speed_of_light(llama):
    shards = trainers.megatron(dict(llama.sources), num_layers=32, tp=2)
    work = workload.sharded(llama, shards, replicas=2, layers=range(4))
    result = simulate(work, Fleet.disaggregated(1, 1, 4), Links())
    sol = result.speed_of_light
    assert result.seconds >= sol.seconds
    assert result.seconds < 2 * sol.seconds
    assert sol.consumer_s <= sol.balanced_s <= sol.network_s + 1e-12
    assert "speed of light" in result.format()
    bigger = simulate(workload.sharded(llama, shards, replicas=2, layers=range(8)), Fleet.disaggregated(1, 1, 4))
    total, per_layer, _ = extrapolate([result, bigger], 32)
    assert per_layer > 0 and total > bigger.seconds


def test_pipeline_parallel_trainers_serve_one_stage_at_a_time_unless_consumers_rotate(llama):
    """The engine takes groups in layer order, so PP stages send one after the other; the rotated what-if spreads
    consumers over the stages and gets close to the speed of light."""
    shards = trainers.megatron(dict(llama.sources), num_layers=32, pp=2, tp=2)
    work = workload.sharded(llama, shards, replicas=2, layers=range(32))
    fleet = Fleet.disaggregated(1, 1, 4)
    engine = simulate(work, fleet)
    rotated = simulate(work, fleet, group_order="rotated")
    assert engine.seconds > 1.6 * engine.speed_of_light.seconds
    assert rotated.seconds < 1.2 * rotated.speed_of_light.seconds
    assert rotated.speed_of_light.seconds == pytest.approx(engine.speed_of_light.seconds)


# ---- bad input ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("field", ["nvlink_GBps", "nic_GBps", "pcie_GBps", "pack_GBps", "apply_GBps"])
@pytest.mark.parametrize("value", [0.0, -1.0])
def test_bandwidth_of_zero_or_less_is_named(field, value):
    with pytest.raises(LinkParameterError, match=field):
        Links(**{field: value})


@pytest.mark.parametrize("field", ["nic_latency_us", "nvlink_latency_us", "post_us", "poll_us", "start_us"])
def test_negative_fixed_cost_is_named(field):
    with pytest.raises(LinkParameterError, match=field):
        Links(**{field: -1.0})


def test_overlap_slowdown_out_of_range_is_named():
    with pytest.raises(LinkParameterError, match="overlap_slowdown"):
        Links(overlap_slowdown=1.0)


def test_trainer_layout_missing_a_tensor_is_named(llama):
    sources = dict(llama.sources)
    victim = "model.layers.1.mlp.down_proj.weight"
    shards = [s for s in trainers.megatron(sources, num_layers=32, tp=2) if s.name != victim]
    with pytest.raises(CoverageError, match=victim.replace(".", r"\.")):
        workload.sharded(llama, shards, layers=[1])


def test_whole_tensor_trainers_missing_a_tensor_is_named(llama):
    work = workload.whole_tensors(llama, num_trainers=1, layers=[0], held={0: frozenset()})
    with pytest.raises(CoverageError, match="no live trainer holds"):
        simulate(work, Fleet.disaggregated(1, 1, 2))


def test_consumer_without_a_network_path_is_named(llama):
    work = workload.whole_tensors(llama, num_trainers=2, layers=[0])
    with pytest.raises(UnreachableConsumerError, match="consumer rank 0 .*no network"):
        simulate(work, Fleet.disaggregated(1, 1, 2), Links(nic_GBps=None))
    # the same on one node (trainers GPUs 0-1, consumers 2-3) goes over NVLink
    same_node = Fleet(((0, 0), (0, 1)), ((0, 2), (0, 3)), 4)
    assert simulate(work, same_node, Links(nic_GBps=None)).seconds > 0


def test_consumer_without_a_gpu_is_named(llama):
    work = workload.whole_tensors(llama, num_trainers=1, layers=[0])
    with pytest.raises(UnreachableConsumerError, match=r"consumer ranks \[1\] have no GPU"):
        simulate(work, Fleet.disaggregated(1, 1, 1))


def test_trainer_layout_larger_than_the_fleet_is_named(llama):
    shards = trainers.megatron(dict(llama.sources), num_layers=32, tp=4)
    work = workload.sharded(llama, shards, layers=[0])
    with pytest.raises(FleetError, match="4 ranks"):
        simulate(work, Fleet.disaggregated(1, 1, 2))


def test_fleet_refuses_two_ranks_on_one_gpu():
    with pytest.raises(FleetError, match="one rank per GPU"):
        Fleet(((0, 0),), ((0, 0),), 1)


@pytest.mark.slow  # subprocesses / whole shipped plans: `make test`, not `make test-fast`
def test_simulator_imports_no_vllm_transformers_safetensors():
    out = run_without_vllm(f"""
        from shardplan.plan.file.format import PlanFile
        from shardplan.simulate import Fleet, simulate, workload
        work = workload.whole_tensors(PlanFile.read({str(LLAMA_TP2)!r}), layers=[0])
        print('ok', simulate(work, Fleet.disaggregated(1, 1, 2)).seconds > 0)
    """)
    assert out.strip() == "ok True"


# ---- the CLI ----------------------------------------------------------------------------------------------------
def test_cli_simulate(capsys):
    args = [
        "simulate",
        str(LLAMA_TP2),
        "--trainer-nodes",
        "1",
        "--inference-nodes",
        "1",
        "--gpus-per-node",
        "2",
        "--tp",
        "2",
        "--layers",
        "0-3",
    ]
    assert cli.main(args) == 0
    out = capsys.readouterr().out
    assert "sync time" in out and "speed of light" in out and "critical path" in out
    assert cli.main(args + ["--extrapolate"]) == 0
    assert "extrapolated to all 32 decoder layers from 2 and 4" in capsys.readouterr().out
    assert cli.main(args + ["--nic-GBps", "0"]) == 2
    assert "nic_GBps must be > 0" in capsys.readouterr().err
