"""Test-only stand-in for sgl-kernel's CPU ops (used by tests/sglang's live-engine test only, never shipped to users).

SGLang's CPU engine (SGLANG_USE_CPU_ENGINE=1) imports `*_cpu` ops from the CPU build of sgl-kernel, and PyPI's
`sglang-kernel` wheel is CUDA-only (building the CPU extension from source is long on 2 cores). A tiny dense model
needs one of them to serve: `assign_req_to_token_pool_cpu`, here in pure torch. Any other op raises when called,
naming itself, so a test can never pass on a silently wrong kernel.
"""

__version__ = "0.0.0+shardplan-test-shim"


def assign_req_to_token_pool_cpu(req_pool_indices, req_to_token, start_offset, end_offset, out_cache_loc, pool_len):
    pt = 0
    for i in range(req_pool_indices.numel()):
        s, e = int(start_offset[i]), int(end_offset[i])
        req_to_token[int(req_pool_indices[i]), s:e] = out_cache_loc[pt : pt + e - s].to(req_to_token.dtype)
        pt += e - s


def __getattr__(name):
    if name.startswith("__"):
        raise AttributeError(name)

    def missing(*args, **kwargs):
        raise NotImplementedError(f"sgl_kernel test shim: {name} needs the CPU build of sgl-kernel")

    missing.__name__ = name
    return missing
