"""--trust-remote-code: the config and model classes come from the model's own local directory, only when asked,
and the plan header says so. The directory here holds a renamed Llama (model_type "my_llama", which neither
transformers nor vLLM knows) as a hub snapshot of a remote-code model would: config.json's auto_map names the
classes in configuration_*.py / modeling_*.py next to it."""

from __future__ import annotations

import json

import pytest

from shardplan.models import ConfigError
from shardplan.plan.file.format import decode
from shardplan.plan.layout import Layout
from shardplan.record.remote import RemoteCodeError
from shardplan.record.session import RecordSession
from shardplan.record.verify import random_checkpoint, verify_rank

CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "my_llama",
    "auto_map": {
        "AutoConfig": "configuration_my.MyLlamaConfig",
        "AutoModelForCausalLM": "modeling_my.MyLlamaForCausalLM",
    },
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_hidden_layers": 2,
    "vocab_size": 300,
    "max_position_embeddings": 256,
    "tie_word_embeddings": False,
}
CONFIGURATION = """from transformers import LlamaConfig


class MyLlamaConfig(LlamaConfig):
    model_type = "my_llama"
"""
MODELING = """from transformers import LlamaForCausalLM

from .configuration_my import MyLlamaConfig


class MyLlamaForCausalLM(LlamaForCausalLM):
    config_class = MyLlamaConfig
"""


@pytest.fixture
def remote_dir(tmp_path):
    model = tmp_path / "my-llama"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(CONFIG))
    (model / "configuration_my.py").write_text(CONFIGURATION)
    (model / "modeling_my.py").write_text(MODELING)
    return model


def test_without_the_flag_the_remote_config_is_refused_naming_the_flag(remote_dir):
    with pytest.raises(ConfigError, match="--trust-remote-code"):
        RecordSession(str(remote_dir), Layout(tp=1))


def test_the_flag_needs_a_local_directory():
    with pytest.raises(RemoteCodeError, match="local checkpoint directory"):
        RecordSession("llama-3.1-8b", Layout(tp=1), trust_remote_code=True)


@pytest.mark.parametrize("tp", [1, 2])
def test_trusted_directory_records_bitwise_and_the_header_says_so(remote_dir, tp):
    layout = Layout(tp=tp)
    session = RecordSession(str(remote_dir), layout, trust_remote_code=True)
    assert type(session.vllm_config.model_config.hf_config).__name__ == "MyLlamaConfig"
    names = {n for n, _, _ in session.tensors}
    assert "model.layers.1.self_attn.q_proj.weight" in names and "lm_head.weight" in names
    checkpoint = random_checkpoint(session.tensors, 0)
    for rank in range(tp):
        plan, _ = session.record_rank(rank)
        assert verify_rank(session.vllm_config, layout, rank, plan, checkpoint).ok
    recorded = session.record_plans(list(range(tp)))
    header, _ = decode(session.encode(recorded.body))
    assert header.trust_remote_code is True


def test_plans_recorded_without_the_flag_carry_no_such_key(tmp_path):
    session = RecordSession("llama-3.1-8b", Layout(tp=1), overrides=["num_hidden_layers=1"])
    header, _ = decode(session.encode(session.record_plans([0]).body))
    assert header.trust_remote_code is False
