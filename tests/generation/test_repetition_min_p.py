"""`repetition_penalty` and `min_p` behave as in transformers: greedy decoding with a penalty
equals `generate` token for token (ragged, left- and right-padded prompts); one step's processed
logits equal transformers' own processor list (its order, its seen tokens: prompt without its
left padding, plus the completion so far); min-p keeps the tokens at or above min_p x the top
probability and, at 1.0, only the argmax; the group (shared-prefill) path honours both."""

from __future__ import annotations

import copy

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

from jaxrl import models
from jaxrl.core.sampling import filter_min_p, mark_seen, process_logits, token_presence
from jaxrl.generation import GenerationConfig, Sampler, left_pad
from tests.generation.conftest import hf_generate, ragged_prompts
from tests.generation.test_generate_parity import emitted_eos
from tests.model_calls import merged_call
from tests.models.conftest import FAMILIES, _build

N_NEW = 10


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """A tiny random Llama of its own (hf_causal's seed depends on the order families are built
    in, and the checks below that each feature changes the output rest on this one's)."""
    factory, kwargs = FAMILIES["llama"]
    path = tmp_path_factory.mktemp("llama_rep")
    return _build(factory, kwargs, path, transformers.AutoModelForCausalLM, seed=0)


@pytest.fixture(scope="module")
def sampler(llama):
    return Sampler(models.from_pretrained(llama.path))


def hf_greedy(model, prompts, pad, **kwargs) -> tuple[np.ndarray, np.ndarray]:
    """transformers greedy `generate` of `N_NEW` tokens on prompts left-padded with `pad`."""
    return hf_generate(model, prompts, pad=pad, max_new_tokens=N_NEW, do_sample=False, **kwargs)


@pytest.fixture(scope="module")
def extended_prompts(llama):
    """Each prompt ends with the first two tokens the model continues it with, so that the
    penalty on prompt tokens changes the completions; and transformers' greedy completions of
    them without a penalty. Penalty-independent, so built once for both penalties."""
    prompts = ragged_prompts(seed=1)
    plain, _ = hf_greedy(llama.model, prompts, pad=0, eos_token_id=None)
    prompts = [p + plain[i, :2].tolist() for i, p in enumerate(prompts)]
    plain, _ = hf_greedy(llama.model, prompts, pad=0, eos_token_id=None)
    return prompts, plain


@pytest.mark.parametrize("penalty", [1.3, 0.7])
def test_greedy_repetition_penalty_matches_transformers_generate(
    llama, sampler, extended_prompts, penalty
):
    prompts = [list(p) for p in extended_prompts[0]]
    plain = extended_prompts[1].copy()
    free, _ = hf_greedy(llama.model, prompts, pad=0, eos_token_id=None, repetition_penalty=penalty)
    assert (free != plain).any()  # the penalty changes the greedy completions
    width = max(map(len, prompts))
    completion_only = transformers.RepetitionPenaltyLogitsProcessor(
        penalty, prompt_ignore_length=width
    )
    ignoring_prompts, _ = hf_greedy(
        llama.model,
        prompts,
        pad=0,
        eos_token_id=None,
        logits_processor=transformers.LogitsProcessorList([completion_only]),
    )
    assert (free != ignoring_prompts).any()  # and so does counting the prompt tokens
    # The pad id is the token the rows generate most that no prompt holds: were the padding of
    # the (left- or right-) padded prompts counted as seen, it would be penalised in every
    # padded row.
    counts = np.bincount(free.reshape(-1), minlength=max(map(max, prompts)) + 1)
    counts[[i for p in prompts for i in p]] = 0
    pad = int(counts.argmax())
    assert counts[pad] > 1
    _, _, eos = emitted_eos(free)  # one row ends early, the others run on
    want, raw_logits = hf_greedy(
        llama.model, prompts, pad=pad, eos_token_id=eos, repetition_penalty=penalty
    )
    config = GenerationConfig(
        max_new_tokens=N_NEW, eos_token_id=eos, pad_token_id=pad, repetition_penalty=penalty
    )
    right = np.array([p + [pad] * (width - len(p)) for p in prompts])
    right_mask = np.array([[1] * len(p) + [0] * (width - len(p)) for p in prompts])
    left = np.array([[pad] * (width - len(p)) + p for p in prompts])
    left_mask = right_mask[:, ::-1].copy()
    runs = {
        "ragged": sampler(None, prompts, config),
        "right-padded": sampler(None, right, config, prompt_mask=right_mask),
        "left-padded": sampler(None, left, config, prompt_mask=left_mask),
    }
    for name, out in runs.items():
        np.testing.assert_array_equal(np.asarray(out.completion_ids_BN), want, err_msg=name)
    # Log-probs stay those of the model (log_softmax of the raw logits), not of the penalised ones.
    out = runs["ragged"]
    mask = np.asarray(out.completion_mask_BN).astype(bool)
    steps = raw_logits.shape[1]
    want_lp = np.asarray(jax.nn.log_softmax(jnp.asarray(raw_logits), axis=-1))
    want_lp = np.take_along_axis(want_lp, want[:, :steps, None], axis=-1)[..., 0]
    np.testing.assert_allclose(
        np.asarray(out.logprobs_BN)[:, :steps][mask[:, :steps]],
        want_lp[mask[:, :steps]],
        atol=2e-4,
    )


def hf_processor_list(model, hf_config, attention_mask, prompt_width):
    """The processors transformers' `generate` builds for `hf_config` (its order)."""
    hf_config = copy.deepcopy(hf_config)
    model._prepare_special_tokens(hf_config, kwargs_has_attention_mask=True, device="cpu")
    return model._get_logits_processor(
        hf_config,
        input_ids_seq_length=prompt_width,
        device="cpu",
        model_kwargs={"attention_mask": attention_mask},
    )


PROCESSOR_CASES = {
    "greedy penalty": dict(do_sample=False, repetition_penalty=1.3),
    "greedy penalty, min_new_tokens": dict(
        do_sample=False, repetition_penalty=2.0, min_new_tokens=6, eos_token_id=[3, 5]
    ),
    "reward repeats, all warpers": dict(
        do_sample=True, repetition_penalty=0.7, temperature=0.6, top_k=40, top_p=0.9, min_p=0.05
    ),
    "penalty, min_new_tokens, min_p": dict(
        do_sample=True,
        repetition_penalty=1.5,
        temperature=1.7,
        top_k=0,
        min_p=0.2,
        min_new_tokens=6,
        eos_token_id=[3, 5],
    ),
    "min_p after top_k/top_p": dict(
        do_sample=True, temperature=0.8, top_k=20, top_p=0.7, min_p=0.3
    ),
}


@pytest.mark.parametrize("case", list(PROCESSOR_CASES))
def test_processed_logits_match_transformers_processors(llama, case):
    """Step 4 of a batch of 5 rows (left-padded prompts with pad id 7, one row unpadded) on
    random logits with negative and zero entries: `process_logits` equals transformers'
    processor list for the same GenerationConfig applied to prompt + completion ids."""
    batch, vocab, width, step, pad = 5, 128, 9, 4, 7
    rng = np.random.default_rng(0)
    lengths = np.array([9, 4, 1, 6, 3])
    mask_BP = (np.arange(width)[None] >= width - lengths[:, None]).astype(np.int64)
    ids_BP = np.where(mask_BP == 1, rng.integers(8, vocab, (batch, width)), pad)
    new_BT = rng.integers(8, vocab, (batch, step))
    logits_BV = (rng.normal(size=(batch, vocab)) * 3).astype(np.float32)
    logits_BV[:, ::11] = 0.0
    logits_BV[:, pad] = np.abs(logits_BV[:, pad]) + 1.0  # left padding is not a seen token
    hf_config = transformers.GenerationConfig(
        max_new_tokens=N_NEW, pad_token_id=pad, **PROCESSOR_CASES[case]
    )
    processors = hf_processor_list(llama.model, hf_config, torch.tensor(mask_BP), width)
    all_ids = torch.tensor(np.concatenate([ids_BP, new_BT], axis=1))
    want = processors(all_ids, torch.tensor(logits_BV)).numpy()

    config = GenerationConfig.from_transformers(hf_config)
    seen_BV = token_presence(jnp.asarray(ids_BP), jnp.asarray(mask_BP), vocab)
    for t in range(step):
        seen_BV = mark_seen(seen_BV, jnp.asarray(new_BT[:, t], jnp.int32))
    got = np.asarray(jax.jit(process_logits, static_argnums=2)(logits_BV, step, config, seen_BV))
    np.testing.assert_array_equal(np.isneginf(got), np.isneginf(want))
    finite = ~np.isneginf(want)
    # XLA:CPU divides by a scalar as a multiply by its reciprocal: within an ulp of torch.
    np.testing.assert_allclose(got[finite], want[finite], rtol=1e-6, atol=1e-7)
    if config.repetition_penalty != 1.0:
        seen = np.zeros((batch, vocab), bool)
        for row in range(batch):
            seen[row, ids_BP[row][mask_BP[row] == 1]] = True
            seen[row, new_BT[row]] = True
        assert not seen[:, pad].any()
        scaled = logits_BV / (config.temperature if config.do_sample else 1.0)
        penalised = ~np.isclose(got, scaled, rtol=1e-6, atol=0)
        assert (penalised[finite & (logits_BV != 0)] == seen[finite & (logits_BV != 0)]).all()


def test_min_p_one_keeps_only_the_argmax(sampler):
    logits_BV = jax.random.normal(jax.random.key(0), (16, 300)) * 2.0
    for min_p in (1.0, 0.9999):
        kept_BV = np.isfinite(np.asarray(filter_min_p(logits_BV, min_p)))
        np.testing.assert_array_equal(kept_BV.sum(-1), 1)
        np.testing.assert_array_equal(kept_BV.argmax(-1), np.asarray(logits_BV).argmax(-1))
    # Sampling hot with min_p=1 is greedy decoding.
    prompts = ragged_prompts(seed=2)
    greedy = sampler(None, prompts, GenerationConfig(max_new_tokens=N_NEW, pad_token_id=0))
    hot = GenerationConfig(
        max_new_tokens=N_NEW, pad_token_id=0, do_sample=True, temperature=3.0, top_k=0, min_p=1.0
    )
    for seed in (0, 1):
        out = sampler(None, prompts, hot, seed=seed)
        np.testing.assert_array_equal(
            np.asarray(out.completion_ids_BN), np.asarray(greedy.completion_ids_BN)
        )


def forward_logits(sampler, out) -> np.ndarray:
    """Raw logits [B, N, V] of a plain forward over prompt + completion (float64)."""
    ids = np.concatenate([out.prompt_ids_BP, out.completion_ids_BN], axis=1)
    mask = np.concatenate([out.prompt_mask_BP, out.completion_mask_BN], axis=1)
    logits = np.asarray(merged_call(sampler.graphdef, sampler.params, ids, mask), dtype=np.float64)
    return logits[:, out.prompt_ids_BP.shape[1] - 1 : -1]


def below_min_p(sampler, out, temperature, min_p) -> np.ndarray:
    """[B, N] bool: the sampled token's probability (temperature-scaled, unpenalised) is below
    min_p x the most likely token's (up to float32 noise)."""
    out = jax.tree.map(np.asarray, out)
    scaled = forward_logits(sampler, out) / temperature
    token = np.take_along_axis(scaled, out.completion_ids_BN[..., None], axis=-1)[..., 0]
    # p(token) / p(top) = exp(token - max)
    below = token - scaled.max(-1) < np.log(min_p) - 1e-4
    return below & out.completion_mask_BN.astype(bool)


@pytest.mark.parametrize("group_size", [1, 4])
def test_sampled_tokens_clear_the_min_p_threshold(sampler, group_size):
    prompts = ragged_prompts(seed=2)
    # The tiny model's logits span ~1: a low temperature makes min-p bite.
    temperature, min_p = 0.2, 0.3
    kw = dict(max_new_tokens=N_NEW, pad_token_id=0, do_sample=True, temperature=temperature)
    kw["top_k"] = 0
    with_min_p = sampler(
        None, prompts, GenerationConfig(**kw, min_p=min_p), seed=3, group_size=group_size
    )
    without = sampler(None, prompts, GenerationConfig(**kw), seed=3, group_size=group_size)
    assert not below_min_p(sampler, with_min_p, temperature, min_p).any()
    # Same draws without min-p do land below the threshold: the check above has teeth.
    assert below_min_p(sampler, without, temperature, min_p).sum() >= 3
    ids = np.asarray(with_min_p.completion_ids_BN)
    assert ids.shape[0] == 4 * group_size
    if group_size > 1:  # still sampling: the rows of a group differ
        assert any(len({tuple(r) for r in ids[i * 4 : i * 4 + 4]}) > 1 for i in range(4))


@pytest.mark.parametrize("scan", [False, True])
def test_group_sampling_honours_the_repetition_penalty(llama, scan):
    """Greedy groups with a penalty repeat the single-sample rows (which the parity test above
    ties to transformers); sampled groups with a penalty and min-p only draw tokens that
    transformers' processors, replayed on a full forward with each row's own history, keep."""
    sampler = Sampler(models.from_pretrained(llama.path, scan_layers=scan))
    prompts = ragged_prompts(seed=1)
    config = GenerationConfig(max_new_tokens=N_NEW, pad_token_id=0, repetition_penalty=1.3)
    one = sampler(None, prompts, config)
    group = sampler(None, prompts, config, group_size=3)
    plain = sampler(None, prompts, GenerationConfig(max_new_tokens=N_NEW, pad_token_id=0))
    assert (np.asarray(one.completion_ids_BN) != np.asarray(plain.completion_ids_BN)).any()
    for field_one, field_group in zip(one, group, strict=True):
        np.testing.assert_array_equal(np.repeat(np.asarray(field_one), 3, axis=0), field_group)

    sampled = GenerationConfig(
        max_new_tokens=N_NEW,
        pad_token_id=0,
        do_sample=True,
        temperature=0.2,
        top_k=0,
        repetition_penalty=3.0,
        min_p=0.3,
    )
    out = jax.tree.map(np.asarray, sampler(None, prompts, sampled, seed=5, group_size=4))
    logits = forward_logits(sampler, out).astype(np.float32)
    penalty = transformers.RepetitionPenaltyLogitsProcessor(3.0)
    warpers = [transformers.TemperatureLogitsWarper(0.2), transformers.MinPLogitsWarper(0.3)]
    rejected_without_penalty = 0
    for row in range(out.completion_ids_BN.shape[0]):
        prompt = out.prompt_ids_BP[row][out.prompt_mask_BP[row] == 1]
        for t in range(int(out.completion_mask_BN[row].sum())):
            history = torch.tensor(np.concatenate([prompt, out.completion_ids_BN[row, :t]]))[None]
            scores = torch.tensor(logits[row, t])[None]
            token = out.completion_ids_BN[row, t]
            kept = penalty(history, scores.clone())
            for warp in warpers:
                kept = warp(history, kept)
            assert torch.isfinite(kept[0, token]), (row, t)
            unpenalised = scores
            for warp in warpers:
                unpenalised = warp(history, unpenalised)
            rejected_without_penalty += not torch.isfinite(unpenalised[0, token])
    assert rejected_without_penalty > 0  # the draws follow the penalised distribution


def test_samplers_of_one_model_structure_share_their_programs(sampler, llama):
    """A second sampler of a model with the same structure (another load of the checkpoint, as
    a second trainer builds) reuses the compiled prefill and decode programs: the same tokens,
    nothing compiled again."""
    from jaxrl.generation import continuous

    programs = (continuous.refill_program, continuous.decode_program)
    config = GenerationConfig(max_new_tokens=3)
    prompts = ragged_prompts(seed=2)
    first = sampler(None, prompts, config, seed=1)
    sizes = [program._cache_size() for program in programs]
    again = Sampler(models.from_pretrained(llama.path))(None, prompts, config, seed=1)
    assert sizes == [program._cache_size() for program in programs]
    np.testing.assert_array_equal(
        np.asarray(again.completion_ids_BN), np.asarray(first.completion_ids_BN)
    )


def test_state_carries_a_seen_mask_only_with_a_penalty(sampler):
    ids, mask = left_pad(ragged_prompts(seed=1), None, None, 0)
    args = (sampler.params, jnp.asarray(ids), jnp.asarray(mask), jax.random.key(0))
    plain = sampler._prefill(*args, GenerationConfig(max_new_tokens=3, min_p=0.1), 2)
    assert plain.seen_BV is None
    config = GenerationConfig(max_new_tokens=3, repetition_penalty=1.2)
    state = sampler._prefill(*args, config, 2)
    seen = np.asarray(state.seen_BV)
    assert seen.shape == (8, 128) and seen.dtype == bool
    for row in range(8):
        want = set(ids[row // 2][mask[row // 2] == 1]) | {int(state.tokens_BN[row, 0])}
        assert set(np.flatnonzero(seen[row])) == want


def test_config_values_and_from_transformers():
    for bad in (0.0, -1.0, float("nan")):
        with pytest.raises(ValueError, match="repetition_penalty must be > 0"):
            GenerationConfig(repetition_penalty=bad)
    for bad in (-0.1, 1.5, float("nan")):
        with pytest.raises(ValueError, match=r"min_p must be in \[0, 1\]"):
            GenerationConfig(do_sample=True, min_p=bad)
    assert GenerationConfig(repetition_penalty=2).repetition_penalty == 2.0
    assert GenerationConfig(min_p=0).min_p == 0.0

    hf = transformers.GenerationConfig(
        max_new_tokens=5, do_sample=True, repetition_penalty=1.2, min_p=0.05
    )
    config = GenerationConfig.from_transformers(hf)
    assert (config.repetition_penalty, config.min_p) == (1.2, 0.05)
    default = GenerationConfig.from_transformers(transformers.GenerationConfig(max_new_tokens=5))
    assert (default.repetition_penalty, default.min_p) == (1.0, None)
    with pytest.raises(ValueError, match="no_repeat_ngram_size"):
        GenerationConfig.from_transformers(
            transformers.GenerationConfig(max_new_tokens=5, no_repeat_ngram_size=2)
        )
