"""Helpers for the live-engine tests: tiny random checkpoints (no hub), their plans, vLLM CPU engines, and a trainer
process holding a transformers model that takes real AdamW steps.

The engines are cpu_engine's (the CPU recipe, shared with bench/engine_bench.py); vLLM spawns its
workers, so test modules guard nothing at import time that a spawned process would re-run.
"""

from __future__ import annotations

import asyncio
import json
import multiprocessing as mp
import os
import shutil
import threading
import time
from concurrent.futures import Future, ProcessPoolExecutor
from pathlib import Path

import torch
from cpu_engine import (  # noqa: F401 - KV_CACHE_BYTES: for the tests' servers
    KV_CACHE_BYTES,
    TINY,
    cpu_engine_kwargs,
    greedy_tokens,
    set_cpu_env,
    start_cpu_llm,
    stop_cpu_llm,
    tiny_qwen3_config,
)

set_cpu_env()

PROMPTS = [[5, 17, 99, 300, 7], [42, 43, 44], [901, 3, 3, 512, 64, 8]]
MAX_TOKENS = 16
TIMEOUT_S = 10.0

HIDDEN, LAYERS, HEADS, KV_HEADS, HEAD_DIM, INTER, VOCAB = (
    TINY[k] for k in ("hidden", "layers", "heads", "kv_heads", "head_dim", "inter", "vocab")
)
EXPERTS, TOPK, MOE_INTER = TINY["experts"], TINY["topk"], TINY["moe_inter"]
config = tiny_qwen3_config


def random_tensors(moe: bool, seed: int, moe_inter: int = MOE_INTER) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)

    def r(*shape):
        return (torch.randn(*shape, generator=g) * 0.05).to(torch.bfloat16)

    def n(*shape):
        return (1 + 0.1 * torch.randn(*shape, generator=g)).to(torch.bfloat16)

    t = {
        "model.embed_tokens.weight": r(VOCAB, HIDDEN),
        "model.norm.weight": n(HIDDEN),
        "lm_head.weight": r(VOCAB, HIDDEN),
    }
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        t[p + "input_layernorm.weight"] = n(HIDDEN)
        t[p + "post_attention_layernorm.weight"] = n(HIDDEN)
        t[p + "self_attn.q_proj.weight"] = r(HEADS * HEAD_DIM, HIDDEN)
        t[p + "self_attn.k_proj.weight"] = r(KV_HEADS * HEAD_DIM, HIDDEN)
        t[p + "self_attn.v_proj.weight"] = r(KV_HEADS * HEAD_DIM, HIDDEN)
        t[p + "self_attn.o_proj.weight"] = r(HIDDEN, HEADS * HEAD_DIM)
        t[p + "self_attn.q_norm.weight"] = n(HEAD_DIM)
        t[p + "self_attn.k_norm.weight"] = n(HEAD_DIM)
        if moe:
            t[p + "mlp.gate.weight"] = r(EXPERTS, HIDDEN)
            for e in range(EXPERTS):
                q = p + f"mlp.experts.{e}."
                t[q + "gate_proj.weight"] = r(moe_inter, HIDDEN)
                t[q + "up_proj.weight"] = r(moe_inter, HIDDEN)
                t[q + "down_proj.weight"] = r(HIDDEN, moe_inter)
        else:
            t[p + "mlp.gate_proj.weight"] = r(INTER, HIDDEN)
            t[p + "mlp.up_proj.weight"] = r(INTER, HIDDEN)
            t[p + "mlp.down_proj.weight"] = r(HIDDEN, INTER)
    return t


def write_checkpoint(directory: Path, cfg: dict, tensors: dict[str, torch.Tensor]) -> Path:
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(cfg, indent=1))
    save_file(
        {k: v.contiguous() for k, v in tensors.items()}, str(directory / "model.safetensors"), metadata={"format": "pt"}
    )
    return directory


def make_model(root: Path, moe: bool, seed: int = 1, moe_inter: int = MOE_INTER) -> Path:
    """`moe_inter`: the experts' intermediate size (TINY's, or another to make vLLM pad it per partition)."""
    cfg = config(moe) | ({"moe_intermediate_size": moe_inter} if moe else {})
    return write_checkpoint(root / ("moe" if moe else "dense"), cfg, random_tensors(moe, seed, moe_inter))


def record_plan(model_dir: Path, tp: int, out_dir: Path, pp: int = 1) -> Path:
    """`shardplan record` for the tiny model (in this process: vLLM on the meta device, nothing left behind)."""
    from shardplan.plan.file.format import write_plan
    from shardplan.plan.file.store import plan_path
    from shardplan.plan.layout import Layout
    from shardplan.record.session import RecordSession

    session = RecordSession(str(model_dir), Layout(tp=tp, pp=pp))
    path = plan_path(session.spec, session.layout, session.dtype, out_dir=out_dir)
    write_plan(path, session.encode(session.record_plans(range(tp * pp)).body))
    return path


engine_kwargs = cpu_engine_kwargs


def start_llm(
    model_dir: Path,
    tp: int,
    *,
    shardplan_backend: bool = True,
    gemm: str | None = None,
    moe: str | None = None,
    pp: int = 1,
):
    """cpu_engine's engine; `gemm`: pin vLLM's CPU GEMM path in the workers (engine_gemm.MODES), `moe`:
    its CPU MoE experts' path (engine_gemm.MOE_MODES); None: what the CPU picks. `pp`: pipeline stages (with
    engine_gemm's repair of vLLM 0.32's CPU pipeline parallelism)."""
    extra = {} if pp == 1 else {"pipeline_parallel_size": pp}
    for env, mode in (("SHARDPLAN_TEST_CPU_GEMM", gemm), ("SHARDPLAN_TEST_CPU_MOE", moe)):
        if mode is None:
            os.environ.pop(env, None)
        else:
            os.environ[env] = mode
    if gemm is not None or moe is not None or pp > 1:
        import engine_gemm

        here = str(Path(__file__).parent)  # the workers import engine_gemm
        if here not in os.environ.get("PYTHONPATH", "").split(os.pathsep):
            os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (here, os.environ.get("PYTHONPATH")) if p)
        extra.update(engine_gemm.ENGINE_KWARGS)
    llm = start_cpu_llm(model_dir, tp, shardplan_backend=shardplan_backend, cores=engine_cores(tp * pp), **extra)
    if pp > 1:
        llm.collective_rpc("allocate_pp_intermediate_tensors")
    return llm


stop_llm = stop_cpu_llm


def engine_cores(workers: int) -> list[int] | None:
    """Where an engine's workers run: vLLM binds a lone worker to core 0, so under pytest-xdist the tests of the
    second xdist worker (and its fresh-engine pool) put theirs on the next core instead of queueing on core 0."""
    index = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw") or 0)
    count = os.cpu_count() or 1
    return None if workers > 1 or index == 0 else [index % count]


def greedy(llm) -> list[list[int]]:
    return greedy_tokens(llm, PROMPTS, MAX_TOKENS)


_FRESH: dict[tuple, list[list[int]] | Future] = {}
_POOL: list[ProcessPoolExecutor] = []
# fresh engines started at once: an engine's start is a chain of processes each importing vLLM, one core at a time,
# so two chains keep a 2-core box busy where one leaves a core idle
# (one under pytest-xdist: its two workers already keep both cores busy)
FRESH_WORKERS = 1 if os.environ.get("PYTEST_XDIST_WORKER") else 2


def _fresh_key(model_dir: Path, tp: int, gemm: str | None, moe: str | None, pp: int) -> tuple:
    import hashlib

    return (hashlib.sha256((Path(model_dir) / "model.safetensors").read_bytes()).hexdigest(), tp, gemm, moe, pp)


def prefetch_fresh(
    model_dir: Path, tp: int, gemm: str | None = None, logits: str = "lm_head", moe: str | None = None, pp: int = 1
) -> None:
    """Start computing fresh_tokens(...) of these arguments in the background (a pool of FRESH_WORKERS spawned
    processes that each start the fresh engine, read its tokens and stop it); fresh_tokens then waits for it. Call it
    as soon as a checkpoint is written, so the fresh engine starts while the test goes on."""
    key = _fresh_key(model_dir, tp, gemm, moe, pp)
    if key not in _FRESH:
        if not _POOL:
            _POOL.append(ProcessPoolExecutor(max_workers=FRESH_WORKERS, mp_context=mp.get_context("spawn")))
        _FRESH[key] = _POOL[0].submit(_fresh_engine_tokens, str(model_dir), tp, gemm, logits, moe, pp)


def fresh_tokens(
    model_dir: Path, tp: int, gemm: str | None = None, logits: str = "lm_head", moe: str | None = None, pp: int = 1
) -> list[list[int]]:
    """Greedy tokens of a fresh engine of this layout started from `model_dir` (no weight transfer involved); kept
    per (checkpoint bytes, layout) for the session: two tests whose trainers wrote the same bytes share the engine.
    `gemm`: the GEMM path pinned, checked on the module computing the logits (`logits`); `moe`: the MoE experts'
    path pinned, checked on every MoE layer."""
    prefetch_fresh(model_dir, tp, gemm, logits, moe, pp)
    key = _fresh_key(model_dir, tp, gemm, moe, pp)
    if isinstance(_FRESH[key], Future):
        _FRESH[key] = _FRESH[key].result(timeout=900)
    return _FRESH[key]


def _fresh_engine_tokens(
    model_dir: str, tp: int, gemm: str | None, logits: str, moe: str | None, pp: int
) -> list[list[int]]:
    """fresh_tokens' engine, in a pool process."""
    llm = start_llm(Path(model_dir), tp, shardplan_backend=False, gemm=gemm, moe=moe, pp=pp)
    try:
        if gemm is not None:
            kinds = llm.collective_rpc("gemm_kinds")
            assert [k[logits] for k in kinds if logits in k] == [gemm] * tp, kinds  # (its pipeline stage)
        if moe is not None:
            assert_moe_path(llm, moe, tp)
        return greedy(llm)
    finally:
        stop_llm(llm)


def assert_moe_path(llm, moe: str, tp: int) -> list[dict[str, dict]]:
    """Every MoE layer of every worker got the experts of the pinned path (engine_gemm.moe_paths per worker)."""
    paths = llm.collective_rpc("moe_paths")
    assert len(paths) == tp and all(paths), paths
    assert {(p["isa"], p["experts"]) for w in paths for p in w.values()} == {(moe, MOE_EXPERTS[moe])}, paths
    return paths


MOE_EXPERTS = {"vec": "CPUUnquantizedExperts", "amx": "X86CPUUnquantizedExperts"}


# ---- the trainer process ---------------------------------------------------------------------------------------------
def _trainer_main(
    model_dir: str,
    plan_path: str,
    host: str,
    port: int,
    out_dir: str,
    conn,
    lr: float,
    seed: int,
    save_pretrained: bool = False,
    replicas: int = 1,
    secret: str = "",
):
    """A separate trainer: a transformers model (fp32 master weights) taking AdamW steps on a fixed random batch,
    one shardplan TrainerRank; commands: ("step", k) -> saves checkpoint k (bf16) and returns its dir;
    ("sync", v) -> TrainerRank.sync(v); ("sync_slow", (v, seconds)) -> sync with a stall after the first group;
    ("modules", None) -> whether vLLM was ever imported here. `save_pretrained`: checkpoints are a bf16 copy of the
    model written by transformers' save_pretrained (tied weights stored once) instead of its state dict."""
    import sys

    from transformers import AutoModelForCausalLM
    from transformers.core_model_loading import revert_weight_conversion

    from shardplan.engine.trainer import ModuleSource, TrainerRank
    from shardplan.sync import SyncConfig
    from shardplan.transport import Control

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)

    def checkpoint_state():
        """The model's tensors under their checkpoint names (transformers 5 keeps MoE experts stacked in memory)."""
        return revert_weight_conversion(model, model.state_dict())

    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    batch = torch.randint(0, VOCAB, (4, 24), generator=torch.Generator().manual_seed(seed))
    source = ModuleSource(checkpoint_state, plan_path)
    rank = TrainerRank(
        plan_path, source, Control(host, port, secret=secret), config=SyncConfig(timeout_s=TIMEOUT_S), replicas=replicas
    )
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    conn.send(("ready", None))
    while True:
        cmd, arg = conn.recv()
        try:
            if cmd == "stop":
                rank.close()
                conn.send(("ok", None))
                return
            if cmd == "step":
                loss = model(input_ids=batch, labels=batch).loss
                loss.backward()
                optimizer.step()
                optimizer.zero_grad()
                path = Path(out_dir) / f"step{arg}"
                if save_pretrained:
                    import copy

                    copy.deepcopy(model).to(torch.bfloat16).save_pretrained(path)
                else:
                    state = {k: v.detach().to(torch.bfloat16) for k, v in checkpoint_state().items()}
                    write_checkpoint(path, cfg, state)
                conn.send(("ok", (str(path), float(loss))))
            elif cmd == "sync":
                conn.send(("ok", rank.sync(arg)))
            elif cmd == "sync_stall":
                # the trainer sends its first group, then stalls before packing the next (killed from outside)
                packer, pack = rank.packer, rank.packer.pack

                def stalling(*a, **kw):
                    pack(*a, **kw)
                    conn.send(("packed", None))
                    packer.pack = lambda *a, **kw: time.sleep(3600)

                packer.pack = stalling
                rank.sync(arg)
            elif cmd == "modules":
                conn.send(("ok", sorted(m for m in sys.modules if m.split(".")[0] in ("vllm", "safetensors"))))
        except BaseException as e:  # noqa: BLE001 - reported to the test
            conn.send(("error", e))


def step_and_sync(trainer, driver, version: int):
    """One AdamW step in the trainer process, then its sync: (checkpoint dir, driver's report, trainer's report)."""
    checkpoint, _ = trainer.call("step", version)
    trainer.send("sync", version)
    report = driver.sync(version)
    return checkpoint, report, trainer.result()


class Trainer:
    """The trainer process, driven over a pipe."""

    def __init__(
        self,
        model_dir: Path,
        plan_path: Path,
        control,
        out_dir: Path,
        *,
        lr: float = 2e-2,
        seed: int = 0,
        save_pretrained: bool = False,
        replicas: int = 1,
    ):
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(
            target=_trainer_main,
            daemon=True,
            args=(
                str(model_dir),
                str(plan_path),
                control.host,
                control.port,
                str(out_dir),
                child,
                lr,
                seed,
                save_pretrained,
                replicas,
                control.secret_hex,
            ),
        )
        self.proc.start()
        tag, err = self._recv(180)
        if tag != "ready":
            raise err

    def _recv(self, timeout_s: float):
        if not self.conn.poll(timeout_s):
            raise TimeoutError("the trainer process did not answer")
        return self.conn.recv()

    def call(self, cmd: str, arg=None, timeout_s: float = 120):
        self.conn.send((cmd, arg))
        tag, out = self._recv(timeout_s)
        if tag == "error":
            raise out
        return out

    def send(self, cmd: str, arg=None) -> None:
        self.conn.send((cmd, arg))

    def result(self, timeout_s: float = 120):
        tag, out = self._recv(timeout_s)
        if tag == "error":
            raise out
        return out

    def kill(self) -> None:
        self.proc.kill()
        self.proc.join(10)

    def stop(self) -> None:
        if self.proc.is_alive():
            try:
                self.call("stop", timeout_s=30)
            except Exception:  # noqa: BLE001
                self.proc.kill()
        self.proc.join(10)


def copy_model(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


# ---- sharded trainers: FSDP2 over a gloo group, each rank holding half of every tensor (DTensor Shard(0)) ----------
def _fsdp_trainer_main(
    rank: int, world: int, pg_port: int, model_dir: str, plan_path: str, out_dir: str, conn, lr: float
):
    """One FSDP2 trainer rank (transformers model, fp32, fully_shard per decoder layer and at the root, AdamW, its own
    micro-batch). Commands: ("shards", None) -> every rank's boxes (from its DTensors' placements, JSON);
    ("join", control) -> its TrainerRank of the driver's sync, from its local shards only; ("step", k) -> a
    data-parallel step, the full bf16 checkpoint k written by rank 0; ("sync", v); ("stop", None)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from transformers import AutoModelForCausalLM

    from shardplan.engine.sharding import shards_to_json
    from shardplan.engine.trainer import ModuleSource, TrainerRank
    from shardplan.sync import SyncConfig

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{pg_port}", rank=rank, world_size=world)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    mesh = init_device_mesh("cpu", (world,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    batch = torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(100 + rank))
    source = ModuleSource(model, plan_path)  # finds its DTensors: every rank's boxes from their placements
    assert source.rank == rank and source.shards is not None
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    trainer = None
    conn.send(("ready", None))
    while True:
        cmd, arg = conn.recv()
        try:
            if cmd == "stop":
                if trainer is not None:
                    trainer.close()
                dist.destroy_process_group()
                conn.send(("ok", None))
                return
            if cmd == "shards":
                conn.send(("ok", shards_to_json(source.shards)))
            elif cmd == "join":
                trainer = TrainerRank(plan_path, source, arg, rank=rank, config=SyncConfig(timeout_s=TIMEOUT_S))
                conn.send(("ok", None))
            elif cmd == "step":
                loss = model(input_ids=batch, labels=batch).loss
                loss.backward()
                optimizer.step()
                optimizer.zero_grad()
                # the full checkpoint (a collective: every rank gathers), written once
                state = {k: v.full_tensor().detach().to(torch.bfloat16) for k, v in model.state_dict().items()}
                path = Path(out_dir) / f"step{arg}"
                if rank == 0:
                    write_checkpoint(path, cfg, state)
                dist.barrier()
                local = {k: tuple(v.to_local().shape) for k, v in model.state_dict().items()}
                conn.send(("ok", (str(path), local)))
            elif cmd == "sync":
                conn.send(("ok", trainer.sync(arg)))
        except BaseException as e:  # noqa: BLE001 - reported to the test
            conn.send(("error", e))


class FsdpTrainers:
    """`world` FSDP2 trainer processes, each driven over its own pipe (the same commands on all of them)."""

    def __init__(self, model_dir: Path, plan_path: Path, out_dir: Path, *, world: int = 2, lr: float = 2e-2):
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        ctx = mp.get_context("spawn")
        self.ranks = []
        for rank in range(world):
            conn, child = ctx.Pipe()
            proc = ctx.Process(
                target=_fsdp_trainer_main,
                daemon=True,
                args=(rank, world, port, str(model_dir), str(plan_path), str(out_dir), child, lr),
            )
            proc.start()
            self.ranks.append(_Pipe(conn, proc))
        for r in self.ranks:
            tag, err = r.recv(240)
            if tag != "ready":
                raise err

    def send(self, cmd: str, arg=None) -> None:
        for r in self.ranks:
            r.conn.send((cmd, arg))

    def results(self, timeout_s: float = 180) -> list:
        out = []
        for r in self.ranks:
            tag, value = r.recv(timeout_s)
            if tag == "error":
                raise value
            out.append(value)
        return out

    def call(self, cmd: str, arg=None, timeout_s: float = 180) -> list:
        self.send(cmd, arg)
        return self.results(timeout_s)

    def stop(self) -> None:
        try:
            self.call("stop", timeout_s=30)
        except Exception:  # noqa: BLE001 - teardown
            pass
        for r in self.ranks:
            r.proc.join(10)
            if r.proc.is_alive():
                r.proc.kill()


class _Pipe:
    def __init__(self, conn, proc):
        self.conn, self.proc = conn, proc

    def recv(self, timeout_s: float):
        if not self.conn.poll(timeout_s):
            raise TimeoutError("a trainer process did not answer")
        return self.conn.recv()


class AsyncEngine:
    """An AsyncLLM built and serving on its own event loop thread (as in an async server)."""

    def __init__(self, model_dir, dp: int = 1):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True, name="async-llm loop")
        self.thread.start()
        self.engine = self.run(self._start(str(model_dir), dp), 900)

    async def _start(self, model_dir, dp):
        """`dp`: vLLM data-parallel ranks (engine cores), one CPU core each."""
        from vllm.config import WeightTransferConfig
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        if dp > 1:
            os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(str(i) for i in range(dp))
        else:
            os.environ.pop("VLLM_CPU_OMP_THREADS_BIND", None)
        args = AsyncEngineArgs(
            model=model_dir,
            weight_transfer_config=WeightTransferConfig(backend="shardplan"),
            data_parallel_size=dp,
            **engine_kwargs(1),
        )
        return AsyncLLM.from_engine_args(args)

    def run(self, coro, timeout_s: float = 300):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout_s)

    def greedy(self, prompts=PROMPTS) -> list[list[int]]:
        from vllm import SamplingParams

        params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)

        async def one(i, prompt):
            last = None
            async for out in self.engine.generate(
                {"prompt_token_ids": prompt}, params, request_id=f"r{i}-{id(params)}"
            ):
                last = out
            return list(last.outputs[0].token_ids)

        async def every():
            return list(await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts))))

        return self.run(every())

    def stop(self):
        import gc

        try:
            self.engine.shutdown()
            self.engine = None
            gc.collect()  # its __del__ runs now, not at interpreter exit (where it fails on torn-down globals)
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(10)
