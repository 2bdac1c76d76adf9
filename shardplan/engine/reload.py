"""Plan bytes into a live vLLM model: the pre-processing layout, under vLLM's layerwise reload.

A live engine's params are *post-processed* (`process_weights_after_loading`: oneDNN/sgl repacks that leave a linear
`weight` with 0 elements on AVX-512/AMX CPUs, CPU MoE experts padded and prepacked, quantized layers repacked), while
a plan holds the bytes the loader writes, i.e. the *pre-processing* layout. So, as vLLM's own checkpoint-format
backends do (vllm/model_executor/model_loader/reload/), per sync:

    begin()        initialize_layerwise_reload(model): kernel tensors saved, every layer back to its constructed
                   (pre-processing) layout, on the meta device
    receive_targets(group)  when the group's receives are posted: where the pool has room, materialize its layers
                   now and have its single-param segments received straight into them (apply then skips them)
    apply(group)   materialize the layers the group writes (uninitialised tensors in the sync's pool), scatter the
                   group's bytes into them (shardplan.runtime.apply.Applier), and for every module whose LAST part has
                   now landed run what vLLM's `_layerwise_process` runs after its loaders:
                   quant_method.process_weights_after_loading, update_param_tp_status, copy into the saved kernel
                   tensors (addresses kept), info.reset()
    end()          finalize_layerwise_reload: layers nothing wrote get their kernel tensors back, attention layers are
                   processed last; then every module the plan does not write but whose tensors share storage with a
                   written param (a tied lm_head) is processed again, so its derived GEMM state holds the new weights

vLLM 0.32 bug worked around here: `UnquantizedFusedMoEMethod._setup_kernel` skips the experts' own
`process_weights_after_loading` (the CPU prepack) on a weight update, so a reload copies the raw layout into the
prepacked kernel tensors (a reload of the SAME weights changed a tiny Qwen3-MoE's greedy tokens on this CPU box).
We re-run it after processing an unquantized MoE layer (tests/integration/test_engine.py pins it:
test_moe_update_reruns_the_cpu_prepack_vllm_032_skips).

Fallback tensors (loaders shardplan could not record) go through the model's real `load_weights` under the same
reload, where vLLM's wrapped loaders buffer and process them per layer as usual.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import threading
import time
import weakref
from collections import defaultdict
from itertools import chain
from typing import Mapping

import torch

from shardplan.engine.errors import EnginePlanMismatch, EngineUnsupported
from shardplan.plan.columns import columns_of
from shardplan.plan.interp import to_dtype
from shardplan.plan.unwritten import unwritten_ranges
from shardplan.runtime.apply import Applier, params_from_plan
from shardplan.runtime.pack import PackLayout, fallback_slots, reads_digest, sharded_bases
from shardplan.runtime.tensors import align_up
from shardplan.sync.adapters import ShardedUnpacker, layout_stamp

logger = logging.getLogger("shardplan.engine")


def _skips_moe_prepack_on_update() -> bool:
    import vllm

    return vllm.__version__.startswith("0.32.")


class ReloadUnpacker:
    """shardplan.sync Unpacker that writes into a live vLLM model through layerwise reload (see the module doc).
    Built once per engine (init_transfer_engine); `begin()` / `end()` bracket every sync."""

    def __init__(
        self,
        model: torch.nn.Module,
        plan,
        sources: Mapping,
        *,
        alignment: int = 256,
        max_group_bytes: int | None = None,
        sharded=None,
    ):
        """`sharded`: the ShardedPlan of sharded trainers (engine.sharding.sharded_plan): each group's buffer is
        then every trainer's part of it, one after the other (shardplan.runtime.pack.sharded_bases)."""
        from vllm.model_executor.layers.attention import is_deferred_attention_layer
        from vllm.model_executor.model_loader.reload.layerwise import get_layerwise_info

        # a plan file's source table stays templated (a dict of it would spell out every checkpoint name)
        self.model, self.plan, self.sources = model, plan, dict(sources) if isinstance(sources, dict) else sources
        self.sharded = sharded is not None  # several trainers' parts per group: every byte through the buffer
        self.alignment = alignment
        self._meta_params = params_from_plan(plan, device="meta")
        if sharded is None:
            self.layout = PackLayout.from_plans(plan, alignment, max_group_bytes)
            self.fallbacks = fallback_slots(plan, self.layout, self.sources) if plan.fallbacks else {}
            self.parts = {0: self.layout}  # one part per trainer that sends into a group; here: all from one
            self.appliers = {0: Applier(plan, self.layout, self._meta_params, fallback_loader=self._load_fallback)}
            self._stamp = layout_stamp((plan.rank,), self.layout.digest, reads_digest(plan), self.fallbacks)
            self._sizes = {g.name: g.nbytes for g in self.layout.groups}
            for group, slots in self.fallbacks.items():
                self._sizes[group] = slots[-1].offset + slots[-1].nbytes
        else:  # the same parts, appliers, sizes and stamp as sync.ShardedUnpacker's, bound to meta stand-ins
            inner = ShardedUnpacker(sharded, plan.rank, self._meta_params, alignment=alignment)
            self.fallbacks, self.parts, self.appliers = {}, inner.parts, inner.appliers
            self._stamp, self._sizes = inner.stamp(), inner.sizes()
        metas = {p.name: p for p in plan.params}
        self.targets: dict[str, tuple[torch.nn.Module, str]] = {}
        for name in columns_of(plan).written_params():
            module_name, _, attr = name.rpartition(".")
            try:
                module = model.get_submodule(module_name)
            except AttributeError:
                raise EnginePlanMismatch(
                    f"rank {plan.rank}: the plan writes {name!r}, but the live model has no module "
                    f"{module_name!r}: the plan was recorded for another model"
                ) from None
            if is_deferred_attention_layer(module):
                raise EngineUnsupported(
                    f"rank {plan.rank}: the plan writes {name!r} of an attention layer, whose "
                    f"scales vLLM re-loads only through its own loaders at finalize; not "
                    f"supported by the shardplan backend yet"
                )
            info = get_layerwise_info(module)
            restore_params, restore_buffers = info.restore_metadata
            meta = restore_params.get(attr, restore_buffers.get(attr))
            if meta is None and isinstance(getattr(module, attr, None), torch.Tensor):
                meta = getattr(module, attr)  # e.g. a bias: vLLM's reload keeps it live rather than on meta
            want = metas[name]
            if meta is None or tuple(meta.shape) != tuple(want.shape) or meta.dtype != to_dtype(want.dtype):
                got = "absent" if meta is None else f"{str(meta.dtype).removeprefix('torch.')}{list(meta.shape)}"
                raise EnginePlanMismatch(
                    f"rank {plan.rank}: param {name!r} is {got} in the live model (before "
                    f"processing) but {want.dtype}{list(want.shape)} in the plan: the plan was "
                    f"recorded for another model, layout or dtype"
                )
            self.targets[name] = (module, attr)
        # which modules each group (or part of a group) writes, and which groups write each module
        self.group_modules: dict[str, list[torch.nn.Module]] = {}
        self.group_params: dict[tuple[int, str], list[str]] = {}  # (part, group) -> params
        self.module_groups: dict[torch.nn.Module, set[str]] = {}
        for t, layout in self.parts.items():
            for g in layout.groups:
                names = list(layout.group(g.name).segments.params())
                self.group_params[t, g.name] = names
                modules = self.group_modules.setdefault(g.name, [])
                for n in names:
                    module = self.targets[n][0]
                    if all(module is not m for m in modules):
                        modules.append(module)
                    self.module_groups.setdefault(module, set()).add(g.name)
        self._refuse_unwritten_params()
        self.zero_filled = 0  # elements zeroed per update (_undefined_bytes)
        self.undefined = self._undefined_bytes()
        self.readers = self._modules_reading_written_storage()
        self._pending: dict[torch.nn.Module, set[str]] = {}
        self._materialized, self._processed = set(), set()  # ids of the modules materialized, processed in this sync
        self._open: set[int] = set()  # ids of the modules materialized and not processed yet
        self._pool: torch.Tensor | None = None  # CPU storage the open modules are materialized into (one sync)
        self._pool_uses = self._pool_used = 0  # its storage's use count with nothing in it; bytes the open modules take
        # the most the open modules took at once in this sync (the next sync's pool size); this sync's pool size
        self._pool_bytes = self._pool_size = 0
        self.pools_allocated = 0  # this sync's pools (1 when every module found the pool free; bench/engine_bench.py)
        self.seconds: dict[str, float] = defaultdict(float)  # this sync's time per step (bench/engine_bench.py)
        self.process_by_class: dict[str, float] = defaultdict(float)  # this sync's "process" per module class
        self.cpu_seconds: dict[str, float] = defaultdict(float)  # this thread's CPU in vLLM's steps (engine_bench)
        self.gemm_used: set[int] = set()  # ids of the modules whose DeferredGemm a forward called (logits modules)
        self.active = False
        # EngineUpdateInfo's fields, set per sync (rerun_moe_prepack is off only in the regression test)
        self.rerun_moe_prepack = self.defer_gemm = self.receive_in_place = self.prefault_pool = True
        self.keep_pool = False  # set_keep_pool
        self._posted: list[str] = []  # this sync's groups whose receives are posted, in order
        self._ahead = 0  # how many of them had their modules materialized when posted (receive_targets)
        self._in_place: dict[str, frozenset[int]] = {}  # group -> buffer offsets of segments received into params
        self._receiving: dict[str, list[torch.Tensor]] = {}  # group -> params' views its posted receives write
        self._kept: list[torch.Tensor] = []  # a failed sync's such views, alive until the next sync has ended
        self.in_place_bytes = 0  # this sync's bytes received straight into params (bench/engine_bench.py)

    def _refuse_unwritten_params(self) -> None:
        """Every loadable param of the live model must be written by the plan. One the plan never writes would keep
        its old weights through the update if its module is untouched (finalize_layerwise_reload restores unwritten
        layers), or be uninitialised at processing if its module is written: either way the version would read
        complete over wrong weights. vLLM's own strict load refuses the same ("weights were not initialized from
        checkpoint"). Tied params (the same tensor as a written one) are written through it; a plan with fallback
        tensors may write any param through vLLM's loaders, so it only warns."""
        from vllm.model_executor.model_loader.reload.layerwise import get_layerwise_info
        from vllm.model_executor.model_loader.reload.meta import SKIP_TENSORS

        written = {(id(m), a) for m, a in self.targets.values()}
        written_tensors = {id(t) for m, a in self.targets.values() if (t := getattr(m, a, None)) is not None}
        missing = []
        for module_name, module in self.model.named_modules():
            restore_params, _ = get_layerwise_info(module).restore_metadata
            for attr in restore_params:
                if attr in SKIP_TENSORS or (id(module), attr) in written:
                    continue
                if id(getattr(module, attr, None)) not in written_tensors:
                    missing.append(f"{module_name}.{attr}" if module_name else attr)
        if not missing:
            return
        text = (
            f"rank {self.plan.rank}: the plan never writes {len(missing)} param(s) of the live model, e.g. "
            f"{missing[:4]}: the update would report a complete version over their old or uninitialised values"
        )
        if self.plan.fallbacks:
            logger.warning("shardplan: %s (unless the plan's fallback tensors load them)", text)
            return
        raise EnginePlanMismatch(text + "; the plan was recorded for another model or is incomplete: re-record it")

    def _undefined_bytes(self) -> dict[torch.nn.Module, list[tuple[str, list[tuple[int, int]]]]]:
        """Elements of written params that no checkpoint tensor defines (padding vLLM allocates per rank, which its
        own loader leaves as allocated): zeroed in every sync once their module is materialized, since materialized
        storage is uninitialised or another module's (docs/configs.md). Derived from the plan's writes and shapes;
        with fallback tensors (which may write any of them) nothing is zeroed, and the log says so."""
        ranges = unwritten_ranges(self.plan)
        if ranges and self.plan.fallbacks:
            logger.warning(
                f"shardplan: rank {self.plan.rank}: {len(ranges)} param(s) hold elements the plan does not write (e.g. "
                f"{next(iter(ranges))}), which its fallback tensors may write: left as vLLM's reload materializes them"
            )
            return {}
        out: dict[torch.nn.Module, list[tuple[str, list[tuple[int, int]]]]] = {}
        for name, spans in ranges.items():
            module, attr = self.targets[name]
            out.setdefault(module, []).append((attr, spans))
        self.zero_filled = sum(hi - lo for spans in ranges.values() for lo, hi in spans)
        if ranges:
            logger.info(
                f"shardplan: rank {self.plan.rank}: {self.zero_filled} element(s) of {len(ranges)} param(s) that no "
                f"checkpoint tensor defines (e.g. {next(iter(ranges))}) are zero-filled at every update (vLLM's own "
                "load leaves them uninitialised)"
            )
        return out

    def _modules_reading_written_storage(self) -> dict[torch.nn.Module, tuple[str, list[str], list[int]]]:
        """Modules the plan does not write whose processing reads a param it does write, through a tie or any shared
        storage (a tied lm_head is embed_tokens' weight): module -> (its name, the written params it shares, ids of
        their writing modules). Their derived state (a GEMM handle or packed copy built by processing) would keep the
        old weights, since a layerwise reload processes only the modules it loads (vLLM's own reload has that bug).
        Only processing that rebuilds derived state from params it leaves in place can be re-run in place; any other
        quantization method on a shared param is refused by name."""
        from vllm.model_executor.layers.quantization.base_config import QuantizeMethodBase
        from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod

        written_modules = {id(m) for m, _ in self.targets.values()}
        by_storage: dict[int, tuple[str, int]] = {}  # storage address -> (written param, id of its module)
        for name, (module, attr) in self.targets.items():
            t = getattr(module, attr, None)
            if isinstance(t, torch.Tensor) and t.numel() and not t.is_meta:
                by_storage[t.untyped_storage().data_ptr()] = (name, id(module))
        readers = {}
        for module_name, module in self.model.named_modules():
            if id(module) in written_modules:
                continue
            shared = [
                by_storage[t.untyped_storage().data_ptr()]
                for _, t in chain(module.named_parameters(recurse=False), module.named_buffers(recurse=False))
                if t.numel() and not t.is_meta and t.untyped_storage().data_ptr() in by_storage
            ]
            quant_method = getattr(module, "quant_method", None)
            if not shared or not isinstance(quant_method, QuantizeMethodBase):
                continue  # nothing derived: it reads the shared tensor itself
            if not isinstance(quant_method, UnquantizedEmbeddingMethod):
                raise EngineUnsupported(
                    f"rank {self.plan.rank}: {module_name!r} ({type(quant_method).__name__}) shares storage with "
                    f"{sorted({n for n, _ in shared})}, which the plan writes, and its processing is not known to be "
                    f"safe to re-run in place: an update would leave its derived weights stale; not supported yet"
                )
            readers[module] = (module_name, sorted({n for n, _ in shared}), sorted({m for _, m in shared}))
        return readers

    def _reprocess_readers(self) -> None:
        """Re-run the processing of every module reading a param this sync wrote (see _modules_reading_written_storage),
        once the written module's new bytes are in the shared kernel tensors and finalize has put the reader's own
        tensors back."""
        for module, (name, params, writers) in self.readers.items():
            if not any(w in self._processed for w in writers):
                continue
            if hasattr(module, "_already_called_process_weights_after_loading"):
                delattr(module, "_already_called_process_weights_after_loading")
            _process_or_defer(module, module.quant_method, self.gemm_used, self.defer_gemm)
            logger.debug("shardplan: re-processed %s (reads %s)", name, params)

    # -- Unpacker protocol --
    def stamp(self) -> str:
        """What the trainers' packer must agree with before any byte moves (shardplan.sync: ApplyUnpacker's, or
        ShardedUnpacker's for sharded trainers)."""
        return self._stamp

    def sizes(self) -> dict[str, int]:
        return dict(self._sizes)

    def receive_targets(self, group: str, spans: list[tuple[int, int]]) -> list[torch.Tensor | None]:
        """Where to receive each message (lo, hi) of a group whose receives are being posted: a view of the param
        where the message is one segment of Applier.in_place_segments and the group's modules could be materialized
        now, else None (the receive buffer). Modules are materialized ahead only in group order (every group posted
        before this one first) and only into the room left in the sync's pool (sized by the last sync: nothing is
        materialized ahead in the first one), so the update holds no more than it did without receiving in place."""
        out: list[torch.Tensor | None] = [None] * len(spans)
        self._posted.append(group)
        if not (self.active and self.receive_in_place and not self.sharded and self._pool_size and spans):
            return out  # (no spans: a group of another pipeline stage, posted with nothing to receive)
        candidates = self.appliers[0].for_group(group).in_place_segments()
        if not any(lo in candidates for lo, _ in spans) or not self._materialize_ahead():
            return out
        offsets, views = set(), []
        for i, (lo, hi) in enumerate(spans):
            name, first, numel = candidates.get(lo, (None, 0, 0))
            view = None if name is None else getattr(*self.targets[name]).detach().view(-1)[first : first + numel]
            message_bytes = hi - lo  # a message is received whole into one view or not at all
            if view is None or (view := view.view(torch.uint8)).numel() != message_bytes:
                continue
            out[i] = view
            offsets.add(lo)
            views.append(view)
            self.in_place_bytes += message_bytes
        self._in_place[group], self._receiving[group] = frozenset(offsets), views
        return out

    def _materialize_ahead(self) -> bool:
        """Materialize the modules of the posted groups not materialized yet, in order, while they fit in the room
        left in the pool; True when every posted group's modules are materialized."""
        from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO

        clock, t0 = self.seconds, time.perf_counter()
        try:
            while self._ahead < len(self._posted):
                group = self._posted[self._ahead]
                at = self._pool_used
                for module in self.group_modules.get(group, ()):
                    if id(module) in self._materialized:
                        continue
                    params, buffers = LAYERWISE_INFO[module].restore_metadata
                    for t in chain(params.values(), buffers.values()):
                        at = align_up(at, 4096) + t.numel() * t.element_size()
                if at > self._pool_size:
                    return False
                if group in self.group_modules:
                    self._materialize(group)
                self._ahead += 1
            return True
        finally:
            clock["materialize"] += time.perf_counter() - t0

    def apply(self, group: str, buffer: torch.Tensor) -> None:
        if not self.active:
            raise EngineUnsupported("bytes arrived outside a weight update (start_weight_update not called)")
        clock = self.seconds
        t0 = time.perf_counter()
        if group in self.group_modules:
            self._materialize(group)
        t1 = time.perf_counter()
        clock["materialize"] += t1 - t0
        # the appliers are bound to meta stand-ins except while they write the materialized params
        for t, base in sharded_bases(self.parts, group, self.alignment).items():
            names = self.group_params[t, group]
            sub = self.appliers[t].for_group(group)
            sub.rebind({n: getattr(*self.targets[n]) for n in names})
            sub.apply(buffer[base : base + self.parts[t].group(group).nbytes], self._in_place.get(group, frozenset()))
            sub.rebind({n: self._meta_params[n] for n in names})  # drop views of them
        for f in self.fallbacks.get(group, ()):
            meta = self.sources[f.name]
            tensor = buffer[f.offset : f.offset + f.nbytes].view(to_dtype(meta.dtype)).view(meta.shape).clone()
            self._load_fallback(f.name, tensor)
        clock["apply"] += time.perf_counter() - t1
        self._receiving.pop(group, None)  # its receives finished; views left would pin the pool (_close)
        for module in self.group_modules.get(group, ()):
            pending = self._pending[module]
            pending.discard(group)
            if not pending:
                self._process(module)
                self._close(module)  # here: no frame of _process holds its materialized tensors any more

    # -- one sync --
    def begin(self) -> None:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        initialize_layerwise_reload(self.model)
        self._pending = {m: set(gs) for m, gs in self.module_groups.items()}
        self._materialized, self._processed, self._open, self._pool_used = set(), set(), set(), 0
        self._pool_size, self._pool_bytes, self.pools_allocated = self._pool_bytes, 0, 0
        if self._pool is not None and (not self.keep_pool or self._pool.numel() != self._pool_size):
            self._pool = None  # the pool kept by the last update (keep_pool), unless unwanted or of another size
        self.seconds, self.process_by_class, self.cpu_seconds = (
            defaultdict(float),
            defaultdict(float),
            defaultdict(float),
        )
        self._posted, self._ahead, self._in_place, self._receiving, self.in_place_bytes = [], 0, {}, {}, 0
        self.active = True

    def end(self, model_config) -> None:
        """Finish the reload whatever happened: layers whose update did not complete get their kernel tensors (the
        weights they held before this sync) back, so the model is whole again, each layer at one version."""
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        if not self.active:
            return
        self.active = False
        self._release_pool()
        # a receive posted into a param and never waited for (the sync failed first) may still land: what it writes
        # into stays alive until a later sync has posted its receives (its transport pairs are re-opened by then: a
        # failure changes this rank's epoch), so it never lands in freed memory
        if self._receiving:
            self._kept = [v for views in self._receiving.values() for v in views]
        elif self._posted:
            self._kept = []
        self._receiving = {}
        for (t, group), names in self.group_params.items():  # no view of a materialized param may outlive the sync
            self.appliers[t].for_group(group).rebind({n: self._meta_params[n] for n in names})
        t0 = time.perf_counter()
        finalize_layerwise_reload(self.model, model_config)
        t1 = time.perf_counter()
        self._reprocess_readers()
        self.seconds["finalize"] += t1 - t0
        self.seconds["readers"] += time.perf_counter() - t1

    def _materialize(self, group: str) -> None:
        from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO
        from vllm.model_executor.model_loader.reload.meta import materialize_layer

        for module in self.group_modules[group]:
            if id(module) not in self._materialized:
                info = LAYERWISE_INFO[module]
                if not info.can_load():
                    raise EngineUnsupported(f"{type(module).__name__} is not set up for reloading (vLLM skips it)")
                materialize_layer(module, info)
                self._place_in_pool(module)
                with torch.no_grad():  # the pool holds the bytes of the modules before this one
                    for attr, spans in self.undefined.get(module, ()):
                        flat = getattr(module, attr).view(-1)  # pre-processing params are contiguous
                        for lo, hi in spans:
                            flat[lo:hi].zero_()
                self._materialized.add(id(module))
                self._open.add(id(module))

    def _place_in_pool(self, module: torch.nn.Module) -> None:
        """Point the module's freshly materialized CPU tensors into the sync's pool, after the other open modules'.
        Fresh storage is untouched memory: writing it page-faults every 4 KiB, which costs more than the write itself;
        the pool is one storage, faulted in by the first modules of a sync and rewritten by every later one (embedding,
        decoder layers, lm_head: one size fits all, so each module's bytes land in mapped memory). Its size is the
        most the open modules took at once in the last sync (one decoder layer, or the vocab shard): the update's
        extra memory. What does not fit (the first modules of the first sync, modules outgrowing it) stays fresh."""
        from vllm.model_executor.model_loader.reload.utils import get_layer_tensors

        with torch.no_grad():
            for tensor in get_layer_tensors(module).values():
                if tensor.is_meta or tensor.device.type != "cpu" or not tensor.is_contiguous():
                    continue
                start = align_up(self._pool_used, 4096)
                self._pool_used = start + tensor.numel() * tensor.element_size()
                self._pool_bytes = max(self._pool_bytes, self._pool_used)
                if self._pool is None and self._pool_size:
                    self._new_pool()
                if self._pool is not None and self._pool_used <= self._pool.numel():
                    size, stride = tensor.size(), tensor.stride()
                    tensor.set_(self._pool.untyped_storage(), start // tensor.element_size(), size, stride)

    def _new_pool(self) -> None:
        self._pool = torch.empty(self._pool_size, dtype=torch.uint8)
        self._pool_uses = torch._C._storage_Use_Count(self._pool.untyped_storage()._cdata)
        self.pools_allocated += 1
        if self.prefault_pool:
            threading.Thread(target=_populate, args=(self._pool,), daemon=True).start()

    def _close(self, module: torch.nn.Module) -> None:
        """The module is processed: once no module is open, the pool is free for the next ones, unless something
        processing left behind still points into it (a closure or attribute holding a view): then that keeps it and
        the next modules get a new one."""
        self._open.discard(id(module))
        if self._open:
            return
        self._pool_used = 0
        if not self._pool_size:  # the first sync: size the pool by the modules so far, for the rest of it
            self._pool_size = self._pool_bytes
        if self._pool is not None and not self._pool_free():
            self._pool = None

    def set_keep_pool(self, keep: bool) -> None:  # this sync's EngineUpdateInfo.keep_pool; a kept pool goes if off
        self.keep_pool, self._pool = keep, self._pool if keep or self._open else None

    def _release_pool(self) -> None:  # end of a sync: kept (keep_pool) only where nothing points into it any more
        keep = self.keep_pool and not self._receiving and not self._open
        self._pool = self._pool if self._pool is not None and keep and self._pool_free() else None

    def _pool_free(self) -> bool:  # nothing but the unpacker points into the pool (no param, closure or view)
        return torch._C._storage_Use_Count(self._pool.untyped_storage()._cdata) <= self._pool_uses

    def _process(self, module: torch.nn.Module) -> None:
        """What vLLM's _layerwise_process does once a layer's loaders have run (we wrote instead of loading)."""
        from vllm.model_executor.layers.quantization.base_config import QuantizeMethodBase
        from vllm.model_executor.model_loader.reload.layerwise import (
            LAYERWISE_INFO,
            _copy_and_restore_kernel_tensors,
            _get_original_loader,
        )
        from vllm.model_executor.model_loader.reload.utils import get_layer_tensors

        clock, t0, c0 = self.seconds, time.perf_counter(), time.thread_time()
        info = LAYERWISE_INFO[module]
        if hasattr(module, "_already_called_process_weights_after_loading"):
            delattr(module, "_already_called_process_weights_after_loading")
        for tensor in get_layer_tensors(module).values():
            tensor.weight_loader = _get_original_loader(tensor)
        quant_method = getattr(module, "quant_method", None)
        prepack = prepack_cpu = 0.0
        if isinstance(quant_method, QuantizeMethodBase):
            _process_or_defer(module, quant_method, self.gemm_used, self.defer_gemm)
            t1, c1 = time.perf_counter(), time.thread_time()
            if self.rerun_moe_prepack:
                _rerun_skipped_moe_prepack(module, quant_method, info)
            prepack, prepack_cpu = time.perf_counter() - t1, time.thread_time() - c1
            clock["moe prepack"] += prepack
            if hasattr(module, "update_param_tp_status"):
                module.update_param_tp_status()
        t1, c1 = time.perf_counter(), time.thread_time()
        if info.kernel_tensors is not None:
            _copy_and_restore_kernel_tensors(module, info)
        info.reset()
        clock["copy into kernel tensors"] += time.perf_counter() - t1
        clock["process"] += t1 - t0 - prepack
        # one OpenMP thread per worker (the CPU recipe, tests/integration/cpu_engine.py): vLLM's kernels' CPU time is
        # this thread's
        cpu = self.cpu_seconds
        cpu["copy into kernel tensors"] += time.thread_time() - c1
        cpu["moe prepack"], cpu["process"] = cpu["moe prepack"] + prepack_cpu, cpu["process"] + c1 - c0 - prepack_cpu
        self.process_by_class[type(module).__name__] += t1 - t0 - prepack
        self._processed.add(id(module))

    def _load_fallback(self, name: str, tensor: torch.Tensor) -> None:
        self.model.load_weights([(name, tensor)])


def _populate(pool: torch.Tensor) -> None:
    """Fault the pool's pages in (Linux's MADV_POPULATE_WRITE, 5.14+) without writing them, so it may run while bytes
    are received into the pool: a fresh page costs more to fault in than to write, and a receive or apply that does it
    has the transfer waiting. Best effort: where the call is refused, the first writes fault the pages in as before."""
    start = pool.data_ptr() // 4096 * 4096
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None).madvise(ctypes.c_void_p(start), ctypes.c_size_t(pool.data_ptr() + pool.numel() - start), 23)


def _process_dropping_old_gemm(module: torch.nn.Module, quant_method) -> None:
    """quant_method.process_weights_after_loading, with an embedding's or lm_head's old CPU GEMM handle dropped first.
    On CPU, UnquantizedEmbeddingMethod's processing builds a oneDNN handle or sgl packed copy of the weight (as big as
    the vocab shard) into `cpu_linear` and keeps `weight`; holding the old handle while the new one is built would
    double that module's memory during the update (the engine is paused: nothing calls it meanwhile). If processing
    fails, the module gets vLLM's own fallback, F.linear over the weight it keeps (finalize restores that weight)."""
    from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod

    if not isinstance(quant_method, UnquantizedEmbeddingMethod) or "cpu_linear" not in module.__dict__:
        quant_method.process_weights_after_loading(module)
        return
    del module.__dict__["cpu_linear"]
    try:
        quant_method.process_weights_after_loading(module)
    finally:
        if "cpu_linear" not in module.__dict__:
            module.cpu_linear = torch.nn.functional.linear


def _builds_cpu_gemm(quant_method) -> bool:
    """Whether processing is exactly UnquantizedEmbeddingMethod's on CPU: nothing but a GEMM handle in `cpu_linear`,
    which only its `apply` (logits) calls; a lookup (`embedding`) reads the weight itself."""
    from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod
    from vllm.platforms import current_platform

    process = type(quant_method).process_weights_after_loading
    return process is UnquantizedEmbeddingMethod.process_weights_after_loading and current_platform.is_cpu()


class DeferredGemm:
    """`cpu_linear` of an embedding or lm_head whose weight an update wrote (UnquantizedEmbeddingMethod on CPU): the
    GEMM handle is built from the module's weight at its first call, which then replaces this object. The handle is
    used by `apply` only (logits), so an input embedding that is only looked up never pays for it, and a module that
    computes logits (an lm_head, Gemma 2's or Command R's embed_tokens) builds it from the weight it holds then, never
    from an earlier one. Modules seen calling it are built at the next update's processing instead (`used`), so a
    sync's time includes what its logits need."""

    def __init__(self, module: torch.nn.Module, quant_method, used: set[int]):
        self.module, self.quant_method, self.used = weakref.ref(module), quant_method, used

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        module = self.module()
        try:
            with torch.inference_mode(False), torch.no_grad():  # a forward runs under inference mode
                _process_dropping_old_gemm(module, self.quant_method)
        except Exception as e:  # noqa: BLE001 - inside a forward: serve with vLLM's F.linear fallback, say why
            logger.warning("shardplan: building the GEMM handle of %s failed (%s); using F.linear", type(module), e)
        self.used.add(id(module))
        return module.cpu_linear(x, weight, bias)


def _process_or_defer(module: torch.nn.Module, quant_method, used: set[int], defer: bool = True) -> None:
    """Process the module, or, for an embedding's GEMM handle no logits call has used yet, drop the old handle and
    leave a DeferredGemm in its place (the old one holds the old weights)."""
    if not defer or id(module) in used or not _builds_cpu_gemm(quant_method):
        _process_dropping_old_gemm(module, quant_method)
        return
    module.__dict__.pop("cpu_linear", None)
    module.cpu_linear = DeferredGemm(module, quant_method, used)


def _rerun_skipped_moe_prepack(module: torch.nn.Module, quant_method, info=None) -> None:
    """vLLM 0.32: on a weight update, UnquantizedFusedMoEMethod._setup_kernel copies the converted weights into the
    layer but skips `moe_kernel.fused_experts.process_weights_after_loading` (the CPU experts' pad + prepack), which
    it runs only on the first load. Run it, as the first load did, so the kernel tensors get the prepacked layout.

    Where that step is exactly CPUUnquantizedExperts' (no zentorch, no intermediate padding), the prepack writes
    straight into the layer's kernel tensors (vLLM's op takes its output), which are then the layer's own: no new
    tensor to allocate and fault in, and no copy into the kernel tensors afterwards."""
    if not _skips_moe_prepack_on_update():
        return
    from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import UnquantizedFusedMoEMethod

    if not isinstance(quant_method, UnquantizedFusedMoEMethod) or getattr(quant_method, "moe_kernel", None) is None:
        return
    if getattr(quant_method.unquantized_backend, "name", "") in ("TPU", "OOT"):
        return  # these return before _setup_kernel: nothing was skipped
    experts = quant_method.moe_kernel.fused_experts
    if info is not None and _prepack_into_kernel_tensors(module, experts, info):
        return
    experts.process_weights_after_loading(module)


def _prepack_into_kernel_tensors(module: torch.nn.Module, experts, info) -> bool:
    """CPUUnquantizedExperts.process_weights_after_loading with the prepack's output the kernel tensors; False
    (nothing done) where the step is not that one."""
    from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts, is_zentorch_moe_supported

    if type(experts).process_weights_after_loading is not CPUUnquantizedExperts.process_weights_after_loading:
        return False
    if info.kernel_tensors is None or not hasattr(torch.ops._C, "prepack_moe_weight"):
        return False
    if experts._padded_intermediate_size(experts.moe_config) != experts.moe_config.intermediate_size_per_partition:
        return False
    if is_zentorch_moe_supported(module):
        return False
    kernel, _ = info.kernel_tensors
    pairs = []
    for name in ("w13_weight", "w2_weight"):
        src, dst = getattr(module, name), kernel.get(name)
        if dst is None or dst.shape != src.shape or dst.dtype != src.dtype or not dst.is_contiguous():
            return False
        pairs.append((name, src, dst))
    experts._use_zentorch = False
    with torch.no_grad():
        for name, src, dst in pairs:
            torch.ops._C.prepack_moe_weight(src.contiguous(), dst.data, experts.isa)
            setattr(module, name, dst)  # the kernel tensor itself: the copy into it afterwards is a no-op
    return True
