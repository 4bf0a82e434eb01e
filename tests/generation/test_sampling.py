"""Sampling options of `jaxrl.generation`: seeds, temperature/top-k/top-p, log-probs against a
full forward, stop ids, prompt formats, config conversion and input errors."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import transformers

from jaxrl import models
from jaxrl.core.sampling import sample_categorical
from jaxrl.generation import GenerationConfig, Sampler
from tests.generation.conftest import PAD, ragged_prompts
from tests.model_calls import merged_call

N_NEW = 8


@pytest.fixture(scope="module")
def sampler(hf_causal):
    return Sampler(models.from_pretrained(hf_causal("llama").path))


def run(sampler, prompts=None, **config):
    prompts = ragged_prompts(seed=2) if prompts is None else prompts
    seed = config.pop("seed", 0)
    config = GenerationConfig(max_new_tokens=N_NEW, pad_token_id=PAD, **config)
    return jax.tree.map(np.asarray, sampler(None, prompts, config, seed=seed))


def test_sampling_is_reproducible_from_the_seed(sampler):
    a = run(sampler, do_sample=True, top_k=0, seed=3)
    b = run(sampler, do_sample=True, top_k=0, seed=3)
    c = run(sampler, do_sample=True, top_k=0, seed=4)
    np.testing.assert_array_equal(a.completion_ids_BN, b.completion_ids_BN)
    np.testing.assert_array_equal(a.logprobs_BN, b.logprobs_BN)
    assert (a.completion_ids_BN != c.completion_ids_BN).any()
    key = run(sampler, do_sample=True, top_k=0, seed=jax.random.key(3))  # a key works too
    np.testing.assert_array_equal(a.completion_ids_BN, key.completion_ids_BN)


@pytest.mark.slow
def test_top_k_1_and_tiny_top_p_are_greedy(sampler):
    greedy = run(sampler).completion_ids_BN
    top_k_1 = run(sampler, do_sample=True, top_k=1, temperature=2.0, seed=1)
    tiny_p = run(sampler, do_sample=True, top_k=0, top_p=1e-6, temperature=2.0, seed=1)
    np.testing.assert_array_equal(top_k_1.completion_ids_BN, greedy)
    np.testing.assert_array_equal(tiny_p.completion_ids_BN, greedy)
    # Log-probs stay those of the temperature-scaled distribution, not of the filtered one.
    assert (top_k_1.logprobs_BN < -0.1).any()


def full_forward_logprobs(sampler, out, temperature):
    """log_softmax(logits / T) [B, N, V] of a plain forward over prompt + completion."""
    ids = np.concatenate([out.prompt_ids_BP, out.completion_ids_BN], axis=1)
    mask = np.concatenate([out.prompt_mask_BP, out.completion_mask_BN], axis=1)
    logits = merged_call(sampler.graphdef, sampler.params, jnp.asarray(ids), jnp.asarray(mask))
    logits = np.asarray(logits, dtype=np.float64)
    p = out.prompt_ids_BP.shape[1]
    scaled = logits[:, p - 1 : -1] / temperature
    scaled -= scaled.max(-1, keepdims=True)
    return scaled - np.log(np.exp(scaled).sum(-1, keepdims=True))


@pytest.mark.slow
@pytest.mark.parametrize(("temperature", "top_k", "top_p"), [(0.7, 20, 0.9), (1.3, 0, 0.5)])
def test_sampled_logprobs_and_filters_match_a_full_forward(sampler, temperature, top_k, top_p):
    out = run(sampler, do_sample=True, temperature=temperature, top_k=top_k, top_p=top_p, seed=5)
    mask = out.completion_mask_BN.astype(bool)
    all_lp = full_forward_logprobs(sampler, out, temperature)
    want = np.take_along_axis(all_lp, out.completion_ids_BN[..., None], axis=-1)[..., 0]
    np.testing.assert_allclose(out.logprobs_BN[mask], want[mask], atol=1e-4)
    # Every sampled token survived top-k, then top-p (on the top-k renormalised distribution).
    picked = all_lp[mask]
    token_lp = want[mask]
    rank = (picked > token_lp[:, None] + 1e-6).sum(-1)
    if top_k:
        assert rank.max() < top_k
        kth = -np.sort(-picked, axis=-1)[:, top_k - 1 : top_k]
        picked = np.where(picked >= kth, picked, -np.inf)
    probs = np.exp(picked - np.log(np.exp(picked).sum(-1, keepdims=True)))
    mass_before = np.where(picked > token_lp[:, None] + 1e-6, probs, 0.0).sum(-1)
    assert (mass_before < top_p + 1e-5).all()
    assert rank.max() > 0  # sampling, not argmax


@pytest.mark.slow
def test_stop_token_ids_end_completions_like_eos(sampler):
    free = run(sampler).completion_ids_BN
    stop_a, stop_b = int(free[0, 2]), int(free[1, 4])
    as_eos = run(sampler, eos_token_id=[stop_a, stop_b])
    as_stop = run(sampler, eos_token_id=stop_a, stop_token_ids=(stop_b,))
    for field in ("completion_ids_BN", "completion_mask_BN", "logprobs_BN"):
        np.testing.assert_array_equal(getattr(as_eos, field), getattr(as_stop, field))
    ids, mask = as_stop.completion_ids_BN, as_stop.completion_mask_BN
    for row in range(ids.shape[0]):
        hits = np.flatnonzero(np.isin(ids[row], [stop_a, stop_b]))
        end = hits[0] + 1 if len(hits) else N_NEW
        assert mask[row].tolist() == [1] * end + [0] * (N_NEW - end)
        assert (ids[row, end:] == PAD).all() and (as_stop.logprobs_BN[row, end:] == 0).all()
        np.testing.assert_array_equal(ids[row, :end], free[row, :end])
    assert mask[0].sum() <= 3 and mask[1].sum() <= 5
    late = run(sampler, eos_token_id=stop_a, stop_token_ids=(stop_b,), min_new_tokens=6)
    assert late.completion_mask_BN[:, :6].all()
    assert not np.isin(late.completion_ids_BN[:, :6], [stop_a, stop_b]).any()


def test_prompt_formats_give_the_same_completions(sampler):
    prompts = ragged_prompts(seed=2)
    width = max(map(len, prompts))
    right = np.array([p + [PAD] * (width - len(p)) for p in prompts])
    right_mask = np.array([[1] * len(p) + [0] * (width - len(p)) for p in prompts])
    ragged = run(sampler, prompts, do_sample=True, seed=7)
    config = GenerationConfig(max_new_tokens=N_NEW, pad_token_id=PAD, do_sample=True)
    padded = sampler(None, right, config, prompt_mask=right_mask, seed=7)
    np.testing.assert_array_equal(np.asarray(padded.completion_ids_BN), ragged.completion_ids_BN)
    np.testing.assert_array_equal(np.asarray(padded.prompt_ids_BP), ragged.prompt_ids_BP)
    # Left padding to the bucket: the last prompt slot of every row is its last real token.
    assert ragged.prompt_ids_BP.shape[1] == 16
    assert [row[-1] for row in ragged.prompt_ids_BP] == [p[-1] for p in prompts]
    np.testing.assert_array_equal(ragged.prompt_mask_BP.sum(1), [len(p) for p in prompts])


def test_graphdef_and_params_like_a_model(sampler):
    by_graphdef = Sampler(sampler.graphdef)
    config = GenerationConfig(max_new_tokens=N_NEW, pad_token_id=PAD)
    out = by_graphdef(sampler.params, ragged_prompts(seed=2), config)
    np.testing.assert_array_equal(np.asarray(out.completion_ids_BN), run(sampler).completion_ids_BN)
    with pytest.raises(ValueError, match="pass its params"):
        by_graphdef(None, [[3, 4]], config)


def test_from_transformers_generation_config():
    hf = transformers.GenerationConfig(
        max_new_tokens=12, do_sample=True, temperature=0.5, top_p=0.8, eos_token_id=[2, 7]
    )
    config = GenerationConfig.from_transformers(hf, pad_token_id=0)
    assert config == GenerationConfig(
        max_new_tokens=12,
        do_sample=True,
        temperature=0.5,
        top_k=50,  # transformers' default when unset
        top_p=0.8,
        eos_token_id=(2, 7),
        pad_token_id=0,
    )
    assert config.stop_ids == (2, 7)
    with pytest.raises(ValueError, match="num_beams"):
        GenerationConfig.from_transformers(
            transformers.GenerationConfig(max_new_tokens=4, num_beams=2)
        )
    with pytest.raises(ValueError, match="max_new_tokens"):
        GenerationConfig.from_transformers(transformers.GenerationConfig())


def test_bad_inputs_raise_clear_errors(sampler):
    config = GenerationConfig(max_new_tokens=2)
    with pytest.raises(ValueError, match="empty"):
        sampler(None, [[3, 4], []], config)
    with pytest.raises(ValueError, match="prompt bucket"):
        Sampler(sampler.graphdef, prompt_buckets=(4,))(sampler.params, [[3] * 5], config)
    with pytest.raises(ValueError, match="temperature"):
        GenerationConfig(do_sample=True, temperature=0.0)
    with pytest.raises(ValueError, match="top_p"):
        GenerationConfig(top_p=0.0)


def test_categorical_draws_follow_the_softmax():
    """The two-level inverse-CDF draw has softmax(logits)'s frequencies (each token's count within
    5 binomial sigmas over 20000 draws) and never draws a token of zero probability, with a
    vocabulary that is not a multiple of the block."""
    vocab, rows, calls = 150, 40, 500
    logits_V = jax.random.normal(jax.random.key(0), (vocab,)) * 2.0
    logits_V = logits_V.at[::7].set(-jnp.inf)
    probs_V = np.asarray(jax.nn.softmax(logits_V))
    keys = jax.random.split(jax.random.key(1), calls)
    # One compiled program: un-jitted, the vmap runs op by op (54 s on one core vs 1.6 s).
    draw = jax.jit(
        jax.vmap(lambda k, l_V: sample_categorical(k, jnp.tile(l_V, (rows, 1))), (0, None))
    )
    draws = draw(keys, logits_V)
    counts_V = np.bincount(np.asarray(draws).reshape(-1), minlength=vocab)
    n = rows * calls
    assert counts_V.sum() == n and counts_V[::7].sum() == 0
    sigma_V = np.sqrt(n * probs_V * (1 - probs_V))
    assert np.all(np.abs(counts_V - n * probs_V) <= 5 * sigma_V + 1)
