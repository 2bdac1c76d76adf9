"""An embedding's or lm_head's CPU GEMM handle after an update (shardplan.engine.reload.DeferredGemm): never stale,
never built for a module that is only looked up.

vLLM's UnquantizedEmbeddingMethod builds, at processing, a handle holding a copy of the weight (oneDNN or sgl) that
only `apply` (logits) calls. Here the handle is vLLM's own processing with the copy made explicit (a clone of the
weight, as a packed copy holds), so the tests do not depend on the CPU's instructions; the live engines
(tests/integration/test_engine_tied.py) run the real oneDNN and sgl handles."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from vllm.model_executor.layers import utils as vllm_layer_utils
from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod

from shardplan.engine.reload import DeferredGemm, _process_or_defer


class Handle:
    """What a packed copy keeps alive."""


@pytest.fixture
def builds(monkeypatch) -> list[torch.Tensor]:
    """vLLM's CPU GEMM dispatch with a packed copy on any CPU: the handle computes with a clone of the weight taken
    when it was built. Returns the weights each build copied."""
    built = []

    def dispatch(layer, remove_weight):
        copy, handle = layer.weight.detach().clone(), Handle()
        built.append(copy)
        layer.cpu_linear = lambda x, weight, bias, _h=handle: torch.nn.functional.linear(x, copy, bias)

    monkeypatch.setattr(vllm_layer_utils, "dispatch_cpu_unquantized_gemm", dispatch)
    return built


def _embedding(seed: int) -> tuple[torch.nn.Module, UnquantizedEmbeddingMethod]:
    module, method = torch.nn.Module(), UnquantizedEmbeddingMethod()
    module.weight = torch.nn.Parameter(_weight(seed), requires_grad=False)
    method.process_weights_after_loading(module)  # as the engine's first load left it
    return module, method


def _weight(seed: int) -> torch.Tensor:
    return torch.randn(64, 16, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)


def _update(module: torch.nn.Module, method, used: set[int], seed: int) -> None:
    """One update of the module as ReloadUnpacker does it: processing (or deferring) over the new weight, which
    then lands in the kernel tensor the module keeps."""
    new = _weight(seed)
    module.weight.data.copy_(new)
    _process_or_defer(module, method, used)


def _logits(module, method) -> torch.Tensor:
    x = torch.randn(3, 16, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    with torch.inference_mode():  # as a forward runs
        return method.apply(module, x), torch.nn.functional.linear(x, module.weight)


def test_logits_after_every_update_use_the_weight_the_module_holds(builds):
    """Fails if any handle used for logits was built from an earlier weight (e.g. the embedding's processing simply
    skipped at an update)."""
    module, method = _embedding(1)
    used: set[int] = set()
    for seed in (2, 3, 4):
        _update(module, method, used, seed)
        got, want = _logits(module, method)
        assert torch.equal(got, want), f"update {seed - 1}: logits from a stale GEMM handle"
        assert torch.equal(builds[-1], module.weight)


def test_a_module_only_looked_up_never_builds_its_handle(builds):
    module, method = _embedding(1)
    used: set[int] = set()
    for seed in (2, 3):
        _update(module, method, used, seed)
        ids = torch.tensor([0, 5, 63])
        assert torch.equal(method.embedding(module, ids), module.weight[ids])
    assert len(builds) == 1 and isinstance(module.cpu_linear, DeferredGemm) and not used  # the engine's first load


def test_the_old_handle_is_dropped_when_the_build_is_deferred(builds):
    module, method = _embedding(1)
    old = weakref.ref(module.cpu_linear.__defaults__[0])
    _update(module, method, set(), 2)
    gc.collect()
    assert old() is None


def test_a_module_seen_computing_logits_is_built_at_the_next_update(builds):
    """The handle a sync's logits need is built within that sync, not by the first request after it."""
    module, method = _embedding(1)
    used: set[int] = set()
    _update(module, method, used, 2)
    _logits(module, method)  # builds it: a logits module
    assert used == {id(module)} and len(builds) == 2
    _update(module, method, used, 3)
    assert len(builds) == 3 and not isinstance(module.cpu_linear, DeferredGemm)
    assert torch.equal(builds[-1], module.weight)


def test_other_quantization_methods_are_processed_at_once(builds):
    class Repacking(UnquantizedEmbeddingMethod):
        def process_weights_after_loading(self, layer):
            layer.repacked = layer.weight.detach().clone()

    module, method = torch.nn.Module(), Repacking()
    module.weight = torch.nn.Parameter(_weight(1), requires_grad=False)
    _process_or_defer(module, method, set())
    assert torch.equal(module.repacked, module.weight) and "cpu_linear" not in module.__dict__


def test_a_failed_build_in_a_forward_serves_the_logits_with_f_linear(builds, monkeypatch):
    module, method = _embedding(1)
    _update(module, method, set(), 2)

    def failing(layer, remove_weight):
        raise RuntimeError("oneDNN could not build the primitive")

    monkeypatch.setattr(vllm_layer_utils, "dispatch_cpu_unquantized_gemm", failing)
    got, want = _logits(module, method)
    assert torch.equal(got, want) and module.cpu_linear is torch.nn.functional.linear
