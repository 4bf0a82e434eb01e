"""Tiny random PyTorch reference models, each built and saved once per test session."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import transformers

VOCAB = 128

TINY = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)


def _llama3_rope() -> dict[str, Any]:
    # Small original context so all three llama3 frequency regimes occur with head_dim 16.
    return {
        "rope_type": "llama3",
        "rope_theta": 10000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 32,
    }


# family -> (config factory, save kwargs). Save formats are spread over families so every
# reader path (single safetensors, sharded index, pytorch .bin) is exercised.
FAMILIES: dict[str, tuple[Any, dict[str, Any]]] = {
    "llama": (lambda: transformers.LlamaConfig(**TINY), {}),
    "llama3_rope": (
        lambda: transformers.LlamaConfig(**TINY, rope_parameters=_llama3_rope()),
        {"max_shard_size": "40KB"},
    ),
    "mistral": (
        lambda: transformers.MistralConfig(**TINY, sliding_window=3),
        {"safe_serialization": False},
    ),
    "qwen2": (lambda: transformers.Qwen2Config(**TINY, tie_word_embeddings=True), {}),
    "qwen3": (lambda: transformers.Qwen3Config(**TINY, head_dim=16), {}),
    "gemma": (lambda: transformers.GemmaConfig(**TINY, head_dim=16), {}),
    # Gemma 3: sandwich norms, qk-norm, query_pre_attn_scalar != head_dim, a sliding layer with
    # its own rope base next to a full layer with linear rope scaling; untied, so greedy
    # decoding does not repeat one token and the window shows.
    "gemma3": (
        lambda: transformers.Gemma3TextConfig(
            **TINY,
            head_dim=16,
            query_pre_attn_scalar=24,
            sliding_window=3,
            layer_types=["sliding_attention", "full_attention"],
            rope_parameters={
                "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6},
                "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
            },
            tie_word_embeddings=False,
        ),
        {"max_shard_size": "40KB"},
    ),
    # Gemma 3's image-text checkpoints (gemma-3-4b/12b/27b): the same language model under
    # `model.language_model`, a tied LM head, and a vision tower + projector that text-only
    # training never runs and `save_pretrained` copies through.
    "gemma3_vlm": (
        lambda: transformers.Gemma3Config(
            text_config=FAMILIES["gemma3"][0]().to_dict(),
            vision_config=transformers.SiglipVisionConfig(
                hidden_size=16,
                intermediate_size=32,
                num_hidden_layers=1,
                num_attention_heads=2,
                image_size=28,
                patch_size=14,
            ).to_dict(),
            mm_tokens_per_image=4,
            tie_word_embeddings=True,
        ),
        {"max_shard_size": "40KB"},
    ),
    # Gemma 2: sandwich norms, no qk-norm, one rope for a sliding and a full layer, tanh
    # soft-capping of attention scores and logits. Caps and init scale are chosen so that both
    # caps bend what they cap (raw scores reach ~1.6 against a cap of 1.5).
    "gemma2": (
        lambda: transformers.Gemma2Config(
            **TINY,
            head_dim=16,
            query_pre_attn_scalar=24,
            sliding_window=3,
            layer_types=["sliding_attention", "full_attention"],
            attn_logit_softcapping=1.5,
            final_logit_softcapping=0.5,
            initializer_range=0.1,
            tie_word_embeddings=False,
        ),
        {},
    ),
    # Phi-3: fused qkv_proj / gate_up_proj, a sliding window, LongRoPE on half of each head
    # (Phi-4-mini's partial_rotary_factor) with an original context of 8 positions, so 9-token
    # rows take the long factors, shorter ones the short factors, and generation switches.
    "phi3": (
        lambda: transformers.Phi3Config(
            **TINY,
            sliding_window=5,
            original_max_position_embeddings=8,
            rope_parameters={
                "rope_type": "longrope",
                "rope_theta": 10000.0,
                "partial_rotary_factor": 0.5,
                "short_factor": [1.0, 1.5, 2.0, 3.0],
                "long_factor": [2.0, 4.0, 8.0, 16.0],
                "original_max_position_embeddings": 8,
            },
        ),
        {},
    ),
    # Granite: embedding, attention, residual multipliers and logits scaling (granite-3.1-2b's
    # values), tied embeddings.
    "granite": (
        lambda: transformers.GraniteConfig(
            **TINY,
            embedding_multiplier=12.0,
            attention_multiplier=0.015625,
            residual_multiplier=0.22,
            logits_scaling=8.0,
            tie_word_embeddings=True,
        ),
        {},
    ),
    # SmolLM3: layer 1 is a NoPE layer (no rotary embedding).
    "smollm3": (lambda: transformers.SmolLM3Config(**TINY, no_rope_layers=[1, 0]), {}),
    "olmo2": (lambda: transformers.Olmo2Config(**TINY), {"safe_serialization": False}),
    # OLMo 3: a sliding layer (default rope, its own base) next to a full one with YaRN.
    "olmo3": (
        lambda: transformers.Olmo3Config(
            **TINY,
            sliding_window=3,
            layer_types=["sliding_attention", "full_attention"],
            rope_parameters={
                "full_attention": {
                    "rope_type": "yarn",
                    "factor": 4.0,
                    "original_max_position_embeddings": 8,
                    "rope_theta": 5e5,
                },
                "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
            },
        ),
        {},
    ),
    # Mixture of experts: 4 experts, 2 per token. Qwen3-MoE renormalises the top-k weights;
    # Qwen2-MoE has a gated shared expert and a dense-MLP layer (mlp_only_layers) after its MoE
    # layer; Mixtral always renormalises and keeps the weights in f32; OLMoE has q/k norms over
    # all heads. OLMoE is saved sharded: expert keys spread over files.
    "qwen3_moe": (
        lambda: transformers.Qwen3MoeConfig(
            **TINY,
            head_dim=16,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            norm_topk_prob=True,
        ),
        {},
    ),  # fmt: skip
    "qwen2_moe": (
        lambda: transformers.Qwen2MoeConfig(
            **TINY,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=48,
            mlp_only_layers=[1],
        ),
        {},
    ),  # fmt: skip
    "mixtral": (
        lambda: transformers.MixtralConfig(**TINY, num_local_experts=4, num_experts_per_tok=2),
        {},
    ),
    "olmoe": (
        lambda: transformers.OlmoeConfig(**TINY, num_experts=4, num_experts_per_tok=2),
        {"max_shard_size": "40KB"},
    ),
    # GPT-OSS: attention sinks (drawn with std 1 in `_build`, so they matter), q/k/v/o biases,
    # a sliding layer then a full one, YaRN without truncation (small original context), 4
    # experts top-2 with biases, gate/up interleaved in the checkpoint, and a SwiGLU limit low
    # enough that the clamps bite.
    "gpt_oss": (
        lambda: transformers.GptOssConfig(
            **{**TINY, "intermediate_size": 32},
            head_dim=16,
            num_local_experts=4,
            num_experts_per_tok=2,
            sliding_window=3,
            layer_types=["sliding_attention", "full_attention"],
            rope_parameters={
                "rope_type": "yarn",
                "rope_theta": 150000.0,
                "factor": 4.0,
                "beta_fast": 32.0,
                "beta_slow": 1.0,
                "truncate": False,
                "original_max_position_embeddings": 8,
            },
            swiglu_limit=0.15,
        ),
        {},
    ),
    "gpt2": (
        lambda: transformers.GPT2Config(
            vocab_size=VOCAB,
            n_embd=64,
            n_layer=2,
            n_head=4,
            n_positions=128,
            bos_token_id=1,
            eos_token_id=2,
            pad_token_id=0,
        ),
        {},
    ),
}


@dataclasses.dataclass
class Reference:
    model: Any
    path: Path


def _build(factory: Any, save_kwargs: dict, tmp: Path, cls: Any, seed: int) -> Reference:
    torch.manual_seed(seed)
    config = factory()
    config._attn_implementation = "eager"
    model = cls.from_config(config).eval()
    if hasattr(model, "lm_head") and not config.tie_word_embeddings:
        torch.nn.init.normal_(model.lm_head.weight, std=0.02)
    with torch.no_grad():  # HF zero-inits biases; random ones make the bias mapping testable
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name or "ln_" in name:
                p.add_(0.1 * torch.randn_like(p))
            elif name.endswith(".sinks"):  # GPT-OSS's attention sinks, large enough to matter
                p.copy_(torch.randn_like(p))
    model.save_pretrained(tmp, **save_kwargs)
    return Reference(model, tmp)


@pytest.fixture(scope="session")
def hf_causal(tmp_path_factory):
    """Lazily built `{family: Reference}` of causal LMs."""
    cache: dict[str, Reference] = {}

    def get(family: str) -> Reference:
        if family not in cache:
            factory, kwargs = FAMILIES[family]
            cache[family] = _build(
                factory,
                kwargs,
                tmp_path_factory.mktemp(family),
                transformers.AutoModelForCausalLM,
                seed=len(cache),
            )
        return cache[family]

    return get


@pytest.fixture(scope="session")
def hf_seq_cls(tmp_path_factory):
    """Lazily built `{family: Reference}` of sequence classifiers (num_labels=1)."""
    cache: dict[str, Reference] = {}

    def get(family: str) -> Reference:
        if family not in cache:
            base, kwargs = FAMILIES[family]

            def factory():
                config = base()
                config.num_labels = 1
                return config

            cache[family] = _build(
                factory,
                kwargs,
                tmp_path_factory.mktemp(f"{family}_cls"),
                transformers.AutoModelForSequenceClassification,
                seed=10 + len(cache),
            )
        return cache[family]

    return get


def padded_batch(seed: int = 0, seq_len: int = 9) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """ids (no pad id inside real tokens), right-padding mask and left-padding mask [3, T]."""
    rng = np.random.default_rng(seed)
    lengths = np.array([seq_len, seq_len - 3, 4])
    ids = rng.integers(3, VOCAB, size=(3, seq_len)).astype(np.int32)
    right = (np.arange(seq_len)[None] < lengths[:, None]).astype(np.int32)
    left = right[:, ::-1].copy()
    return ids, right, left


def torch_logits(model: Any, ids: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """HF outputs with position_ids = cumsum(mask) - 1 (what jaxrl uses by default)."""
    ids = np.where(mask == 1, ids, 0)
    positions = np.maximum(np.cumsum(mask, axis=1) - 1, 0)
    with torch.no_grad():
        out = model(
            input_ids=torch.from_numpy(ids).long(),
            attention_mask=torch.from_numpy(mask).long(),
            position_ids=torch.from_numpy(positions).long(),
        )
    return out.logits.float().numpy()
