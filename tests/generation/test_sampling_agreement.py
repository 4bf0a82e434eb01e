"""TRL's sampling-correction metrics (`jaxrl.algos.rollout.sampling_correction_metrics`): equal
to TRL's formulas (computed here with torch as `GRPOTrainer` does) in every importance-sampling
mode; and on a real model the sampler's log-probs agree with the training forward's on the same
rows: to 1e-5 in float32, and within the bound below in bfloat16.

bf16 bound: the sampler's cached decode and the training forward run different programs
(one token at a time against a cache vs the whole row), so a bf16 model's activations round
differently; the log-probs themselves are float32 from float32 logits. Measured on this tiny
Llama (8 rows x 12 tokens, temperature 0.7): |diff| max 0.0028, mean 0.00064, sequence ratios in
[0.994, 1.003]; the bound asserted is |diff| max < 0.02, mean < 0.005, ratios within [0.95, 1.05]
(float32: max 9.5e-7)."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx

from jaxrl import models
from jaxrl.algos.rollout import make_policy_logps, rollout_sampling_metrics
from jaxrl.algos.rollout import sampling_correction_metrics as metrics_of
from jaxrl.generation import GenerationConfig, Sampler
from jaxrl.trainers.grpo_config import GRPOConfig
from tests.generation.conftest import ragged_prompts

MODES = ["sequence_mask", "sequence_truncate", "token_mask", "token_truncate"]


def trl_metrics(old, sampling, mask, mode, clip_min, clip_max) -> dict[str, float]:
    """GRPOTrainer's `_generate_and_score_completions` lines for these metrics, in torch."""
    old, sampling, mask = (torch.tensor(np.asarray(x, np.float64)) for x in (old, sampling, mask))
    diff = (old - sampling) * mask
    logps_diff = diff.sum(-1, keepdim=True) if mode.startswith("sequence") else diff
    ratio = torch.exp(logps_diff)
    if mode.endswith("truncate"):
        ratio = torch.clamp(ratio, min=clip_min, max=clip_max)
    else:
        lo = clip_min if clip_min is not None else -math.inf
        hi = clip_max if clip_max is not None else math.inf
        ratio = ratio.masked_fill((ratio < lo) | (ratio > hi), 0.0)
    delta = torch.abs(old - sampling)[mask.bool()]
    flat = ratio.flatten() if mode.startswith("sequence") else ratio[mask.bool()]
    return {
        "sampling/sampling_logp_difference/mean": delta.mean().item(),
        "sampling/sampling_logp_difference/max": delta.max().item(),
        "sampling/importance_sampling_ratio/min": flat.min().item(),
        "sampling/importance_sampling_ratio/mean": flat.mean().item(),
        "sampling/importance_sampling_ratio/max": flat.max().item(),
    }


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(("clip_min", "clip_max"), [(None, 3.0), (0.5, 1.5)])
def test_metrics_equal_trls_formulas(mode, clip_min, clip_max):
    rng = np.random.default_rng(0)
    sampling = rng.normal(-2.0, 1.0, (5, 6)).astype(np.float32)
    old = sampling + rng.normal(0.0, 0.3, (5, 6)).astype(np.float32)
    mask = np.ones((5, 6), np.float32)
    mask[1, 4:] = 0
    mask[3, 1:] = 0
    got = metrics_of(
        jnp.asarray(old), jnp.asarray(sampling), jnp.asarray(mask),
        mode=mode, clip_min=clip_min, clip_max=clip_max,
    )  # fmt: skip
    want = trl_metrics(old, sampling, mask, mode, clip_min, clip_max)
    assert got.keys() == want.keys()
    for key, value in want.items():
        np.testing.assert_allclose(float(got[key]), value, rtol=1e-5, atol=1e-6, err_msg=key)
    # Masked tokens do not count: changing them changes nothing.
    moved = jnp.asarray(np.where(mask == 0, old + 5.0, old))
    again = metrics_of(moved, jnp.asarray(sampling), jnp.asarray(mask), mode=mode,
                       clip_min=clip_min, clip_max=clip_max)  # fmt: skip
    for key in want:
        assert float(again[key]) == pytest.approx(float(got[key]), rel=1e-6)


def test_no_completion_token_gives_zeros():
    zeros = jnp.zeros((2, 3))
    got = metrics_of(zeros, zeros + 1.0, zeros, mode="token_mask")
    assert all(float(v) == 0.0 for v in got.values())
    with pytest.raises(ValueError, match="Unknown importance sampling mode"):
        metrics_of(zeros, zeros, zeros, mode="token")


def sampled_rollout(path, dtype: str, temperature: float):
    """A sampled rollout of the tiny Llama in `dtype`, its rows as the trainer builds them, and
    the training forward's log-probs of them (`make_policy_logps`, the trainer's scoring pass)."""
    model = models.from_pretrained(path, dtype=dtype, param_dtype=dtype)
    config = GenerationConfig(
        max_new_tokens=12, do_sample=True, temperature=temperature, top_k=0, eos_token_id=5
    )
    # Per-row limits end some rows early (their completion mask and log-probs are 0 after).
    limits = [12, 5, 9, 3]
    sampler = Sampler(model)
    out = sampler(None, ragged_prompts(seed=3), config, seed=7, group_size=2, max_new_tokens=limits)
    batch = {
        "input_ids": jnp.concatenate([out.prompt_ids_BP, out.completion_ids_BN], axis=1),
        "attention_mask": jnp.concatenate([out.prompt_mask_BP, out.completion_mask_BN], axis=1),
        "completion_mask": out.completion_mask_BN,
    }
    graphdef, params = nnx.split(model)
    args = GRPOConfig(output_dir="unused", temperature=temperature, logprob_chunk_size=4)
    train = jax.jit(make_policy_logps(args, lambda p: nnx.merge(graphdef, p)))(params, batch)
    return args, train, out, batch


def test_sampler_agrees_with_the_training_forward_in_float32(hf_causal):
    args, train, out, batch = sampled_rollout(hf_causal("llama").path, "float32", 0.7)
    mask = np.asarray(batch["completion_mask"])
    assert mask.sum() > 20 and (mask.sum(1) < mask.shape[1]).any()  # some rows stop early
    got = {
        k: float(v)
        for k, v in rollout_sampling_metrics(args, train, out.logprobs_BN, batch).items()
    }
    assert got["sampling/sampling_logp_difference/max"] < 1e-5
    for key in ("min", "mean", "max"):
        assert abs(got[f"sampling/importance_sampling_ratio/{key}"] - 1.0) < 1e-5
    # The metric is not blind: log-probs off by 10% show up in it.
    shifted = rollout_sampling_metrics(args, train * 1.1, out.logprobs_BN, batch)
    assert float(shifted["sampling/sampling_logp_difference/max"]) > 1e-2


def test_sampler_agrees_with_the_training_forward_in_bfloat16(hf_causal):
    args, train, out, batch = sampled_rollout(hf_causal("llama").path, "bfloat16", 0.7)
    got = {
        k: float(v)
        for k, v in rollout_sampling_metrics(args, train, out.logprobs_BN, batch).items()
    }
    assert 0.0 < got["sampling/sampling_logp_difference/max"] < 0.02
    assert got["sampling/sampling_logp_difference/mean"] < 0.005
    assert 0.95 < got["sampling/importance_sampling_ratio/min"]
    assert got["sampling/importance_sampling_ratio/max"] < 1.05
