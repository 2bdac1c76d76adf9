"""Test-only stand-in for sgl-kernel's CPU ops (used by tests/sglang's live-engine test only, never shipped to users).

SGLang's CPU engine (SGLANG_USE_CPU_ENGINE=1) imports `*_cpu` ops from the CPU build of sgl-kernel, and PyPI's
`sglang-kernel` wheel is CUDA-only (building the CPU extension from source is long on 2 cores). Without
`torch.ops.sgl_kernel.convert_weight_packed` SGLang takes its own torch-native paths for norms, activations, MoE
routing and experts (its AMX backend stays off), so what is left, each here in pure torch with the semantics of
sgl-kernel's csrc/cpu sources (the arithmetic is plain torch, not the kernels' blocked bf16 GEMMs: a fresh engine
and an updated one both run these, so they compare like with like):
* `assign_req_to_token_pool_cpu` (every model);
* `torch.ops.sgl_kernel.extend_attention_cpu` / `decode_attention_cpu`, the `intel_amx` attention backend's two
  kernels (csrc/cpu/extend.cpp, decode.cpp): MLA models (DeepSeek, Kimi-K2) need them, since SGLang's torch_native
  backend cannot serve MLA's prefill (its MHA extend reads K/V back from the latent cache). Only the variants those
  models use: no logit cap, sliding window, sinks, tree mask, cross attention, encoder or fp8 cache (each refused by
  name).
Any other op raises when called, naming itself, so a test can never pass on a silently wrong kernel.
"""

import torch

__version__ = "0.0.0+shardplan-test-shim"


def assign_req_to_token_pool_cpu(req_pool_indices, req_to_token, start_offset, end_offset, out_cache_loc, pool_len):
    pt = 0
    for i in range(req_pool_indices.numel()):
        s, e = int(start_offset[i]), int(end_offset[i])
        req_to_token[int(req_pool_indices[i]), s:e] = out_cache_loc[pt : pt + e - s].to(req_to_token.dtype)
        pt += e - s


def _unsupported(op, **given):
    for name, bad in given.items():
        if bad:
            raise NotImplementedError(f"sgl_kernel test shim: {op} with {name} needs the CPU build of sgl-kernel")


def _attend(q, k, v, sm_scale, causal_from=None):
    """softmax(q k^T * sm_scale) v per query head, in float32; q [M, H, D], k [N, Hkv, D], v [N, Hkv, Dv]: head h
    reads kv head h // (H / Hkv). causal_from: query row i sees keys 0 .. causal_from + i."""
    groups = q.shape[1] // k.shape[1]
    k = k.float().repeat_interleave(groups, dim=1)
    v = v.float().repeat_interleave(groups, dim=1)
    s = torch.einsum("mhd,nhd->hmn", q.float(), k) * sm_scale
    if causal_from is not None:
        m, n = q.shape[0], k.shape[0]
        mask = torch.arange(n)[None, :] > (causal_from + torch.arange(m))[:, None]
        s = s.masked_fill(mask, float("-inf"))
    return torch.einsum("hmn,nhd->mhd", s.softmax(-1), v)


def _extend_attention_cpu(
    q_extend, k_extend, v_extend, o_extend, k_buffer, v_buffer, k_scale, v_scale, req_to_token, req_pool_indices,
    seq_lens, extend_seq_lens, extend_start_loc, max_len_extend, sm_scale, logit_cap, is_cross_attn,
    sliding_window_size, encoder_lens, sinks, tree_mask, is_causal,
):  # fmt: skip
    op = "extend_attention_cpu"
    _unsupported(
        op,
        logit_cap=logit_cap > 0,
        sliding_window=sliding_window_size > 0,
        sinks=sinks is not None,
        tree_mask=tree_mask is not None,
        cross_attention=is_cross_attn or not is_causal or k_extend is None,
        encoder_lens=encoder_lens is not None,
        fp8_cache=k_buffer.dtype not in (torch.bfloat16, torch.float16, torch.float32) or k_scale != 1 or v_scale != 1,
    )
    # extend.cpp: the prefix comes from the cache through req_to_token, then the extend part causally; MLA (a cache
    # whose head count differs from k_extend's) has no prefix here (SGLang takes this MHA path only without one)
    mla = k_buffer.shape[1] != k_extend.shape[1]
    for b in range(seq_lens.numel()):
        n_ext, start = int(extend_seq_lens[b]), int(extend_start_loc[b])
        prefix = int(seq_lens[b]) - n_ext
        if mla and prefix:
            raise NotImplementedError(f"sgl_kernel test shim: {op}: MLA with a cached prefix ({prefix} tokens)")
        k, v = k_extend[start : start + n_ext], v_extend[start : start + n_ext]
        if prefix:
            tokens = req_to_token[int(req_pool_indices[b]), :prefix].long()
            k = torch.cat([k_buffer[tokens].to(k.dtype), k])
            v = torch.cat([v_buffer[tokens].to(v.dtype), v])
        out = _attend(q_extend[start : start + n_ext], k, v, sm_scale, causal_from=prefix)
        o_extend[start : start + n_ext] = out.to(o_extend.dtype)


def _decode_attention_cpu(
    query, k_buffer, v_buffer, k_scale, v_scale, output, key, value, loc, attn_logits, req_to_token,
    req_pool_indices, seq_lens, sm_scale, logit_cap, is_cross_attn, sliding_window_size, encoder_lens, sinks,
):  # fmt: skip
    _unsupported(
        "decode_attention_cpu",
        logit_cap=logit_cap > 0,
        sliding_window=sliding_window_size > 0,
        sinks=sinks is not None,
        cross_attention=is_cross_attn,
        encoder_lens=encoder_lens is not None,
        fp8_cache=k_buffer.dtype not in (torch.bfloat16, torch.float16, torch.float32) or k_scale != 1 or v_scale != 1,
    )
    # decode.cpp: the new token's key/value go into the cache at loc first (MLA: value is a view of the key buffer,
    # so writing the key writes both), then each sequence attends over its whole cache
    if key is not None:
        k_buffer[loc] = key.to(k_buffer.dtype)
        if v_buffer.data_ptr() != k_buffer.data_ptr():
            v_buffer[loc] = value.to(v_buffer.dtype)
    for b in range(seq_lens.numel()):
        tokens = req_to_token[int(req_pool_indices[b]), : int(seq_lens[b])].long()
        out = _attend(query[b : b + 1], k_buffer[tokens], v_buffer[tokens], sm_scale)
        output[b] = out[0].to(output.dtype)


_LIB = torch.library.Library("sgl_kernel", "DEF")
_LIB.define(
    "extend_attention_cpu(Tensor q_extend, Tensor? k_extend, Tensor? v_extend, Tensor(a!) o_extend, Tensor k_buffer,"
    " Tensor v_buffer, float k_scale, float v_scale, Tensor req_to_token, Tensor req_pool_indices, Tensor seq_lens,"
    " Tensor extend_seq_lens, Tensor extend_start_loc, int max_len_extend, float sm_scale, float logit_cap,"
    " bool is_cross_attn, int sliding_window_size, Tensor? encoder_lens, Tensor? sinks, Tensor? tree_mask,"
    " bool is_causal) -> ()"
)
_LIB.impl("extend_attention_cpu", _extend_attention_cpu, "CPU")
_LIB.define(
    "decode_attention_cpu(Tensor query, Tensor(a!) k_buffer, Tensor(b!) v_buffer, float k_scale, float v_scale,"
    " Tensor(c!) output, Tensor? key, Tensor? value, Tensor loc, Tensor attn_logits, Tensor req_to_token,"
    " Tensor req_pool_indices, Tensor seq_lens, float sm_scale, float logit_cap, bool is_cross_attn,"
    " int sliding_window_size, Tensor? encoder_lens, Tensor? sinks) -> ()"
)
_LIB.impl("decode_attention_cpu", _decode_attention_cpu, "CPU")


def __getattr__(name):
    if name.startswith("__"):
        raise AttributeError(name)

    def missing(*args, **kwargs):
        raise NotImplementedError(f"sgl_kernel test shim: {name} needs the CPU build of sgl-kernel")

    missing.__name__ = name
    return missing
