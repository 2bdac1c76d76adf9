"""The box-copy kernel (runtime/copykernel.py) that the CUDA-graph pack and apply replay: on random strided view pairs
(slices, transposes, broadcast reads, every element width, odd offsets) bit for bit a torch copy, and one decoder layer
of shipped plans packed and applied through it bit for bit the reference interpreter. On a CPU dry run the kernel's
tables run through `BoxCopy.run_reference` instead."""

from __future__ import annotations

import pytest
import torch
from gpu_cases import DEVICE, LAYER, NAN, ON_GPU, PLANS, Layer, assert_bits_equal, gpu_tier, reference, trainer_tensors
from hypothesis import given, settings
from hypothesis import strategies as st

from shardplan.plan.file.format import PlanFile
from shardplan.runtime.apply import Applier, params_from_plan
from shardplan.runtime.copykernel import BoxCopy, split
from shardplan.runtime.replay import Replayer

pytestmark = gpu_tier
DTYPES = [torch.uint8, torch.int16, torch.bfloat16, torch.float32, torch.int64]


def _run(pairs) -> BoxCopy:
    mine, rest = split(pairs)
    for d, s in rest:
        d.copy_(s)
    copy = BoxCopy(mine, block=64, tile=16)  # small programs of 4 steps: many per box, rows cut mid-way
    copy.launch() if ON_GPU else copy.run_reference()
    return copy


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_random_view_pairs_copy_like_torch(data):
    dtype = data.draw(st.sampled_from(DTYPES), label="dtype")
    pairs, want = [], []
    src = torch.randint(0, 120, (4096 * 8,), dtype=torch.uint8, device=DEVICE).view(dtype)
    dst_bytes = torch.full((4096 * 8,), 0xFF, dtype=torch.uint8, device=DEVICE)  # source bytes are < 120
    dst = dst_bytes.view(dtype)
    covered = torch.zeros(len(dst), dtype=torch.bool)
    at = 0
    for _ in range(data.draw(st.integers(1, 5), label="pairs")):
        ndim = data.draw(st.integers(1, 3), label="ndim")
        sizes = [data.draw(st.integers(1, 9), label="size") for _ in range(ndim)]
        numel = 1
        for n in sizes:
            numel *= n
        # the source: a slice of a bigger row-major box, optionally transposed or broadcast along one dim
        pad = [data.draw(st.integers(0, 3), label="pad") for _ in range(ndim)]
        big = [n + p for n, p in zip(sizes, pad)]
        start = data.draw(st.integers(0, 40), label="src offset")
        view = src[start : start + _numel(big)].view(big)
        view = view[tuple(slice(0, n) for n in sizes)]
        how = data.draw(st.sampled_from(["plain", "transpose", "broadcast"]), label="read")
        if how == "transpose" and ndim > 1:
            view = view.transpose(-1, -2).contiguous().transpose(-1, -2)[tuple(slice(0, n) for n in sizes)]
        elif how == "broadcast":
            d = data.draw(st.integers(0, ndim - 1), label="broadcast dim")
            view = view.narrow(d, 0, 1).expand(sizes)
        at += data.draw(st.integers(0, 9), label="dst gap")
        out = dst[at : at + numel].view(sizes)
        covered[at : at + numel] = True
        at += numel
        pairs.append((out, view))
        want.append(view.clone())
    _run(pairs)
    for (out, _), w in zip(pairs, want):
        assert torch.equal(out.cpu(), w.cpu())
    untouched = dst_bytes.cpu().view(-1, dtype.itemsize)[~covered]
    assert bool((untouched == 0xFF).all()), "the kernel wrote outside its destinations"


def _numel(sizes) -> int:
    n = 1
    for s in sizes:
        n *= s
    return n


@pytest.mark.parametrize(
    "name,rank",
    [
        ("llama-3.1-70b--tp8--bfloat16.plan", 3),
        ("kimi-k2--tp32--bfloat16.plan", 5),
        ("qwen3-30b-a3b--tp4--bfloat16.plan", 1),
    ],
)
def test_layer_through_box_copy_bitwise(name, rank):
    if not (PLANS / name).exists():
        pytest.fail(f"{name} is not in plans/ (the shipped plans changed: pick another)")
    layer = Layer(PlanFile.read(PLANS / name), rank, LAYER)
    tensors = trainer_tensors(layer.sources, None, DEVICE, seed=rank)
    want = reference(layer.plan, layer.sources, tensors, None)
    replayer = Replayer(layer.plan, layer.sources, device=DEVICE)
    if ON_GPU:
        bound = replayer.bind(tensors, cuda_graph=True, box_copy=True)
        assert bound.box_copy is not None, bound.box_copy_error
        bound.out.fill_(0xFF)
        buffer = bound.pack()
    else:  # the tables the kernel would run, through torch
        bound = replayer.bind(tensors, cuda_graph=False)
        buffer = bound.out
        _run([p for op in bound._ops for p in getattr(op, "pairs", ())])
        for op in bound._eager_ops:
            op()
    params = params_from_plan(layer.plan, DEVICE, fill=NAN)
    applier = Applier(layer.plan, replayer.layout, params, cuda_graph=ON_GPU, box_copy=True)
    applier.apply(buffer)
    assert applier.box_copy_error is None, applier.box_copy_error
    assert_bits_equal(params, want, f"{name} rank {rank} layer {LAYER} through the box copy")


@pytest.mark.skipif(not ON_GPU, reason="CUDA graphs need CUDA")
@pytest.mark.parametrize("box_copy", [True, False], ids=["box", "torch-copies"])
def test_graphs_outlive_the_memory_they_address(box_copy):
    """The captured graphs address the box-copy tables and views by raw pointer: after bind and the first apply, the
    freed memory of anything they did not keep would be handed to the next allocations (here zero-filled tensors of
    every small size), and a replay would copy nothing (a zero table row) or from elsewhere."""
    name, rank = "llama-3.1-8b--tp2--bfloat16.plan", 1
    layer = Layer(PlanFile.read(PLANS / name), rank, LAYER)
    tensors = trainer_tensors(layer.sources, None, DEVICE, seed=rank)
    want = reference(layer.plan, layer.sources, tensors, None)
    replayer = Replayer(layer.plan, layer.sources, device=DEVICE)
    bound = replayer.bind(tensors, cuda_graph=True, box_copy=box_copy)
    params = params_from_plan(layer.plan, DEVICE, fill=NAN)
    applier = Applier(layer.plan, replayer.layout, params, cuda_graph=True, box_copy=box_copy)
    applier.apply(bound.pack())
    churn = [torch.zeros(512 * k, dtype=torch.uint8, device=DEVICE) for k in range(1, 4097)]
    for t in params.values():
        t.fill_(NAN)
    bound.out.fill_(0)
    applier.apply(bound.pack())
    assert_bits_equal(params, want, f"{name} rank {rank} layer {LAYER}: graphs replayed after the memory churn")
    del churn


@pytest.mark.skipif(not ON_GPU, reason="CUDA graphs need CUDA")
def test_graphs_copy_through_the_box_copy_by_default():
    """bind() and Applier() on CUDA replay the box copy unless told not to (it is the faster graph in every
    replay_bench case, docs/benchmarks.md); box_copy=False keeps the torch copies."""
    name, rank = "llama-3.1-8b--tp2--bfloat16.plan", 1
    layer = Layer(PlanFile.read(PLANS / name), rank, LAYER)
    tensors = trainer_tensors(layer.sources, None, DEVICE, seed=rank)
    replayer = Replayer(layer.plan, layer.sources, device=DEVICE)
    assert replayer.bind(tensors).box_copy is not None
    assert replayer.bind(tensors, box_copy=False).box_copy is None
    params = params_from_plan(layer.plan, DEVICE, fill=NAN)
    buffer = replayer.bind(tensors).pack()
    for box_copy, want in ((None, True), (False, False)):
        applier = Applier(layer.plan, replayer.layout, params, **({} if box_copy is None else {"box_copy": box_copy}))
        applier.apply(buffer)
        (replay,) = next(iter(applier._bound.values()))
        ops = [op for step in replay.__defaults__[1] for op in step]
        assert any(hasattr(op, "box_copy") for op in ops) == want, [getattr(op, "label", op) for op in ops]
