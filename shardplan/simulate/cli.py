"""`shardplan simulate`: one sync of a shipped plan on a fleet you describe, next to its speed of light."""

from __future__ import annotations

import argparse

from shardplan.plan.file.format import PlanFile
from shardplan.plan.inspect import group_bytes
from shardplan.simulate import trainers, workload
from shardplan.simulate.fleet import Fleet, Links, SimulationError
from shardplan.simulate.run import extrapolate, simulate


def add_parser(sub) -> None:
    p = sub.add_parser(
        "simulate", help="simulate one sync on a fleet (sync time, speed of light, links, critical path); no GPU needed"
    )
    p.add_argument("plan", help="plan file of the inference layout (e.g. plans/kimi-k2--tp32-ep--bfloat16.plan)")
    p.add_argument("--replicas", type=int, default=1, help="inference engines of that layout (data parallel)")
    p.add_argument("--trainer-nodes", type=int, required=True)
    p.add_argument("--inference-nodes", type=int, required=True)
    p.add_argument("--gpus-per-node", type=int, default=8)
    t = p.add_argument_group("trainer layout")
    t.add_argument(
        "--trainer",
        choices=["megatron", "fsdp", "whole"],
        default="megatron",
        help="megatron: PP x TP x EP boxes; fsdp: every tensor split along dim 0 over all trainer GPUs; "
        "whole: every trainer GPU holds every tensor whole",
    )
    t.add_argument("--pp", type=int, default=1)
    t.add_argument("--tp", type=int, default=1)
    t.add_argument("--ep", type=int, default=1)
    t.add_argument("--stage-size", type=int, default=None, help="GPUs per pipeline stage (default max(tp, ep))")
    t.add_argument("--dp", type=int, default=1, help="replicas of the whole trainer layout")
    s = p.add_argument_group("what to simulate")
    s.add_argument(
        "--layers",
        default=None,
        help="decoder layers to simulate, e.g. 0-7 (default: all; a fleet's "
        "plan_shards costs ~1 s per layer per 32 consumers here)",
    )
    s.add_argument(
        "--extrapolate",
        action="store_true",
        help="with --layers 0-K: also simulate the first half of those layers and extrapolate both to the "
        "whole model (a straight line per layer)",
    )
    s.add_argument(
        "--group-order",
        choices=["engine", "rotated"],
        default="engine",
        help="rotated: a what-if the engine does not do (each consumer starts at a different layer)",
    )
    s.add_argument("--bytes-scale", type=float, default=1.0, help="multiply every byte (0.5: FP8 from a BF16 plan)")
    s.add_argument(
        "--rate-quantum-us", type=float, default=50.0, help="recompute shared link rates at most this often (0: exact)"
    )
    links = p.add_argument_group("links (defaults: H200 measured ceilings, 400 Gb/s NIC per GPU)")
    for name, help_text in [
        ("nvlink-GBps", "NVLink per GPU, each way"),
        ("nic-GBps", "NIC per GPU, each way"),
        ("nic-latency-us", "fixed cost per transfer between nodes"),
        ("pcie-GBps", "GPU<->NIC path"),
        ("pack-GBps", "trainer pack rate, packed bytes/s"),
        ("apply-GBps", "consumer apply rate"),
        ("post-us", "CPU cost of posting a send/recv"),
        ("overlap-slowdown", "link rate lost while a pack/apply runs on the GPU"),
    ]:
        links.add_argument(f"--{name}", type=float, default=None, help=help_text)


def _layers(text: str | None):
    if text is None:
        return None
    out: list[int] = []
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        out += list(range(int(lo), int(hi or lo) + 1))
    return out


def run(args: argparse.Namespace) -> int:
    link_args = {
        f.replace("-", "_"): getattr(args, f.replace("-", "_"))
        for f in (
            "nvlink-GBps",
            "nic-GBps",
            "nic-latency-us",
            "pcie-GBps",
            "pack-GBps",
            "apply-GBps",
            "post-us",
            "overlap-slowdown",
        )
    }
    links = Links(**{k: v for k, v in link_args.items() if v is not None})
    plan_file = PlanFile.read(args.plan)
    layers = _layers(args.layers)
    num_trainers = args.trainer_nodes * args.gpus_per_node
    if args.trainer == "whole":

        def build(keep):
            return workload.whole_tensors(plan_file, num_trainers=num_trainers, replicas=args.replicas, layers=keep)
    else:
        sources = dict(plan_file.sources)
        if args.trainer == "fsdp":
            shards, what = trainers.fsdp(sources, num_trainers), f"FSDP over {num_trainers} trainer GPUs"
        else:
            shards = trainers.megatron(
                sources,
                num_layers=workload.num_decoder_layers(plan_file),
                pp=args.pp,
                tp=args.tp,
                ep=args.ep,
                stage_size=args.stage_size,
                dp=args.dp,
            )
            what = f"Megatron-style trainers PP{args.pp} TP{args.tp} EP{args.ep} DP{args.dp}"

        def build(keep):
            return workload.sharded(plan_file, shards, replicas=args.replicas, layers=keep, description=what)

    fleet = Fleet.disaggregated(args.trainer_nodes, args.inference_nodes, args.gpus_per_node)

    def run_on(keep):
        return simulate(
            build(keep),
            fleet,
            links,
            bytes_scale=args.bytes_scale,
            rate_quantum_s=args.rate_quantum_us * 1e-6,
            group_order=args.group_order,
        )

    result = run_on(layers)
    print(result.format())
    if args.extrapolate:
        if not layers or len(layers) < 2:
            raise SimulationError("--extrapolate needs --layers with at least two decoder layers, e.g. --layers 0-7")
        half = run_on(layers[: len(layers) // 2])
        total, per_layer, fixed = extrapolate([half, result], result.workload.num_layers)
        per_gpu = max(sum(group_bytes(plan_file.body, r).values()) for r in plan_file.ranks)
        light = per_gpu * args.bytes_scale / (links.network_GBps * 1e9)
        print(
            f"extrapolated to all {result.workload.num_layers} decoder layers from {len(layers) // 2} and "
            f"{len(layers)}: {total:.3f} s ({per_layer * 1e3:.2f} ms per layer, {fixed * 1e3:+.2f} ms fixed); "
            f"the whole model's busiest consumer NIC: {light:.3f} s"
        )
    return 0
