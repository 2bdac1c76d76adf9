"""One weight update of a live vLLM CPU engine: through shardplan next to vLLM's own way, same engine, same run.

    python bench/engine_bench.py                                  # tiny Qwen3 TP1, tiny Qwen3-MoE TP2
    python bench/engine_bench.py --cases qwen3-30b-a3b --layers 2 # Qwen3-30B-A3B cut to 2 layers, TP2 (~3.6 GB bf16)
    ... --override num_experts=64                                 # cut further (fewer experts) for a small box

shardplan: `EngineSync.sync` with the trainer in this process (ModuleSource over the new checkpoint's tensors):
pause, announce, start, per group pack -> gloo (the `nccl` adapter on CPU) -> apply into the pre-processing params
-> process, finish, resume. Only this rank's bytes travel.
vLLM's own: its `nccl` backend needs CUDA (PyNccl), so on CPU the same engine runs `reload_weights(weights_path=...)`:
layerwise reload + `load_weights` of every full checkpoint tensor, read by every worker from the (page-cached)
safetensors file. That is what its nccl/ipc backends do after the transfer, without the transfer.
Ceiling of the transport, same run: the same per-worker byte counts sent from this process to one process per worker
over gloo TCP on 127.0.0.1, all at once, one message each (its receivers start before the engine; one round is timed
before each shardplan update). Neither's first round is timed: the gloo ceiling's opens its connections, the engine's
first update opens its pairs and sizes the workers' materialize pool.

Both update the same engine from checkpoint A to checkpoint B (random bf16 weights); the greedy tokens after each
way are printed side by side (equal for the dense model; for the MoE model vLLM 0.32's own reload skips the CPU
experts' prepack, docs/engine.md, so its tokens differ; MoE cases also time a shardplan sync without the prepack
re-run, the same work as vLLM's reload, whose tokens must then equal vLLM's: --skip-prepack). Median of --iters
updates each, alternating (gloo round, shardplan sync, vLLM reload), with the load average at each iteration.

Per engine rank, the split of one shardplan update (the worker's own clocks, shardplan.engine.reload): trainer pack
(this process, per consumer lane), receive + verify (the rest of the update: waiting for bytes, checksums), start
(layerwise reload set up), materialize, apply (bytes from the receive buffer into the pre-processing params; bytes
received straight into them, printed per rank, skip it), process (vLLM's
process_weights_after_loading, per module class below the table), MoE prepack (the re-run vLLM 0.32 skips), copy
into kernel tensors, finalize, readers (modules sharing storage with written params); and the worker's RSS before
the update and its peak during it (VmHWM, reset at start), next to one decoder layer's bytes on that rank.

CPU account, per sync and per gloo-alone round: each process's CPU seconds (user + sys, every thread: this process's
os.times(), the others' /proc/<pid>/stat), the trainer's pack and checksum CPU (its lane threads), each worker's CPU in
vLLM's processing (process + MoE prepack + copies into kernel tensors, the worker's main thread); and the floor,
(the gloo send's CPU s + vLLM's processing) / cores, beside the wall time and the 1.3x bar.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
# the CPU engine recipe the live-engine tests use (a test tool, not part of the package)
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "integration"))

from cpu_engine import (  # noqa: E402
    greedy_tokens,
    set_cpu_env,
    start_cpu_llm,
    stop_cpu_llm,
    tiny_qwen3_config,
)

set_cpu_env()

PROMPTS = [[5, 17, 99, 300, 7], [42, 43, 44]]


def case_config(name: str, layers: int, overrides: list[str] = ()) -> tuple[dict, int]:
    if name == "tiny-dense":
        return tiny_qwen3_config(moe=False), 1
    if name == "tiny-moe":
        return tiny_qwen3_config(moe=True), 2
    if name == "qwen3-30b-a3b":
        from shardplan.models import resolve_model

        cfg = dict(resolve_model("qwen3-30b-a3b", [f"num_hidden_layers={layers}", *overrides]).config)
        cfg["max_position_embeddings"] = 2048
        return cfg, 2
    raise SystemExit(f"unknown case {name!r}: tiny-dense, tiny-moe, qwen3-30b-a3b")


def write_checkpoints(root: Path, cfg: dict, tp: int):
    """Checkpoints A (the engine starts from it) and B (the update), and the plan recorded for A's config."""
    from safetensors.torch import save_file

    from shardplan.plan.file.format import write_plan
    from shardplan.plan.layout import Layout
    from shardplan.record.session import RecordSession

    dirs = [root / "A", root / "B"]
    for d in dirs:
        d.mkdir(parents=True)
        (d / "config.json").write_text(json.dumps(cfg, indent=1))
    session = RecordSession(str(dirs[0]), Layout(tp=tp))
    tensors_b = None
    for seed, d in enumerate(dirs, 1):
        g = torch.Generator().manual_seed(seed)
        tensors = {}
        for name, shape, _ in session.tensors:
            t = torch.randn(shape, generator=g)
            tensors[name] = (1 + 0.1 * t if name.endswith("norm.weight") else 0.02 * t).to(torch.bfloat16)
        save_file(tensors, str(d / "model.safetensors"), metadata={"format": "pt"})
        tensors_b = tensors
    plan = root / "model.plan"
    write_plan(plan, session.encode(session.record_plans(range(tp)).body))
    return dirs, tensors_b, plan


def _gloo_receiver(port: int, pair: int, nbytes: int, rounds: int) -> None:
    """One receiving process of the transport ceiling: `rounds` times, `nbytes` from the bench process over gloo."""
    from datetime import timedelta

    import torch.distributed as dist

    store = dist.PrefixStore(f"pair{pair}", dist.TCPStore("127.0.0.1", port, is_master=False))
    pg = dist.ProcessGroupGloo(store, 1, 2, timedelta(seconds=600))
    buf = torch.empty(nbytes, dtype=torch.uint8)
    for _ in range(rounds):
        pg.recv([buf], 0, 0).wait()
    time.sleep(5)  # alive while the bench reads its CPU seconds after the last round


class GlooCeiling:
    """The transport alone, same run: the bench process sends each engine worker's byte count to its own process
    over gloo TCP on 127.0.0.1 (what the `nccl` adapter runs on CPU), all peers at once, one message each. Started
    before the engine; `send()` is one round (timed between the engine's updates); the first (connection set-up)
    round is not timed."""

    def __init__(self, nbytes_per_peer: list[int], iters: int):
        import multiprocessing as mp
        from datetime import timedelta

        import torch.distributed as dist

        self.server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        ctx = mp.get_context("spawn")
        self.procs = [
            ctx.Process(target=_gloo_receiver, args=(self.server.port, i, n, iters + 1), daemon=True)
            for i, n in enumerate(nbytes_per_peer)
        ]
        for p in self.procs:
            p.start()
        self.groups = [
            dist.ProcessGroupGloo(dist.PrefixStore(f"pair{i}", self.server), 0, 2, timedelta(seconds=600))
            for i in range(len(self.procs))
        ]
        whole = torch.ones(max(nbytes_per_peer), dtype=torch.uint8)  # one buffer, read by every peer's send
        self.bufs = [whole[:n] for n in nbytes_per_peer]
        self.cpu: list[dict[str, float]] = []  # CPU seconds per process, per timed round
        self._send()

    def send(self) -> float:

        with CpuClock({f"receiver {i}": p.pid for i, p in enumerate(self.procs)}) as clock:
            seconds = self._send()
        self.cpu.append(clock.seconds)
        return seconds

    def _send(self) -> float:
        import threading

        t = time.perf_counter()
        threads = [
            threading.Thread(target=lambda g=g, b=b: g.send([b], 1, 0).wait()) for g, b in zip(self.groups, self.bufs)
        ]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        return time.perf_counter() - t

    def close(self) -> None:
        for p in self.procs:
            p.join(60)
        self.bufs = []


def proc_cpu_s(pid: int) -> float:
    """CPU seconds (user + sys, every thread) the process `pid` has used so far (/proc/<pid>/stat)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    except OSError:
        return float("nan")
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime


def parent_pid(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[1])


class CpuClock:
    """CPU seconds per process over one timed step: this (trainer) process, and other processes by pid."""

    def __init__(self, pids: dict[str, int]):
        self.pids = pids

    def __enter__(self):
        t = os.times()
        self.start = {"trainer (bench process)": t.user + t.system, **{k: proc_cpu_s(p) for k, p in self.pids.items()}}
        return self

    def __exit__(self, *exc):
        t = os.times()
        end = {"trainer (bench process)": t.user + t.system, **{k: proc_cpu_s(p) for k, p in self.pids.items()}}
        self.seconds = {k: end[k] - self.start[k] for k in end}


VLLM_STEPS = ("process", "moe prepack", "copy into kernel tensors")  # vLLM's processing, per worker
ENGINE_STEPS = (
    "start",
    "materialize",
    "apply",
    "process",
    "moe prepack",
    "copy into kernel tensors",
    "finalize",
    "readers",
)


def parse_variant(text: str) -> tuple[str, dict]:
    """--variant KEY=VALUE[,KEY=VALUE]: a shardplan sync with these EngineUpdateInfo fields (true/false, numbers)."""
    options = {}
    for item in text.split(","):
        key, _, value = item.partition("=")
        options[key.strip()] = {"true": True, "false": False}.get(value.strip().lower(), value.strip())
    return text, options


def run_case(
    name: str,
    layers: int,
    iters: int,
    overrides: list[str] = (),
    skip_prepack: bool = False,
    variants: list[str] = (),
) -> dict:
    root = Path(tempfile.mkdtemp(prefix=f"engine-bench-{name}-"))
    try:  # two checkpoints of the case (~5 GB for the cut Qwen3-30B-A3B): never left behind
        return _run_case(root, name, layers, iters, overrides, skip_prepack, variants)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _run_case(root: Path, name, layers, iters, overrides, skip_prepack, variants) -> dict:
    from shardplan.engine.trainer import EngineSync, ModuleSource
    from shardplan.sync import SyncConfig

    cfg, tp = case_config(name, layers, overrides)
    t0 = time.perf_counter()
    (a, b), tensors_b, plan = write_checkpoints(root, cfg, tp)
    setup_s = time.perf_counter() - t0
    if name == "qwen3-30b-a3b":  # give the generator's and save_file's copies back before the engine loads
        import ctypes

        from safetensors.torch import load_file

        del tensors_b
        gc.collect()
        ctypes.CDLL("libc.so.6").malloc_trim(0)
        tensors_b = load_file(str(b / "model.safetensors"))
    from shardplan.plan.file.format import PlanFile
    from shardplan.runtime.pack import PackLayout

    plan_file = PlanFile.read(plan)
    layouts = [PackLayout.from_plans(plan_file.rank(r)) for r in range(tp)]
    per_peer = [lay.nbytes for lay in layouts]
    layer_bytes = [max(g.nbytes for g in lay.groups) for lay in layouts]  # one decoder layer of each rank
    ceiling = GlooCeiling(per_peer, iters)
    llm = start_cpu_llm(a, tp)

    def tokens():
        return greedy_tokens(llm, PROMPTS, 12)  # noqa: F821 (last called before `del llm`)

    sync = EngineSync([llm], plan, config=SyncConfig(timeout_s=120))
    trainer = sync.trainer_rank(ModuleSource(tensors_b, sync.plan_file))
    pack_s: dict[int, float] = {}
    pack = trainer.packer.pack

    trainer_cpu: dict[str, float] = {}  # this sync's trainer CPU seconds in its pack and its checksums (lane threads)

    def timed_pack(consumer, *args, **kwargs):  # the trainer's pack, per consumer lane (lanes run in threads)
        t, c = time.perf_counter(), time.thread_time()
        pack(consumer, *args, **kwargs)
        pack_s[consumer] = pack_s.get(consumer, 0.0) + time.perf_counter() - t
        trainer_cpu["pack"] = trainer_cpu.get("pack", 0.0) + time.thread_time() - c

    import shardplan.sync.trainer as trainer_module

    checksum = trainer_module.checksum_tensor

    def timed_checksum(view):
        c = time.thread_time()
        out = checksum(view)
        trainer_cpu["checksums"] = trainer_cpu.get("checksums", 0.0) + time.thread_time() - c
        return out

    trainer_module.checksum_tensor = timed_checksum

    trainer.packer.pack = timed_pack
    sync.init()  # once per engine: not part of an update
    # untimed, as the gloo ceiling's first round: opens the gloo pairs and sizes the engine's materialize pool
    warm = sync.sync(trainer=trainer)
    worker_pids = {f"worker {w['rank']}": w["last_update"]["pid"] for w in warm.engines[0].workers}
    engine_pids = {"engine core": parent_pid(next(iter(worker_pids.values()))), **worker_pids}
    engine_pids = {k: p for k, p in engine_pids.items() if p != os.getpid()}  # in-process engine core: the trainer's
    nbytes = sum(per_peer)
    full_bytes = sum(t.numel() * t.element_size() for t in tensors_b.values())
    moe = "num_experts" in cfg
    kinds = {"shardplan": {}, **dict(parse_variant(v) for v in variants)}
    runs = {"vllm": [], "gloo": [], "shardplan_skip_prepack": [], **{k: [] for k in kinds}}
    splits = {k: [] for k in kinds}
    packs = {k: [] for k in kinds}
    cpus = {k: [] for k in kinds}  # CPU seconds per process, per sync
    loads, phases = [], []
    tokens_by_kind = {}
    tokens_vllm = tokens_skip = None
    for i in range(iters):
        loads.append(os.getloadavg()[0])
        runs["gloo"].append(ceiling.send())
        order = list(kinds) if i % 2 == 0 else list(reversed(kinds))  # alternating: neither always goes first
        for kind in order:
            pack_s.clear()
            trainer_cpu.clear()
            options = dict(kinds[kind])
            if options.pop("direct_sends", True) is False:  # the trainer packs every segment into staging
                trainer.packer.direct_view = lambda *args: None
            with CpuClock(engine_pids) as clock:
                report = sync.sync(trainer=trainer, update_options=options or None)
            cpus[kind].append({**clock.seconds, **{f"trainer: {k}": v for k, v in trainer_cpu.items()}})
            trainer.packer.__dict__.pop("direct_view", None)
            runs[kind].append(report.seconds)
            if kind == "shardplan":
                phases.append(dict(report.phases))
            splits[kind].append([w["last_update"] for w in report.engines[0].workers])
            packs[kind].append(dict(pack_s))
            tokens_by_kind[kind] = tokens()
        if moe and skip_prepack:
            runs["shardplan_skip_prepack"].append(
                sync.sync(trainer=trainer, update_options={"rerun_moe_prepack": False}).seconds
            )
            tokens_skip = tokens()
        t = time.perf_counter()
        llm.collective_rpc("reload_weights", kwargs={"weights_path": str(b)})
        llm.reset_prefix_cache()
        runs["vllm"].append(time.perf_counter() - t)
        tokens_vllm = tokens()
    trainer.close()
    ceiling.close()
    stop_cpu_llm(llm)
    del llm
    gc.collect()
    med = statistics.median

    def per_rank(kind: str) -> list[dict]:
        ranks = []
        for r in range(tp):
            kind_splits = splits[kind]
            steps = {k: med(s[r]["seconds"].get(k, 0.0) for s in kind_splits) for k in (*ENGINE_STEPS, "update")}
            steps["receive + verify"] = steps["update"] - sum(steps[k] for k in ENGINE_STEPS if k != "start")
            by_class = {
                k: med(s[r].get("process_by_class", {}).get(k, 0.0) for s in kind_splits)
                for k in kind_splits[0][r].get("process_by_class", {})
            }
            cpu = {
                k: med(s[r].get("cpu_seconds", {}).get(k, 0.0) for s in kind_splits)
                for k in ("process", "moe prepack", "copy into kernel tensors", "update")
            }
            ranks.append(
                dict(
                    rank=r,
                    cpu_seconds=cpu,
                    trainer_pack_s=med(p.get(r, 0.0) for p in packs[kind]),
                    seconds=steps,
                    process_by_class=by_class,
                    rss_before=med(s[r]["rss_before"] or 0 for s in kind_splits),
                    rss_peak=med(s[r]["rss_peak"] or 0 for s in kind_splits),
                    pools=[s[r].get("pools_allocated") for s in kind_splits],
                    in_place_bytes=med(s[r].get("in_place_bytes", 0) for s in kind_splits),
                    layer_bytes=layer_bytes[r],
                )
            )
        return ranks

    def cpu_account(kind: str) -> dict:
        """Median CPU seconds per process over the kind's syncs; the workers' split into vLLM's processing (process
        + MoE prepack + copies into kernel tensors, the worker's main thread) and the rest."""
        procs = {k: med(c[k] for c in cpus[kind]) for k in cpus[kind][0]}
        vllm = {}
        for r in range(tp):
            per_sync = [sum(s[r].get("cpu_seconds", {}).get(k, 0.0) for k in VLLM_STEPS) for s in splits[kind]]
            vllm[f"worker {r}"] = med(per_sync)
        parts = {k: v for k, v in procs.items() if k.startswith("trainer: ")}  # within the trainer's
        procs = {k: v for k, v in procs.items() if k not in parts}
        total = med(sum(v for k, v in c.items() if not k.startswith("trainer: ")) for c in cpus[kind])
        return dict(processes=procs, trainer_parts=parts, vllm_processing=vllm, total=total)

    return dict(
        case=name,
        tp=tp,
        cores=os.cpu_count(),
        cpu=cpu_account("shardplan"),
        cpu_gloo=dict(
            processes={k: med(c[k] for c in ceiling.cpu) for k in ceiling.cpu[0]},
            total=med(sum(c.values()) for c in ceiling.cpu),
        ),
        layers=cfg["num_hidden_layers"],
        overrides=list(overrides),
        setup_s=setup_s,
        shipped_bytes=nbytes,
        ceiling_gloo_s=med(runs["gloo"]),
        checkpoint_bytes=full_bytes,
        shardplan_s=med(runs["shardplan"]),
        vllm_reload_s=med(runs["vllm"]),
        tokens_equal=tokens_by_kind["shardplan"] == tokens_vllm,
        ranks=per_rank("shardplan"),
        variants={
            k: dict(
                seconds=med(runs[k]),
                ranks=per_rank(k),
                tokens_equal_shardplan=tokens_by_kind[k] == tokens_by_kind["shardplan"],
                cpu=cpu_account(k),
            )
            for k in kinds
            if k != "shardplan"
        },
        load=loads,
        phases={k: med(p.get(k, 0.0) for p in phases) for k in phases[0]},
        shardplan_skip_prepack_s=med(runs["shardplan_skip_prepack"]) if runs["shardplan_skip_prepack"] else None,
        tokens_equal_skip_prepack=None if tokens_skip is None else tokens_skip == tokens_vllm,
        runs=runs,
    )


def print_split(console, r: dict, kind: str, ranks: list[dict]) -> None:
    from rich.table import Table

    split = Table(
        title=f"{r['case']}, {kind}: one update per engine rank (median s; process excludes the MoE prepack re-run; "
        f"receive + verify = update - the engine's own steps: waiting for the bytes (the trainer packing, gloo) and "
        f"checksumming them)"
    )
    cols = [
        "rank",
        "trainer pack",
        "receive + verify",
        *ENGINE_STEPS,
        "update",
        "RSS before",
        "RSS peak",
        "peak - before",
        "one layer",
    ]
    for col in cols:
        split.add_column(col)
    mib = 2**20
    for k in ranks:
        s = k["seconds"]
        split.add_row(
            str(k["rank"]),
            f"{k['trainer_pack_s']:.3f}",
            f"{s['receive + verify']:.3f}",
            *(f"{s[x]:.3f}" for x in ENGINE_STEPS),
            f"{s['update']:.3f}",
            f"{k['rss_before'] / mib:.0f} MiB",
            f"{k['rss_peak'] / mib:.0f} MiB",
            f"{(k['rss_peak'] - k['rss_before']) / mib:.0f} MiB",
            f"{k['layer_bytes'] / mib:.0f} MiB",
        )
    console.print(split)
    for k in ranks:
        console.print(
            f"rank {k['rank']} process by module class (median s): "
            + ", ".join(f"{c} {v:.3f}" for c, v in sorted(k["process_by_class"].items(), key=lambda kv: -kv[1]))
            + f"; materialize pools allocated per update: {k['pools']}; received straight into params: "
            f"{k.get('in_place_bytes', 0) / 2**20:.0f} MiB; worker CPU s in the update: "
            + ", ".join(f"{c} {v:.3f}" for c, v in k["cpu_seconds"].items())
        )


def print_cpu(console, r: dict) -> None:
    """CPU seconds per process in one sync next to the gloo-alone round, and the CPU-seconds floor on this box."""
    from rich.table import Table

    cores, gloo = r["cores"], r["ceiling_gloo_s"]
    table = Table(
        title=f"{r['case']}: CPU seconds (user + sys) per process in one update (median), {cores} cores; "
        f"floor = CPU seconds / cores (the shortest wall time those CPU seconds allow on this box)"
    )
    for col in ("run", "wall s", *r["cpu"]["processes"], "of workers: vLLM processing", "all", "floor s"):
        table.add_column(col)
    g = r["cpu_gloo"]
    gp = {k.replace("receiver", "worker"): v for k, v in g["processes"].items()}  # receiver i stands for worker i
    table.add_row(
        "gloo send alone (worker i: its receiver)",
        f"{gloo:.3f}",
        *(f"{gp[k]:.2f}" if k in gp else "" for k in r["cpu"]["processes"]),
        "",
        f"{g['total']:.2f}",
        f"{g['total'] / cores:.3f}",
    )
    runs = [("shardplan", r["shardplan_s"], r["cpu"])]
    runs += [(k, v["seconds"], v["cpu"]) for k, v in r["variants"].items()]
    for kind, wall, cpu in runs:
        table.add_row(
            kind,
            f"{wall:.3f}",
            *(f"{v:.2f}" for v in cpu["processes"].values()),
            " / ".join(f"{v:.2f}" for v in cpu["vllm_processing"].values()),
            f"{cpu['total']:.2f}",
            f"{cpu['total'] / cores:.3f}",
        )
    console.print(table)
    for kind, _, cpu in runs:
        console.print(
            f"{r['case']}, {kind}: of the trainer's CPU s, "
            + ", ".join(f"{k.removeprefix('trainer: ')} {v:.2f}" for k, v in cpu["trainer_parts"].items())
            + " (its lane threads); the rest: gloo sends, control, the engine RPCs"
        )
    c = r["cpu"]
    vllm = sum(c["vllm_processing"].values())
    must = g["total"] + vllm
    ours = c["total"] - must
    console.print(
        f"{r['case']}: the sync's CPU-seconds floor on this box: (the gloo send's {g['total']:.2f} + vLLM's processing "
        f"{vllm:.2f}) / {cores} cores = {must / cores:.3f} s, against the 1.3x bar {1.3 * gloo:.3f} s "
        f"({must / cores / gloo:.2f}x the gloo send); the sync spent {c['total']:.2f} CPU s "
        f"({c['total'] / cores:.3f} s / {cores} cores) in {r['shardplan_s']:.3f} s wall: beyond the floor, "
        f"{ours:.2f} CPU s are shardplan's (or the engine's RPCs) and {r['shardplan_s'] - c['total'] / cores:.3f} s "
        f"of wall is cores idle (waiting)"
    )
    console.print(
        f"{r['case']}: the gloo send alone kept {g['total'] / (cores * gloo):.0%} of the {cores} cores busy; where it "
        f"keeps them all busy (CPU-bound, a quiet box), the floor is 1 + vLLM's processing / the gloo send's CPU s = "
        f"{1 + vllm / g['total']:.2f}x the gloo send, whatever shardplan does"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default="tiny-dense,tiny-moe")
    parser.add_argument("--layers", type=int, default=2, help="decoder layers of the cut qwen3-30b-a3b")
    parser.add_argument("--iters", type=int, default=3)
    parser.add_argument(
        "--override",
        action="append",
        default=[],
        help="KEY=VALUE on the cut qwen3-30b-a3b's config (e.g. num_experts=64 to fit a smaller box)",
    )
    parser.add_argument(
        "--skip-prepack",
        action="store_true",
        help="MoE: also time a sync without the CPU prepack re-run (vLLM's own reload's work)",
    )
    parser.add_argument(
        "--variant",
        action="append",
        default=[],
        help="also time, alternating with the default in every iteration, a shardplan sync with these update options "
        "(KEY=VALUE[,KEY=VALUE], EngineUpdateInfo fields), e.g. defer_gemm=false; direct_sends=false: the trainer "
        "copies every segment into staging (none sent from its tensors)",
    )
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args()
    results = [
        run_case(c, args.layers, args.iters, args.override, args.skip_prepack, args.variant)
        for c in args.cases.split(",")
    ]
    from rich.console import Console
    from rich.table import Table

    table = Table(title="one update of a live vLLM CPU engine (median)")
    for col in (
        "case",
        "TP",
        "shipped / checkpoint",
        "shardplan sync s",
        "gloo send alone s",
        "vLLM reload_weights s",
        "sync / gloo",
        "sync / reload",
        "same tokens",
        "load avg",
    ):
        table.add_column(col)
    for r in results:
        table.add_row(
            f"{r['case']} ({r['layers']} layers{''.join(', ' + o for o in r['overrides'])})",
            str(r["tp"]),
            f"{r['shipped_bytes'] / 2**20:.1f} / {r['checkpoint_bytes'] / 2**20:.1f} MiB",
            f"{r['shardplan_s']:.3f}",
            f"{r['ceiling_gloo_s']:.3f}",
            f"{r['vllm_reload_s']:.3f}",
            f"{r['shardplan_s'] / r['ceiling_gloo_s']:.2f}x",
            f"{r['shardplan_s'] / r['vllm_reload_s']:.2f}x",
            str(r["tokens_equal"]),
            " ".join(f"{x:.1f}" for x in r["load"]),
        )
    console = Console(width=200)
    console.print(table)
    for r in results:
        console.print(
            f"{r['case']}: the driver's phases of the shardplan sync (median s): "
            + ", ".join(f"{k} {v:.3f}" for k, v in r["phases"].items())
        )
        print_split(console, r, "shardplan", r["ranks"])
        print_cpu(console, r)
        for kind, v in r["variants"].items():
            console.print(
                f"{r['case']}: shardplan sync with {kind}: {v['seconds']:.3f} s (default {r['shardplan_s']:.3f} s, "
                f"same run, alternating); same tokens as the default: {v['tokens_equal_shardplan']}"
            )
            print_split(console, r, kind, v["ranks"])
    for r in results:
        if r["shardplan_skip_prepack_s"] is not None:
            print(
                f"{r['case']}: shardplan sync without the MoE prepack re-run (what vLLM's own reload does): "
                f"{r['shardplan_skip_prepack_s']:.3f} s; its tokens == vLLM reload's: {r['tokens_equal_skip_prepack']}"
            )
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
