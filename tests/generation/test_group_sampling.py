"""`group_size`: each prompt is prefilled once and its cache rows serve its whole group. Greedy
groups repeat the single-sample rows exactly (scanned and unscanned caches); sampled groups
differ within a group and their log-probs equal a full forward of the produced rows."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from jaxrl import models
from jaxrl.algos.rollout import completion_logprobs
from jaxrl.generation import GenerationConfig, Sampler
from tests.generation.conftest import ragged_prompts


@pytest.mark.slow
@pytest.mark.parametrize("scan", [False, True])
def test_greedy_group_repeats_single_rows(hf_causal, scan):
    model = models.from_pretrained(hf_causal("llama").path, scan_layers=scan)
    sampler = Sampler(model)
    config = GenerationConfig(max_new_tokens=6)
    prompts = ragged_prompts()
    one = sampler(None, prompts, config)
    group = sampler(None, prompts, config, group_size=3)
    for field_one, field_group in zip(one, group, strict=True):
        np.testing.assert_array_equal(np.repeat(np.asarray(field_one), 3, axis=0), field_group)


def test_sampled_group_logprobs_equal_forward(hf_causal):
    model = models.from_pretrained(hf_causal("llama").path)
    config = GenerationConfig(max_new_tokens=6, do_sample=True, temperature=0.7, top_k=0)
    out = Sampler(model)(None, ragged_prompts(), config, seed=3, group_size=4)
    ids = np.asarray(out.completion_ids_BN)
    assert ids.shape[0] == 16
    assert any(len({tuple(r) for r in ids[i * 4 : i * 4 + 4]}) > 1 for i in range(4))
    batch = {
        "input_ids": np.concatenate([out.prompt_ids_BP, out.completion_ids_BN], axis=1),
        "attention_mask": np.concatenate([out.prompt_mask_BP, out.completion_mask_BN], axis=1),
        "completion_mask": out.completion_mask_BN,
    }
    logps = jax.jit(lambda b: completion_logprobs(model, b, temperature=0.7, chunk_size=128))(batch)
    mask = np.asarray(out.completion_mask_BN) > 0
    np.testing.assert_allclose(
        np.asarray(out.logprobs_BN)[mask], np.asarray(logps)[mask], atol=1e-5
    )
