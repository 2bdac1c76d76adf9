"""Built-in models shrunk to a few hundred kB (hidden 64, 2 layers, 4 experts, vocabulary 300) for tests that build
vLLM models on CPU again and again (test_end_to_end, test_eplb, test_engine_reload, test_sync): `TINY[model]` is a
list of `--override` fields, `tiny(model, key=value, ...)` the same with fields replaced or added."""

from __future__ import annotations

TINY = {
    "qwen3-30b-a3b": [
        "num_hidden_layers=2",
        "hidden_size=64",
        "intermediate_size=128",
        "moe_intermediate_size=32",
        "num_attention_heads=4",
        "num_key_value_heads=2",
        "head_dim=16",
        "num_experts=4",
        "num_experts_per_tok=2",
        "vocab_size=300",
    ],
    "kimi-k2": [
        "num_hidden_layers=2",
        "hidden_size=64",
        "intermediate_size=128",
        "moe_intermediate_size=32",
        "n_routed_experts=4",
        "num_attention_heads=4",
        "num_key_value_heads=4",
        "q_lora_rank=32",
        "kv_lora_rank=16",
        "qk_rope_head_dim=8",
        "qk_nope_head_dim=16",
        "v_head_dim=16",
        "vocab_size=300",
        "num_experts_per_tok=2",
    ],
    "llama-3.1-8b": [
        "num_hidden_layers=2",
        "hidden_size=64",
        "intermediate_size=128",
        "num_attention_heads=4",
        "num_key_value_heads=2",
        "vocab_size=300",
    ],
}


def tiny(model: str, **fields) -> list[str]:
    """TINY[model] with `fields` replacing the fields of the same key, or added after them."""
    out = [o for o in TINY[model] if o.split("=", 1)[0] not in fields]
    return out + [f"{key}={value}" for key, value in fields.items()]
