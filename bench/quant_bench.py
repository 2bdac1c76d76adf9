"""The quantizing pack on the GPU: a Kimi-K2 TP16+EP layer's rank boxes (default 12 experts of [4096, 7168] bf16,
stacked as the trainer holds them) block-quantized to fp8 e4m3 + float32 scales (128 x 128 blocks) in ONE pass,
written into one packed uint8 buffer, next to the same-run device copy bandwidth.

Both figures count bytes read + bytes written: the copy moves 2 x 2N bytes (bf16 in, bf16 out); the quantizer reads 2N
and writes N + 4N/16384. Bar (issue 18): the quantizer's bandwidth >= 85% of the copy's.

Variants: "eager" (runtime.quantize.quantize_blocks, several kernels), "compiled" (the same math under torch.compile,
writing into the buffer views), "triton" (one fused kernel, one program per block; only when triton imports).
Every variant is first checked bitwise against the CPU reference quantizer (`shardplan.runtime.quantize.
quantize_blocks`, = vLLM's per_block_cast_to_fp8) on experts 0 and E-1, with NaN-poisoned outputs. Timing: CUDA events,
warm-up, median of --repeat runs, inputs rotated between two sets so L2 cannot hold them.

    python bench/quant_bench.py [--experts 12 --rows 4096 --cols 7168 --repeat 20]   (writes bench/results/ or $OUT)

Measured 2026-12-01 on one H200 (torch 2.11.0+cu130, triton 3.6.0), bench/results/quant_bench-20261201-060752.json:
copy 0.339 ms = 4152 GB/s; triton 0.293 ms = 3602 GB/s = 87% of copy (an earlier run: 89%), bitwise equal to the CPU
reference; eager torch 4.5 ms = 6%. The first run (quant_bench-20261201-060511.json) found eager torch on CUDA NOT
bitwise equal to the CPU reference: CUDA computes `tensor / 448.0` as a multiply by the reciprocal (1 ulp off in ~45%
of blocks), hence runtime.quantize.exact_div. "compiled" does not compile (inductor: input mutation of views with a
different dtype, the uint8 buffer views).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from shardplan.runtime.quantize import AMAX_FLOOR, E4M3_MAX, exact_div, quantize_blocks  # noqa: E402

BLOCK = 128


def quantize_into(x: torch.Tensor, q_out: torch.Tensor, s_out: torch.Tensor) -> None:
    """x [E, R, C] (R, C multiples of 128) -> q_out fp8 [E, R, C], s_out f32 [E, R/128, C/128]; the reference math."""
    e, r, c = x.shape
    blocks = x.view(e, r // BLOCK, BLOCK, c // BLOCK, BLOCK)
    amax = blocks.abs().float().amax(dim=(2, 4), keepdim=True).clamp(AMAX_FLOOR)
    scale = exact_div(amax, E4M3_MAX)
    q_out.copy_((blocks * (1.0 / scale)).to(torch.float8_e4m3fn).view(e, r, c))
    s_out.copy_(scale.view(e, r // BLOCK, c // BLOCK))


def triton_quantizer():
    try:
        import triton
        import triton.language as tl
    except Exception as exc:  # optional: the bench still runs eager and compiled
        return None, f"{type(exc).__name__}: {exc}"

    @triton.jit
    def _kernel(x_ptr, q_ptr, s_ptr, R, C, NBR, NBC, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
        pid = tl.program_id(0)
        per_expert = NBR * NBC
        e = pid // per_expert
        rem = pid % per_expert
        br = rem // NBC
        bc = rem % NBC
        rows = br * BLOCK_R + tl.arange(0, BLOCK_R)
        cols = bc * BLOCK_C + tl.arange(0, BLOCK_C)
        offs = e.to(tl.int64) * R * C + rows[:, None].to(tl.int64) * C + cols[None, :]
        x = tl.load(x_ptr + offs).to(tl.float32)
        amax = tl.maximum(tl.max(tl.max(tl.abs(x), axis=1), axis=0), 1e-4)
        scale = tl.math.div_rn(amax, 448.0)           # IEEE division, as torch's
        inv = tl.math.div_rn(1.0, scale)
        tl.store(q_ptr + offs, (x * inv).to(tl.float8e4nv))
        tl.store(s_ptr + pid, scale)

    def run(x, q_out, s_out):
        e, r, c = x.shape
        grid = (e * (r // BLOCK) * (c // BLOCK),)
        _kernel[grid](x, q_out, s_out, r, c, r // BLOCK, c // BLOCK, BLOCK_R=BLOCK, BLOCK_C=BLOCK, num_warps=8)
    return run, ""


def median_ms(fn, inputs, repeat: int) -> float:
    for i in range(3):
        fn(inputs[i % len(inputs)])
    torch.cuda.synchronize()
    times = []
    for i in range(repeat):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn(inputs[i % len(inputs)])
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--experts", type=int, default=12)
    ap.add_argument("--rows", type=int, default=4096)
    ap.add_argument("--cols", type=int, default=7168)
    ap.add_argument("--repeat", type=int, default=20)
    args = ap.parse_args()
    assert torch.cuda.is_available(), "this benchmark needs a CUDA GPU"
    dev = torch.device("cuda")
    e, r, c = args.experts, args.rows, args.cols
    n = e * r * c
    nscale = e * (r // BLOCK) * (c // BLOCK)
    # two input sets (rotated) of varied magnitude per block: never zeros
    inputs = [(torch.randn(e, r, c, device=dev) * torch.rand(e, r // BLOCK, 1, c // BLOCK, 1, device=dev)
               .expand(e, r // BLOCK, BLOCK, c // BLOCK, BLOCK).reshape(e, r, c) * 4).bfloat16() for _ in range(2)]
    # the packed buffer: fp8 bytes then the scales (16-byte aligned), as one rank's group
    scale_off = (n + 15) // 16 * 16
    buffer = torch.empty(scale_off + nscale * 4, dtype=torch.uint8, device=dev)
    q_out = buffer[:n].view(torch.float8_e4m3fn).view(e, r, c)
    s_out = buffer[scale_off:].view(torch.float32).view(e, r // BLOCK, c // BLOCK)
    copy_dst = torch.empty_like(inputs[0])

    variants = {"eager": quantize_into, "compiled": torch.compile(quantize_into, fullgraph=True, dynamic=False)}
    tri, tri_error = triton_quantizer()
    if tri is not None:
        variants["triton"] = tri

    # correctness: bitwise vs the CPU reference on the first and last expert, outputs poisoned first
    checks = {}
    for name, fn in list(variants.items()):
        buffer.fill_(0xFF)   # 0xFF: fp8 NaN, and a NaN float32 pattern
        try:
            fn(inputs[1], q_out, s_out)
            torch.cuda.synchronize()
            ok = True
            for k in (0, e - 1):
                ref_q, ref_s = quantize_blocks(inputs[1][k].cpu(), (BLOCK, BLOCK))
                ok &= torch.equal(q_out[k].cpu().view(torch.uint8), ref_q.view(torch.uint8))
                ok &= torch.equal(s_out[k].cpu().view(torch.int32), ref_s.contiguous().view(torch.int32))
            checks[name] = "bitwise ok" if ok else "MISMATCH"
        except Exception as exc:
            checks[name] = f"failed: {type(exc).__name__}: {str(exc)[:300]}"
        if checks[name] != "bitwise ok":
            variants.pop(name)

    copy_bytes = 2 * 2 * n
    quant_bytes = 2 * n + n + 4 * nscale
    results = {"shape": [e, r, c], "device": torch.cuda.get_device_name(), "torch": torch.__version__,
               "checks": checks, "triton_error": tri_error, "repeat": args.repeat}
    copy_ms = median_ms(lambda x: copy_dst.copy_(x), inputs, args.repeat)
    copy_ms_again = median_ms(lambda x: copy_dst.copy_(x), inputs, args.repeat)
    results["copy"] = {"ms": copy_ms, "ms_again": copy_ms_again, "GBps": copy_bytes / copy_ms / 1e6}
    for name, fn in variants.items():
        ms = median_ms(lambda x, fn=fn: fn(x, q_out, s_out), inputs, args.repeat)
        ms_again = median_ms(lambda x, fn=fn: fn(x, q_out, s_out), inputs, args.repeat)
        gbps = quant_bytes / ms / 1e6
        results[name] = {"ms": ms, "ms_again": ms_again, "GBps": gbps, "of_copy": gbps / results["copy"]["GBps"]}

    out_dir = Path(os.environ.get("OUT") or Path(__file__).parent / "results")
    out_dir.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    (out_dir / f"quant_bench-{stamp}.json").write_text(json.dumps(results, indent=2))
    print(f"{results['device']}  torch {torch.__version__}  {e} x [{r}, {c}] bf16 -> fp8 e4m3 + f32 scales "
          f"(128x128), bytes read+written")
    print(f"checks vs CPU reference: {checks}" + (f"  (triton: {tri_error})" if tri_error else ""))
    print(f"{'variant':10} {'ms':>8} {'again':>8} {'GB/s':>8} {'of copy':>8}")
    print(f"{'copy':10} {copy_ms:8.3f} {copy_ms_again:8.3f} {results['copy']['GBps']:8.0f} {'100%':>8}")
    for name in variants:
        v = results[name]
        print(f"{name:10} {v['ms']:8.3f} {v['ms_again']:8.3f} {v['GBps']:8.0f} {v['of_copy']:8.0%}")


if __name__ == "__main__":
    main()
