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
    model = transformers.AutoModelForCausalLM.from_pretrained(path, attn_implementation="sdpa")
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
# positions. `gemma3` (Gemma's norms: 1 + weight in f32, rounded to the input's dtype, bf16
# after attention and the MLP; embedding multiplier; scores scaled by query_pre_attn_scalar):
# 3.6e-3 against 1.2e-2 all-bf16, in a model whose own autocast-vs-f32 gap is 9.6e-3 (qwen3's
# 5.2e-3); 7.1e-3 when the scale was folded into the queries before their bf16 rounding.
@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "gpt2", "gemma3"])
def test_bf16_logits_match_torch_autocast(family, hf_causal):
    path = hf_causal(family).path
    ids, right, _ = padded_batch(seed=4, seq_len=16)
    want = _autocast_logits(path, ids, right)
    autocast = _gap(path, ids, right, want, dtype=jnp.bfloat16)
    all_bf16 = _gap(path, ids, right, want, dtype=jnp.bfloat16, residual_dtype=jnp.bfloat16)
    assert autocast < (5e-3 if family == "gemma3" else 3.5e-3), autocast
    assert autocast < 0.5 * all_bf16, (autocast, all_bf16)


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
