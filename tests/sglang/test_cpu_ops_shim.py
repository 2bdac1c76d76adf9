"""The live tests' pure-torch stand-ins for sgl-kernel's attention kernels (cpu_ops/sgl_kernel) against torch's own
scaled_dot_product_attention: paged prefix + causal extend with GQA, MLA's prefill (no prefix, Dv != D), decode over
the cache after writing the new token (MHA, GQA, MLA with the value buffer a view of the key buffer)."""

from __future__ import annotations

import importlib.util
import pathlib

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

_SPEC = importlib.util.spec_from_file_location(
    "sgl_kernel_test_shim", pathlib.Path(__file__).resolve().parent / "cpu_ops" / "sgl_kernel" / "__init__.py"
)
shim = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(shim)
OPS = torch.ops.sgl_kernel


def reference(q, k, v, scale, prefix):
    """q [M, H, D], k [N, Hkv, D], v [N, Hkv, Dv]; query row i sees keys 0 .. prefix + i."""
    m, n = q.shape[0], k.shape[0]
    mask = torch.arange(n)[None, :] <= (prefix + torch.arange(m))[:, None]
    out = F.scaled_dot_product_attention(
        q.float().transpose(0, 1),
        k.float().transpose(0, 1),
        v.float().transpose(0, 1),
        attn_mask=mask,
        scale=scale,
        enable_gqa=True,
    )
    return out.transpose(0, 1)


@settings(max_examples=20, deadline=None)
@given(
    lens=st.lists(st.tuples(st.integers(0, 5), st.integers(1, 4)), min_size=1, max_size=3),
    heads=st.sampled_from([(4, 4), (4, 2), (4, 1)]),
    seed=st.integers(0, 2**16),
)
def test_extend_attention_matches_sdpa_over_paged_prefix_and_causal_extend(lens, heads, seed):
    gen = torch.Generator().manual_seed(seed)
    h, hkv, d, dv, pool = *heads, 32, 16, 64
    k_buf, v_buf = torch.randn(pool, hkv, d, generator=gen), torch.randn(pool, hkv, dv, generator=gen)
    req_to_token = torch.randperm(pool, generator=gen).reshape(4, 16).int()
    total = sum(e for _, e in lens)
    q, k, v = (
        torch.randn(total, h, d, generator=gen),
        torch.randn(total, hkv, d, generator=gen),
        torch.randn(total, hkv, dv, generator=gen),
    )
    o = torch.full((total, h, dv), float("nan"))
    starts = torch.tensor([sum(e for _, e in lens[:i]) for i in range(len(lens))]).int()
    pools = torch.arange(len(lens))
    OPS.extend_attention_cpu(
        q,
        k,
        v,
        o,
        k_buf,
        v_buf,
        1.0,
        1.0,
        req_to_token,
        pools,
        torch.tensor([p + e for p, e in lens]),
        torch.tensor([e for _, e in lens]).int(),
        starts,
        max(e for _, e in lens),
        0.125,
        0.0,
        False,
        0,
        None,
        None,
        None,
        True,
    )
    for b, (p, e) in enumerate(lens):
        s, cached = int(starts[b]), req_to_token[b, :p].long()
        keys, values = torch.cat([k_buf[cached], k[s : s + e]]), torch.cat([v_buf[cached], v[s : s + e]])
        torch.testing.assert_close(o[s : s + e], reference(q[s : s + e], keys, values, 0.125, p))


def test_extend_attention_mla_prefill_has_no_prefix_and_refuses_one():
    gen = torch.Generator().manual_seed(0)
    q, k, v = (
        torch.randn(5, 4, 32, generator=gen),
        torch.randn(5, 4, 32, generator=gen),
        torch.randn(5, 4, 16, generator=gen),
    )
    latent = torch.randn(64, 1, 48, generator=gen)  # MLA cache: one latent head, not k_extend's 4
    o = torch.full((5, 4, 16), float("nan"))

    def prefill(seq_len: int) -> None:  # one request of 5 new tokens; seq_len > 5 means a cached prefix
        cache = (latent, latent[..., :32], 1.0, 1.0, torch.arange(64).reshape(4, 16), torch.tensor([0]))
        flags = (0.2, 0.0, False, 0, None, None, None, True)
        OPS.extend_attention_cpu(
            q, k, v, o, *cache, torch.tensor([seq_len]), torch.tensor([5]), torch.tensor([0]), 5, *flags
        )

    prefill(5)
    torch.testing.assert_close(o, reference(q, k, v, 0.2, 0))
    with pytest.raises(NotImplementedError, match="MLA with a cached prefix"):
        prefill(7)


@settings(max_examples=20, deadline=None)
@given(
    layout=st.sampled_from(["mha", "gqa", "mla"]),
    seq=st.lists(st.integers(1, 9), min_size=1, max_size=3),
    seed=st.integers(0, 2**16),
)
def test_decode_attention_writes_the_new_token_then_matches_sdpa(layout, seq, seed):
    gen = torch.Generator().manual_seed(seed)
    bs, pool, h = len(seq), 64, 4
    req_to_token = torch.randperm(pool, generator=gen).reshape(4, 16)
    loc = torch.stack([req_to_token[b, n - 1] for b, n in enumerate(seq)])
    if layout == "mla":  # the value buffer is the key buffer's first 32 columns, as SGLang's MLA pool hands it over
        d, dv, hkv = 48, 32, 1
        k_buf = torch.randn(pool, 1, d, generator=gen)
        v_buf = k_buf[..., :dv]
        key = torch.randn(bs, 1, d, generator=gen)
        value = key[..., :dv]
    else:
        d, dv, hkv = 32, 32, (4 if layout == "mha" else 2)
        k_buf, v_buf = torch.randn(pool, hkv, d, generator=gen), torch.randn(pool, hkv, dv, generator=gen)
        key, value = torch.randn(bs, hkv, d, generator=gen), torch.randn(bs, hkv, dv, generator=gen)
    q, o = torch.randn(bs, h, d, generator=gen), torch.full((bs, h, dv), float("nan"))
    OPS.decode_attention_cpu(
        q,
        k_buf,
        v_buf,
        1.0,
        1.0,
        o,
        key,
        value,
        loc,
        torch.zeros(bs, h, 8, dv + 1),
        req_to_token,
        torch.arange(bs),
        torch.tensor(seq),
        0.1,
        0.0,
        False,
        0,
        None,
        None,
    )
    assert torch.equal(k_buf[loc], key) and torch.equal(v_buf[loc], value)
    for b, n in enumerate(seq):
        cached = req_to_token[b, :n]
        torch.testing.assert_close(o[b : b + 1], reference(q[b : b + 1], k_buf[cached], v_buf[cached], 0.1, n))


def test_unsupported_variants_and_other_ops_raise_by_name():
    q = torch.zeros(1, 1, 32)
    try:
        OPS.decode_attention_cpu(
            q,
            q,
            q,
            1.0,
            1.0,
            q,
            None,
            None,
            torch.tensor([0]),
            q,
            torch.zeros(1, 1).long(),
            torch.tensor([0]),
            torch.tensor([1]),
            0.1,
            30.0,
            False,
            0,
            None,
            None,
        )
        raise AssertionError("a logit cap was accepted")
    except NotImplementedError as e:
        assert "decode_attention_cpu with logit_cap" in str(e)
    try:
        shim.fused_experts_cpu()
        raise AssertionError("a missing op ran")
    except NotImplementedError as e:
        assert "fused_experts_cpu needs the CPU build of sgl-kernel" in str(e)
