"""Greedy decoding equals transformers `generate(do_sample=False)` token for token on every
family (ragged prompts in one batch; Mistral's window of 3 is shorter than prompt+completion),
with EOS and min_new_tokens behaving as in transformers, and greedy log-probs equal to
log_softmax of transformers' raw logits."""

from __future__ import annotations

import numpy as np
import pytest
import transformers

from jaxrl import models
from jaxrl.generation import GenerationConfig, Sampler
from tests.generation.conftest import PAD, hf_generate, ragged_prompts
from tests.models.conftest import FAMILIES, _build

N_NEW = 10
# The fast tier keeps one unscanned family and the scanned stack; the rest are slow.
FAST = {("gpt2", False), ("mistral", True), ("gemma3", True)}
SCANNED = [
    ("mistral", True), ("gemma3", True), ("smollm3", True), ("olmo3", True), ("qwen3_moe", True),
    ("gemma2", True), ("phi3", True), ("gpt_oss", True),
]  # fmt: skip
CASES = [
    pytest.param(*c, marks=() if c in FAST else pytest.mark.slow)
    # gemma3_vlm is gemma3's language model behind another loader (tests/models/test_image_text.py)
    # Each family's scanned case right after its unscanned one, so that both tend to run on one
    # xdist worker and share transformers' reference runs (`_hf_run`).
    for c in [
        case
        for family in FAMILIES
        if family != "gemma3_vlm"
        for case in [(family, False)] + [(f, s) for f, s in SCANNED if f == family]
    ]
]
assert sorted(c.values for c in CASES) == sorted(
    [(f, False) for f in FAMILIES if f != "gemma3_vlm"] + SCANNED
)  # the reordering keeps every case


def expected_mask(ids_BN: np.ndarray, eos: int) -> np.ndarray:
    """1 up to and including the first EOS of each row."""
    is_eos = ids_BN == eos
    seen_before = np.cumsum(is_eos, axis=1) - is_eos
    return (seen_before == 0).astype(np.int32)


def emitted_eos(free_run_BN: np.ndarray) -> tuple[int, int, int]:
    """(row, step, id) of a token the model first emits at that step of that row, used as EOS so
    that row stops there while others run on. Late steps first; tiny tied-embedding models that
    repeat one token from the start get their first token."""
    for first_step in (3, 0):
        for row, ids in enumerate(free_run_BN):
            for t in range(first_step, len(ids)):
                if ids[t] not in ids[:t]:
                    return row, t, int(ids[t])
    raise AssertionError("unreachable: step 0 always qualifies")


# transformers' outputs per (reference checkpoint, min_new_tokens): the scanned and unscanned
# cases of a family compare against the same reference model on the same prompts, so its
# `generate` runs once per worker, not once per case (the outputs are deterministic greedy runs).
_HF_RUNS: dict[tuple[str, int | None], tuple[np.ndarray, np.ndarray, int]] = {}


def _hf_run(ref, prompts, min_new: int | None) -> tuple[np.ndarray, np.ndarray, int]:
    """(ids, raw logits, eos) of transformers' greedy run: the free run (`min_new` None, eos
    unused) or the run stopping at the free run's `emitted_eos` id with `min_new`."""
    key = (str(ref.path), min_new)
    if key not in _HF_RUNS:
        if min_new is None:
            ids, logits = hf_generate(ref.model, prompts, max_new_tokens=N_NEW, do_sample=False)
            eos = -1
        else:
            eos = emitted_eos(_hf_run(ref, prompts, None)[0])[2]
            ids, logits = hf_generate(
                ref.model,
                prompts,
                max_new_tokens=N_NEW,
                do_sample=False,
                eos_token_id=eos,
                min_new_tokens=min_new,
            )
        _HF_RUNS[key] = (ids, logits, eos)
    ids, logits, eos = _HF_RUNS[key]
    return ids.copy(), logits.copy(), eos


def check_against_transformers(ref, sampler: Sampler, min_new_values: tuple[int, ...]) -> None:
    prompts = ragged_prompts(seed=1)
    free_run, _, _ = _hf_run(ref, prompts, None)
    eos_row, eos_step, eos = emitted_eos(free_run)
    for min_new in min_new_values:
        want_ids, want_logits, _ = _hf_run(ref, prompts, min_new)
        config = GenerationConfig(
            max_new_tokens=N_NEW, min_new_tokens=min_new, eos_token_id=eos, pad_token_id=PAD
        )
        out = sampler(None, prompts, config)
        got_ids = np.asarray(out.completion_ids_BN)
        np.testing.assert_array_equal(got_ids, want_ids)
        mask = np.asarray(out.completion_mask_BN)
        np.testing.assert_array_equal(mask, expected_mask(want_ids, eos))
        if min_new:
            assert (want_ids[:, :min_new] != eos).all()
        else:
            assert mask[eos_row].sum() == eos_step + 1
        # Greedy log-probs: log_softmax of the raw logits (transformers' output_logits).
        steps = want_logits.shape[1]
        logits = want_logits - want_logits.max(-1, keepdims=True)
        want_lp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
        want_lp = np.take_along_axis(want_lp, want_ids[:, :steps, None], axis=-1)[..., 0]
        got_lp = np.asarray(out.logprobs_BN)
        np.testing.assert_allclose(
            got_lp[:, :steps] * mask[:, :steps], want_lp * mask[:, :steps], atol=2e-4
        )
        assert (got_lp[mask == 0] == 0).all()


@pytest.mark.parametrize(("family", "scan"), CASES)
def test_greedy_matches_transformers_generate(hf_causal, family, scan):
    ref = hf_causal(family)
    check_against_transformers(
        ref, Sampler(models.from_pretrained(ref.path, scan_layers=scan)), (0,)
    )


@pytest.mark.slow
def test_scanned_mix_of_sliding_and_full_layers_matches_transformers(tmp_path):
    config = FAMILIES["qwen2"][0]()
    config.layer_types = ["full_attention", "sliding_attention"]
    config.use_sliding_window, config.sliding_window = True, 3
    config.tie_word_embeddings = False  # tied tiny models repeat one token, hiding the window
    ref = _build(lambda: config, {}, tmp_path, transformers.AutoModelForCausalLM, seed=5)
    model = models.from_pretrained(ref.path, scan_layers=True)
    assert model.config.sliding_layers == (False, True)  # the window is a scanned flag
    check_against_transformers(ref, Sampler(model), (0,))


@pytest.mark.slow
def test_min_new_tokens_matches_transformers(hf_causal):
    ref = hf_causal("llama")
    check_against_transformers(ref, Sampler(models.from_pretrained(ref.path)), (6,))
