"""The continuous engine (decode slots refilled from a queue of rows) returns what the static
engine (the batch decoded in lockstep) returns: the same tokens, masks and log-probs for the same
seed, greedy and sampled, with groups, per-row limits, stop sequences and strings and a
repetition penalty, whatever the slot count; its cache holds `num_slots` rows; rows are fed to
the slots in order, a group's rows sharing one prefill."""

from __future__ import annotations

import jax
import numpy as np
import pytest
import transformers

from jaxrl import models
from jaxrl.generation import GenerationConfig, Sampler, continuous
from tests.generation.conftest import ragged_prompts
from tests.generation.test_stops import tokenizer  # noqa: F401  (module fixture)
from tests.models.conftest import FAMILIES, _build

N_NEW = 12
PROMPTS = ragged_prompts(seed=5, lengths=(7, 3, 11, 1, 5))
GROUP = 3
# A long tail: most rows stop early, a few run to the cap.
LIMITS = [2, 12, 1, 3, 2, 4, 12, 2, 1, 5, 3, 2, 12, 1, 2]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    factory, kwargs = FAMILIES["llama"]
    path = tmp_path_factory.mktemp("llama_engines")
    return models.from_pretrained(
        _build(factory, kwargs, path, transformers.AutoModelForCausalLM, seed=7).path
    )


def run(model, engine, config, num_slots=None, **kwargs):
    out = Sampler(model, engine=engine, num_slots=num_slots)(None, PROMPTS, config, **kwargs)
    return jax.tree.map(np.asarray, out)


def assert_same(got, want):
    np.testing.assert_array_equal(got.prompt_ids_BP, want.prompt_ids_BP)
    np.testing.assert_array_equal(got.prompt_mask_BP, want.prompt_mask_BP)
    np.testing.assert_array_equal(got.completion_ids_BN, want.completion_ids_BN)
    np.testing.assert_array_equal(got.completion_mask_BN, want.completion_mask_BN)
    np.testing.assert_allclose(got.logprobs_BN, want.logprobs_BN, atol=1e-5)


CONFIGS = {
    "greedy": GenerationConfig(max_new_tokens=N_NEW, eos_token_id=5, pad_token_id=0),
    "sampled": GenerationConfig(
        max_new_tokens=N_NEW, do_sample=True, temperature=0.8, top_p=0.95, top_k=40,
        eos_token_id=5, pad_token_id=0,
    ),  # fmt: skip
    "penalty_min_new": GenerationConfig(
        max_new_tokens=N_NEW, do_sample=True, repetition_penalty=1.3, min_new_tokens=2,
        eos_token_id=(5, 6), pad_token_id=0,
    ),  # fmt: skip
    "stop_sequences": GenerationConfig(
        max_new_tokens=N_NEW, do_sample=True, stop_sequences=((9, 10), (11,)), pad_token_id=0
    ),
}


@pytest.mark.parametrize("name", sorted(CONFIGS))
@pytest.mark.parametrize("num_slots", [1, 4])
def test_continuous_equals_static(model, name, num_slots):
    """Slots fewer than the rows (1: one row at a time; 4 of 15: refills mid-decode), groups of
    3 and long-tailed per-row limits: every row's completion is the static engine's."""
    config = CONFIGS[name]
    kwargs = dict(seed=3, group_size=GROUP, max_new_tokens=LIMITS)
    want = run(model, "static", config, **kwargs)
    got = run(model, "continuous", config, num_slots=num_slots, **kwargs)
    assert_same(got, want)
    lengths = want.completion_mask_BN.sum(axis=1)
    assert (lengths <= np.asarray(LIMITS)).all() and lengths.max() > lengths.min()


def test_rows_do_not_depend_on_their_neighbours(model):
    """Row r's tokens come from (seed, r) only: the first prompt's group is the same alone and
    within the batch, and a different seed changes the draws."""
    config = CONFIGS["sampled"]
    whole = run(model, "continuous", config, num_slots=2, seed=11, group_size=GROUP)
    alone = Sampler(model, num_slots=2)(None, PROMPTS[:1], config, seed=11, group_size=GROUP)
    np.testing.assert_array_equal(np.asarray(alone.completion_ids_BN), whole.completion_ids_BN[:3])
    other = run(model, "continuous", config, num_slots=2, seed=12, group_size=GROUP)
    assert not np.array_equal(other.completion_ids_BN, whole.completion_ids_BN)
    # A group's samples differ from each other (their own streams).
    assert len({tuple(r) for r in whole.completion_ids_BN[:3]}) > 1


def test_stop_strings_match_static(tokenizer, tmp_path_factory):  # noqa: F811
    factory, kwargs = FAMILIES["llama"]
    path = tmp_path_factory.mktemp("llama_engines_stops")
    model = models.from_pretrained(
        _build(factory, kwargs, path, transformers.AutoModelForCausalLM, seed=3).path
    )
    config = GenerationConfig(
        max_new_tokens=N_NEW, do_sample=True, stop_strings=("o", "st"), pad_token_id=0
    )
    kwargs = dict(seed=1, group_size=2, tokenizer=tokenizer)
    want = run(model, "static", config, **kwargs)
    got = run(model, "continuous", config, num_slots=3, **kwargs)
    assert_same(got, want)
    assert want.completion_mask_BN.sum(axis=1).min() < N_NEW  # some rows stopped on a string


def test_cache_holds_the_slots_not_the_rows(model, monkeypatch):
    """15 rows over 4 slots: every decode loop carries a 4-row cache; rows enter the slots in
    order (refills of whole groups: 3 rows, one prefill of one prompt each)."""
    seen = []
    decode = continuous.decode_program

    def spy(spec, params, state, need, config, tables):
        seen.append((state.cache[0].k.shape[0], np.asarray(state.rows_B).tolist()))
        return decode(spec, params, state, need, config, tables)

    monkeypatch.setattr(continuous, "decode_program", spy)
    run(model, "continuous", CONFIGS["greedy"], num_slots=4, group_size=GROUP, seed=0)
    assert {rows for rows, _ in seen} == {4}
    first_rows = [r for _, slots in seen for r in slots if r >= 0]
    assert sorted(set(first_rows)) == list(range(15))
    assert seen[0][1][:3] == [0, 1, 2]  # the first refill: prompt 0's group
    assert continuous.schedule(15, GROUP, 4) == continuous.Schedule(4, 3, 1)


def test_schedule_and_default_slots():
    """Whole groups per refill when they fit (one prefill per prompt); all rows at once when the
    slots hold them; the CPU default: one slot per row up to 64 rows, then a quarter of them,
    rounded up to the data-parallel size."""
    assert continuous.schedule(8, 2, 8) == continuous.Schedule(8, 8, 4)
    assert continuous.schedule(256, 8, 64) == continuous.Schedule(64, 8, 1)
    assert continuous.schedule(256, 4, 128) == continuous.Schedule(128, 16, 4)
    assert continuous.schedule(12, 8, 4) == continuous.Schedule(4, 4, 1)  # groups split
    assert continuous.schedule(12, 5, 4) == continuous.Schedule(4, 4, 2)  # rows 4-7: 2 prompts
    assert continuous.default_slots(16, 1, 1) == 16
    assert continuous.default_slots(256, 1, 1) == 64
    assert continuous.default_slots(1024, 1, 1) == 256
    assert continuous.default_slots(6, 4, 1) == 8


def test_bad_engine_settings(model):
    with pytest.raises(ValueError, match="engine must be one of"):
        Sampler(model, engine="vllm")
    with pytest.raises(ValueError, match="num_slots must be >= 1"):
        Sampler(model, num_slots=0)
