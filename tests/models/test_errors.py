"""Clear errors for checkpoints and configs jaxrl cannot load."""

import json
import re
import shutil

import pytest
import transformers
from safetensors.torch import load_file, save_file

from jaxrl.models import from_config, from_pretrained


@pytest.fixture
def llama_copy(hf_causal, tmp_path):
    shutil.copytree(hf_causal("llama").path, tmp_path, dirs_exist_ok=True)
    return tmp_path


def _edit_config(path, **changes):
    config = json.loads((path / "config.json").read_text())
    config.update(changes)
    (path / "config.json").write_text(json.dumps(config))


def test_unsupported_model_type_lists_supported():
    with pytest.raises(
        ValueError,
        match=(
            r"model_type='bert'.*llama, mistral, qwen2, qwen3, phi3, granite, gemma, gemma2,"
            r"\s+gemma3_text, smollm3, olmo2, olmo3, qwen2_moe, qwen3_moe, mixtral, olmoe,"
            r"\s+gpt_oss, gpt2, gemma3"
        ),
    ):
        from_config(transformers.BertConfig())


@pytest.mark.parametrize(
    ("changes", "match"),
    [
        ({"final_logit_softcapping": 0.0}, "final_logit_softcapping=0.0 must be a positive"),
        ({"attn_logit_softcapping": -50.0}, "attn_logit_softcapping=-50.0 must be a positive"),
        ({"use_bidirectional_attention": True}, "use_bidirectional_attention=True"),
        (
            {"rope_parameters": {"sliding_attention": {"rope_type": "linear", "factor": 2.0}}},
            "rope_type='linear' for sliding_attention",
        ),
    ],
)
def test_unsupported_gemma3_options(changes, match):
    config = transformers.Gemma3TextConfig(
        vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, head_dim=8, **changes,
    )  # fmt: skip
    with pytest.raises(ValueError, match=re.escape(match)):
        from_config(config)


def test_unsupported_rope_type():
    config = transformers.LlamaConfig(
        rope_parameters={"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0}
    )
    with pytest.raises(ValueError, match="rope_type='dynamic'"):
        from_config(config)


def test_partial_rotary_refusal_and_dropout_rates():
    """A partial rotary factor is honoured where transformers honours it (Phi-3) and refused
    elsewhere; Phi-3's dropout probabilities are read (embd_pdrop drops nothing in transformers'
    Phi-3, so it is not), and a rate outside [0, 1) is refused."""
    small = dict(
        vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1,
    )  # fmt: skip
    llama = transformers.LlamaConfig(
        **small, rope_parameters={"rope_type": "default", "partial_rotary_factor": 0.5}
    )
    with pytest.raises(ValueError, match="partial_rotary_factor=0.5.*phi3 only"):
        from_config(llama)
    phi3 = transformers.Phi3Config(**small, resid_pdrop=0.1, embd_pdrop=0.2, attention_dropout=0.3)
    config = from_config(phi3).config
    assert (config.residual_dropout, config.attention_dropout) == (0.1, 0.3)
    assert config.embedding_dropout == 0.0
    with pytest.raises(ValueError, match=r"attention_dropout=1\.0 must be in \[0, 1\)"):
        from_config(transformers.LlamaConfig(**small, attention_dropout=1.0))


def test_sequence_classification_needs_a_transformers_class():
    """Granite and OLMoE have no `*ForSequenceClassification` in transformers: a reward model
    of them could not be saved, so it is refused when loaded, naming the families that can."""
    config = transformers.GraniteConfig(
        vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1,
    )  # fmt: skip
    with pytest.raises(ValueError, match=r"sequence_classification.*granite.*llama, mistral"):
        from_config(config, task="sequence_classification")


def test_missing_weight_names_the_key(llama_copy):
    weights = load_file(llama_copy / "model.safetensors")
    del weights["model.layers.1.mlp.up_proj.weight"]
    save_file(weights, llama_copy / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(KeyError, match=r"model\.layers\.1\.mlp\.up_proj\.weight"):
        from_pretrained(llama_copy)


def test_shape_mismatch_names_key_and_shapes(llama_copy):
    _edit_config(llama_copy, intermediate_size=80)
    with pytest.raises(ValueError, match=r"mlp\.down_proj\.weight.*\(64, 96\).*\(64, 80\)"):
        from_pretrained(llama_copy)


def test_unused_weights_warn(llama_copy):
    weights = load_file(llama_copy / "model.safetensors")
    weights["model.extra.weight"] = weights["model.norm.weight"].clone()
    save_file(weights, llama_copy / "model.safetensors", metadata={"format": "pt"})
    with pytest.warns(UserWarning, match=r"model\.extra\.weight"):
        from_pretrained(llama_copy)


def test_missing_directory_or_weights(tmp_path):
    with pytest.raises(FileNotFoundError, match="not a local directory"):
        from_pretrained(tmp_path / "does-not-exist")
    transformers.LlamaConfig(num_hidden_layers=1).save_pretrained(tmp_path)
    with pytest.raises(FileNotFoundError, match="No weights found"):
        from_pretrained(tmp_path)


def test_bad_options():
    config = transformers.LlamaConfig(num_hidden_layers=1, hidden_size=32, num_attention_heads=2)
    with pytest.raises(ValueError, match="remat_policy='some'"):
        from_config(config, remat_policy="some")
    with pytest.raises(ValueError, match="task='chat'"):
        from_config(config, task="chat")
