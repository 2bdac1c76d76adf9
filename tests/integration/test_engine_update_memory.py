"""What an engine update holds beyond the model (shardplan.engine.reload; the live engines that prove the tokens are
tests/integration/test_engine*.py):

* an embedding or lm_head (vLLM's UnquantizedEmbeddingMethod: on CPU a oneDNN handle or sgl packed copy of the whole
  vocab shard in `cpu_linear`) is re-processed with its old handle already released, never two copies at once;
* materialized modules share one pool per sync, reused once the modules before are processed, and given up when
  something processing left behind still points into it."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod

from shardplan.engine.reload import ReloadUnpacker, _process_dropping_old_gemm


class Handle:
    """Stands in for the oneDNN handle a `cpu_linear` closure keeps alive."""


class Recording(UnquantizedEmbeddingMethod):
    def __init__(self, old: weakref.ref, fail: bool = False):
        super().__init__()
        self.old, self.fail, self.old_alive_while_building = old, fail, None

    def process_weights_after_loading(self, layer):
        gc.collect()
        self.old_alive_while_building = self.old() is not None
        if self.fail:
            raise RuntimeError("processing failed")
        handle = Handle()
        layer.cpu_linear = lambda x, weight, bias, _h=handle: torch.nn.functional.linear(x, weight, bias)


def _module_with_handle():
    module = torch.nn.Module()
    module.weight = torch.nn.Parameter(torch.randn(8, 4), requires_grad=False)
    handle = Handle()
    module.cpu_linear = lambda x, weight, bias, _h=handle: torch.nn.functional.linear(x, weight, bias)
    return module, weakref.ref(handle)


def test_the_old_gemm_handle_is_released_before_the_new_one_is_built():
    module, old = _module_with_handle()
    method = Recording(old)
    _process_dropping_old_gemm(module, method)
    assert method.old_alive_while_building is False
    assert "cpu_linear" in module.__dict__ and old() is None


def test_a_failed_processing_leaves_vllms_f_linear_fallback_over_the_kept_weight():
    module, old = _module_with_handle()
    with pytest.raises(RuntimeError, match="processing failed"):
        _process_dropping_old_gemm(module, Recording(old, fail=True))
    x = torch.randn(3, 4)
    assert module.cpu_linear is torch.nn.functional.linear
    assert torch.equal(module.cpu_linear(x, module.weight, None), x @ module.weight.t())


def _pool_unpacker(pool_bytes: int) -> ReloadUnpacker:
    """The pool's state as begin() leaves it, the last sync having needed `pool_bytes` (no model or plan needed)."""
    unpacker = ReloadUnpacker.__new__(ReloadUnpacker)
    unpacker._open, unpacker._pool, unpacker._pool_used, unpacker._pool_uses = set(), None, 0, 0
    unpacker._pool_size, unpacker._pool_bytes, unpacker.pools_allocated = pool_bytes, 0, 0
    unpacker.prefault_pool, unpacker.keep_pool, unpacker._receiving = True, False, {}
    return unpacker


def _materialized(*shapes):
    module = torch.nn.Module()
    for i, shape in enumerate(shapes):
        module.register_parameter(f"w{i}", torch.nn.Parameter(torch.empty(shape), requires_grad=False))
    return module


def _processed(module):
    """What processing does to a module: its params become the kernel tensors (the materialized ones are dropped)."""
    for name, _ in list(module.named_parameters()):
        setattr(module, name, torch.nn.Parameter(torch.zeros(1), requires_grad=False))


def test_modules_reuse_one_pool_and_what_does_not_fit_stays_fresh():
    unpacker = _pool_unpacker(64 << 10)
    first = _materialized((1024, 4), (1000,))
    unpacker._place_in_pool(first)
    pool = unpacker._pool.untyped_storage().data_ptr()
    assert [p.untyped_storage().data_ptr() for p in first.parameters()] == [pool, pool]
    assert first.w1.storage_offset() * 4 == 16 << 10  # after w0, 4 KiB-aligned
    unpacker._open.add(id(first))
    _processed(first)
    unpacker._close(first)
    second = _materialized((16 << 10,), (8,))  # w0 takes the whole pool: w1 gets fresh storage
    unpacker._place_in_pool(second)
    assert second.w0.untyped_storage().data_ptr() == pool and second.w1.untyped_storage().data_ptr() != pool
    assert (
        unpacker.pools_allocated == 1 and unpacker._pool_bytes == (64 << 10) + 32
    )  # what the next sync sizes its pool by


def test_a_pool_something_still_points_into_is_given_up():
    unpacker = _pool_unpacker(16 << 10)
    module = _materialized((1024,))
    unpacker._place_in_pool(module)
    unpacker._open.add(id(module))
    kept = module.w0[:10]  # e.g. a closure processing left holding a view of the materialized weight
    _processed(module)
    unpacker._close(module)
    assert unpacker._pool is None
    again = _materialized((1024,))
    unpacker._place_in_pool(again)
    assert again.w0.untyped_storage().data_ptr() != kept.untyped_storage().data_ptr()
    assert unpacker.pools_allocated == 2


def _one_sync(unpacker, keep: bool, *, leave_view: bool = False):
    """One sync's use of the pool as far as keep_pool goes: a module placed, processed, closed; the end of the sync."""
    unpacker.pools_allocated = 0
    unpacker.set_keep_pool(keep)
    module = _materialized((1024,))
    unpacker._place_in_pool(module)
    unpacker._open.add(id(module))
    view = module.w0[:10] if leave_view else None
    _processed(module)
    unpacker._close(module)
    unpacker._release_pool()
    return module, view


def test_keep_pool_keeps_the_faulted_in_pool_for_the_next_sync_and_only_then():
    unpacker = _pool_unpacker(16 << 10)
    _one_sync(unpacker, keep=True)
    pool = unpacker._pool
    assert pool is not None and unpacker.pools_allocated == 1
    module, _ = _one_sync(unpacker, keep=True)  # the next sync places its modules in the same pool, allocating none
    assert unpacker._pool is pool and unpacker.pools_allocated == 0
    _one_sync(unpacker, keep=False)  # a sync without keep_pool gives the kept pool back and keeps none
    assert unpacker._pool is None and unpacker.pools_allocated == 1
    _one_sync(unpacker, keep=True)
    _, view = _one_sync(unpacker, keep=True, leave_view=True)  # something still points into it: given back
    assert unpacker._pool is None and view is not None


def test_faulting_the_pool_in_never_changes_bytes_already_received():
    """The pool is faulted in by a thread while receives land in it (_populate: MADV_POPULATE_WRITE): what arrived
    before or meanwhile stays as it is."""
    from shardplan.engine.reload import _populate

    pool = torch.empty(64 << 20, dtype=torch.uint8)
    arrived = torch.randint(0, 256, (3 << 20,), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    pool[5 << 20 : 8 << 20] = arrived  # a receive that landed first (partly faulting pages in itself)
    _populate(pool)
    assert torch.equal(pool[5 << 20 : 8 << 20], arrived)
