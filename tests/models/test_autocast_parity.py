"""bf16 compute over f32 params reproduces torch autocast (TRL's default `bf16=True`): the same
HF checkpoint run under `torch.autocast("cpu", torch.bfloat16)` with SDPA attention gives the
same bf16 logits, up to rare one-ulp rounding flips; all-bf16 activations are much further off."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

from jaxrl.models import config_from_hf, from_pretrained
from tests.models.conftest import padded_batch, torch_logits


def _autocast_logits(path, ids, mask) -> np.ndarray:
    # Gemma 2's soft-capped scores run only in transformers' eager attention.
    # GPT-OSS's sinks too (transformers has no SDPA path for it).
    eager = transformers.AutoConfig.from_pretrained(path).model_type in ("gemma2", "gpt_oss")
    model = transformers.AutoModelForCausalLM.from_pretrained(
        path, attn_implementation="eager" if eager else "sdpa"
    )
    with torch.autocast("cpu", dtype=torch.bfloat16):
        return torch_logits(model.eval(), ids, mask)


def _gap(path, ids, mask, want, **dtypes) -> float:
    model = from_pretrained(path, **dtypes)
    logits = jax.jit(lambda i, m: model(i, m))(jnp.asarray(ids), jnp.asarray(mask))
    assert logits.dtype == jnp.bfloat16
    err = np.abs(np.asarray(logits, np.float32) - want)[mask.astype(bool)]
    return float(err.mean() / np.abs(want[mask.astype(bool)]).mean())


# Mean |logit error| / mean |logit|, measured: 1.2e-3 (llama), 1.5e-3 (qwen2), 2.8e-3 (qwen3),
# 1.3e-3 (gpt2) with autocast semantics; 4.4e-3 to 8.1e-3 with all-bf16 activations (what bf16
# compute was before). `qwen2` has q/k/v biases, `qwen3` qk-norm, `gpt2` LayerNorm and learned
# positions. Norms that round their f32 product once to a bf16 input (after attention and the
# MLP) leave larger gaps, over six random models each: `gemma3` (sandwich norms, embedding
# multiplier, scores scaled by query_pre_attn_scalar) 3.6e-3 to 5.1e-3 against 1.1e-2 all-bf16
# (7.1e-3 when the scale was folded into the queries before their bf16 rounding); `olmo2`
# (post-norms, q/k norms over all heads) 2.4e-3 to 4.1e-3 against 5.3e-3 to 6.4e-3 all-bf16
# (6.3e-3 to 7.3e-3 with Llama's norm rounding instead). Each model's own torch autocast-vs-f32
# gap is ~9.5e-3 (gemma3), ~7.5e-3 (olmo2), ~5e-3 (qwen3). The hf_causal fixture seeds models
# by build order, which varies with the tests a worker runs: the bounds leave room over seeds
# 0-5. Mixture of experts (routing in bf16 logits, as torch's F.linear under autocast; no
# routing flip was seen): `qwen3_moe` 2.4e-3 to 3.8e-3 against 7.0e-3 to 8.3e-3 all-bf16,
# `mixtral` 2.2e-3 to 2.6e-3 against 5.9e-3 to 7.0e-3. `gemma2` runs transformers' eager
# attention (bf16 scores, soft-capped in bf16) and logits capped at 0.5: 6.0e-3 to 7.1e-3
# against 8.7e-3 to 9.5e-3 all-bf16; measured against torch in f32, jaxrl's bf16 logits are as
# close (7.7e-3 to 7.9e-3) as torch autocast's own (7.8e-3 to 8.6e-3).
BOUNDS = {  # (gap, fraction of the all-bf16 gap)
    "gemma2": (8e-3, 0.85),
    "gemma3": (6e-3, 0.6),
    "olmo2": (5e-3, 0.75),
    "qwen3_moe": (5e-3, 0.6),
}


@pytest.mark.parametrize(
    "family",
    [
        "llama",
        "qwen2",
        "qwen3",
        "phi3",
        "gpt2",
        "gemma2",
        "gemma3",
        "olmo2",
        "qwen3_moe",
        "mixtral",
    ],
)
def test_bf16_logits_match_torch_autocast(family, hf_causal):
    path = hf_causal(family).path
    ids, right, _ = padded_batch(seed=4, seq_len=16)
    want = _autocast_logits(path, ids, right)
    autocast = _gap(path, ids, right, want, dtype=jnp.bfloat16)
    all_bf16 = _gap(path, ids, right, want, dtype=jnp.bfloat16, residual_dtype=jnp.bfloat16)
    bound, fraction = BOUNDS.get(family, (3.5e-3, 0.5))
    assert autocast < bound, autocast
    assert autocast < fraction * all_bf16, (autocast, all_bf16)


def test_residual_dtype_follows_torch_promotion(hf_causal):
    """f32 params + bf16 matmuls keep the residual stream f32 (autocast); bf16 params run all in
    bf16 (a bf16-loaded HF model); `residual_dtype` overrides."""
    hf_config = transformers.AutoConfig.from_pretrained(hf_causal("llama").path)
    cases = [
        (dict(dtype=jnp.bfloat16), jnp.float32),
        (dict(param_dtype=jnp.bfloat16), jnp.bfloat16),
        (dict(dtype=jnp.bfloat16, residual_dtype=jnp.bfloat16), jnp.bfloat16),
        ({}, jnp.float32),
    ]
    for dtypes, residual in cases:
        assert config_from_hf(hf_config, **dtypes).residual_dtype == residual, dtypes
    model = from_pretrained(hf_causal("llama").path, dtype=jnp.bfloat16)
    ids, right, _ = padded_batch()
    hidden = jax.jit(lambda i, m: model.hidden_states(i, m))(jnp.asarray(ids), jnp.asarray(right))
    assert hidden.dtype == jnp.float32
