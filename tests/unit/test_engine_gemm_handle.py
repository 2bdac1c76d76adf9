"""An update re-processes an embedding or lm_head (vLLM's UnquantizedEmbeddingMethod: on CPU a oneDNN handle or sgl
packed copy of the whole vocab shard in `cpu_linear`) with the old handle already released, so the update never holds
two copies of it (shardplan.engine.reload; the live engines are tests/integration/test_engine_tied.py)."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod

from shardplan.engine.reload import _process_dropping_old_gemm


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
