"""Issue 25 item 5 probe: box-copy kernel variants (program size, inner tile, warps, big contiguous pairs kept as torch
copies) against the plain graph and a same-run copy of the same bytes, pack and apply, one process, interleaved."""

import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from replay_bench import interleaved_medians, kimi_k2_layer, llama70b_layer, make_tensors, traffic  # noqa: E402

from shardplan.runtime import copykernel as ck  # noqa: E402
from shardplan.runtime.apply import Applier, params_from_plan  # noqa: E402
from shardplan.runtime.replay import Replayer  # noqa: E402

BASE = dict(BLOCK=1024, TILE=256, NUM_WARPS=4)
VARIANTS = {
    "b1024t256": {},
    "b256t256": dict(BLOCK=256),
    "b2048t256": dict(BLOCK=2048),
    "b1024t512": dict(TILE=512),
    "b1024t128": dict(TILE=128),
    "b512t128": dict(BLOCK=512, TILE=128),
    "b2048t512w8": dict(BLOCK=2048, TILE=512, NUM_WARPS=8),
}
ONLY = os.environ.get("VARIANTS")
if ONLY:
    VARIANTS = {k: v for k, v in VARIANTS.items() if k in ONLY.split(",")}


def configure(cfg):
    c = {**BASE, **cfg}
    ck.BLOCK, ck.TILE, ck.NUM_WARPS = c["BLOCK"], c["TILE"], c["NUM_WARPS"]


def same_bytes(params, want):
    return all(torch.equal(t.view(-1).view(torch.uint8), want[n].view(-1).view(torch.uint8)) for n, t in params.items())


def run_case(label, builder, iters):
    t0 = time.time()
    plan = builder.plan()
    tensors = make_tensors(builder.sources, "cuda")
    replayer = Replayer(plan, builder.sources)
    pack_bytes, apply_bytes = traffic(replayer)
    params = params_from_plan(plan, "cuda", fill=float("nan"))
    eager = replayer.bind(tensors, cuda_graph=False)
    ref = eager.pack(check=False).clone()
    Applier(plan, replayer.layout, params, cuda_graph=False).apply(ref)
    want = {n: t.clone() for n, t in params.items()}
    configure({})
    fns = {}
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda").random_()
    dst = torch.empty_like(src)
    same = {
        k: torch.empty(n // 2, dtype=torch.uint8, device="cuda").random_()
        for k, n in (("pack", pack_bytes), ("apply", apply_bytes))
    }
    same_dst = {k: torch.empty_like(v) for k, v in same.items()}
    fns["ceiling"] = lambda: dst.copy_(src)
    fns["copy-pack"] = lambda: same_dst["pack"].copy_(same["pack"])
    fns["copy-apply"] = lambda: same_dst["apply"].copy_(same["apply"])
    g = replayer.bind(tensors, cuda_graph=True, box_copy=False)
    assert torch.equal(g.pack(check=False), ref)
    fns["pack graph"] = lambda g=g: g.pack(check=False)
    ga = Applier(plan, replayer.layout, params, cuda_graph=True, box_copy=False)
    ga.apply(ref)
    fns["apply graph"] = lambda a=ga: a.apply(ref)
    info = {}
    for name, cfg in VARIANTS.items():
        configure(cfg)
        b = replayer.bind(tensors, cuda_graph=True, box_copy=True)
        assert b.box_copy_error is None, b.box_copy_error
        b.out.fill_(0xAB)
        if not torch.equal(b.pack(check=False), ref):
            raise SystemExit(f"MISMATCH pack {label} {name}")
        a = Applier(plan, replayer.layout, params, cuda_graph=True, box_copy=True)
        for t in params.values():
            t.view(-1).view(torch.uint8).fill_(0xFF)
        a.apply(ref)
        assert a.box_copy_error is None, a.box_copy_error
        if not same_bytes(params, want):
            raise SystemExit(f"MISMATCH apply {label} {name}")
        info[name] = [op.label for op in b._graph_ops]
        fns[f"pack {name}"] = lambda b=b: b.pack(check=False)
        fns[f"apply {name}"] = lambda a=a: a.apply(ref)
    configure({})
    setup = time.time() - t0
    sec = interleaved_medians(fns, "cuda", iters)
    rate = 2 * src.numel() / sec["ceiling"]
    print(
        f"## {label}: pack {pack_bytes / 1e6:.1f} MB, apply {apply_bytes / 1e6:.1f} MB moved; "
        f"ceiling {rate / 1e9:.0f} GB/s; "
        f"copy-pack {sec['copy-pack'] * 1e6:.1f} us, copy-apply {sec['copy-apply'] * 1e6:.1f} us; setup {setup:.0f} s",
        flush=True,
    )
    for k, s in sec.items():
        if k.startswith(("pack", "apply")):
            n = pack_bytes if k.startswith("pack") else apply_bytes
            ref_s = sec["copy-pack" if k.startswith("pack") else "copy-apply"]
            print(
                f"   {k:<26} {s * 1e6:9.1f} us  {100 * n / s / rate:5.1f}% of copy  {100 * ref_s / s:5.1f}% of same",
                flush=True,
            )
    for name, labels in info.items():
        print(f"#  {name}: pack graph ops {labels[:4]}{' ...' if len(labels) > 4 else ''}", flush=True)


def main():
    iters = int(os.environ.get("ITERS", "20"))
    cases = os.environ.get("CASES", "llama,kimi,kimi-ep").split(",")
    table = {
        "llama": ("llama-3.1-70b layer, TP8 rank 0", llama70b_layer),
        "kimi": ("kimi-k2 layer 1, TP32 rank 0, 384E", lambda: kimi_k2_layer(num_experts=384)),
        "kimi-ep": ("kimi-k2 layer 1, TP32+EP rank 0", lambda: kimi_k2_layer(ep=True)),
    }
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}; medians of {iters}, interleaved", flush=True)
    for c in cases:
        run_case(table[c][0], table[c][1](), iters)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
