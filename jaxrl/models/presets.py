"""Named model shapes for benchmarks (random weights), parameter counts and FLOPs per token (MFU).

Presets are transformers configs, so `from_config(get_preset(name))` builds them with jaxrl and
the same object builds the PyTorch reference.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import numpy as np
import transformers
from flax import nnx

from jaxrl.models.config import ModelConfig
from jaxrl.models.families import family
from jaxrl.models.hf_config import config_from_hf


def _qwen25_05b() -> Any:
    # Values of Qwen/Qwen2.5-0.5B's config.json.
    return transformers.Qwen2Config(
        vocab_size=151936,
        hidden_size=896,
        intermediate_size=4864,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        hidden_act="silu",
        max_position_embeddings=32768,
        rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        tie_word_embeddings=True,
        use_sliding_window=False,
        sliding_window=32768,
        max_window_layers=24,
        bos_token_id=151643,
        eos_token_id=151643,
        initializer_range=0.02,
    )


def _gemma3_1b() -> Any:
    # Values of google/gemma-3-1b-pt's config.json (Gemma3ForCausalLM, text only).
    return transformers.Gemma3TextConfig(
        vocab_size=262144,
        hidden_size=1152,
        intermediate_size=6912,
        num_hidden_layers=26,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=256,
        hidden_activation="gelu_pytorch_tanh",
        max_position_embeddings=32768,
        rms_norm_eps=1e-6,
        query_pre_attn_scalar=256,
        sliding_window=512,
        rope_parameters={
            "full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        },
        tie_word_embeddings=True,
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=2,
        initializer_range=0.02,
    )


def _llama_tiny() -> Any:
    return transformers.LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        pad_token_id=0,
    )


def _qwen2_tiny() -> Any:
    return transformers.Qwen2Config(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=True,
        pad_token_id=0,
    )


def _gpt2_tiny() -> Any:
    return transformers.GPT2Config(
        vocab_size=256,
        n_embd=64,
        n_layer=2,
        n_head=4,
        n_positions=512,
        bos_token_id=1,
        eos_token_id=1,
        pad_token_id=0,
    )


def _llama_bench(hidden: int, layers: int, vocab: int) -> Callable[[], Any]:
    """The Llama shapes of the jaxrl-vs-TRL sweep (`python -m jaxrl.bench --compare trl --sweep`):
    head_dim 64, GQA with half as many K/V heads, MLP 4x hidden."""

    def make() -> Any:
        return transformers.LlamaConfig(
            vocab_size=vocab,
            hidden_size=hidden,
            intermediate_size=4 * hidden,
            num_hidden_layers=layers,
            num_attention_heads=hidden // 64,
            num_key_value_heads=hidden // 128,
            max_position_embeddings=2048,
            pad_token_id=0,
        )

    return make


PRESETS: dict[str, Callable[[], Any]] = {
    "qwen2.5-0.5b": _qwen25_05b,
    "gemma-3-1b": _gemma3_1b,
    "llama-tiny": _llama_tiny,
    "qwen2-tiny": _qwen2_tiny,
    "gpt2-tiny": _gpt2_tiny,
    "llama-4x256": _llama_bench(256, 4, 2048),
    "llama-8x512": _llama_bench(512, 8, 32000),
}


def get_preset(name: str) -> Any:
    """The transformers config of a named preset."""
    if name not in PRESETS:
        raise ValueError(f"Unknown model preset {name!r}; choose one of {sorted(PRESETS)}.")
    return PRESETS[name]()


def count_params(model: nnx.Module) -> int:
    """Number of parameter elements in `model`."""
    return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(nnx.state(model, nnx.Param)))


def head_params(config: Any) -> int:
    """Weights of the unembedding (hidden x vocabulary), the LM head's share of `flops_per_token`'s
    N."""
    c = config if isinstance(config, ModelConfig) else config_from_hf(config)
    return c.hidden_size * c.vocab_size


def flops_per_token(config: Any, seq_len: int) -> float:
    """Training FLOPs per token: 6 * N_matmul + 12 * L * heads * head_dim * seq_len.

    PaLM appendix B / MaxText MFU formula: N counts the weights used in matmuls (all layer
    projections and the unembedding, not the embedding lookup); the second term is attention
    scores and weighted values (forward + backward). A mixture-of-experts layer counts the
    weights one token uses: the router, its `num_experts_per_tok` experts and any shared expert.
    """
    c = config if isinstance(config, ModelConfig) else config_from_hf(config)
    d, n, k, h, f = c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim, c.intermediate_size
    attn = d * n * h + 2 * d * k * h + n * h * d
    mlp = (3 if family(c.model_type).gated_mlp else 2) * d * f
    shared = c.shared_expert_intermediate_size
    moe = (
        d * c.num_experts
        + c.num_experts_per_tok * 3 * d * c.moe_intermediate_size
        + (3 * d * shared + d if shared else 0)
    )
    moe_layers = c.moe_layers or (False,) * c.num_layers
    n_matmul = sum(attn + (moe if m else mlp) for m in moe_layers) + d * c.vocab_size
    return 6.0 * n_matmul + 12.0 * c.num_layers * n * h * seq_len
