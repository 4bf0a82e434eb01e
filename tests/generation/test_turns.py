"""Multi-turn sampling from kept KV caches (`TurnSession`, the tool loop's engine): a continued
turn samples what re-prefilling the whole conversation samples (the same tokens, greedy and
sampled), and every sampled token's log-prob over three turns equals one full forward of the
final conversation (f32, 1e-5)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import transformers

from jaxrl import models
from jaxrl.generation import GenerationConfig, Sampler
from jaxrl.generation.turns import TurnSession
from tests.generation.conftest import ragged_prompts
from tests.models.conftest import FAMILIES, _build

N = 24
PROMPTS = ragged_prompts(seed=8, lengths=(5, 9, 2))
# Tool results of different lengths appended to some rows between turns.
SUFFIXES = {
    0: [7, 8, 9],
    2: [11],
    3: [12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27, 28],
}


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    factory, kwargs = FAMILIES["llama"]
    path = tmp_path_factory.mktemp("llama_turns")
    return models.from_pretrained(
        _build(factory, kwargs, path, transformers.AutoModelForCausalLM, seed=2).path
    )


# A third of the ids end a turn: turns are a few tokens long, so rows continue several times.
STOPS = tuple(range(30, 70))


def configs():
    return {
        "greedy": GenerationConfig(max_new_tokens=N, eos_token_id=STOPS, pad_token_id=0),
        "sampled": GenerationConfig(
            max_new_tokens=N, do_sample=True, top_k=0, eos_token_id=STOPS, pad_token_id=0
        ),
    }


def run_turns(model, config, seed=0):
    """Three turns: rows of SUFFIXES continue with their suffix after each turn (those with
    budget left). Returns the session and each continued turn's (rows, ids, new tokens)."""
    session = TurnSession(Sampler(model), None, config)
    session.first(PROMPTS, seed, group_size=2)
    turns = []
    for turn in (1, 2):
        rows, ids = [], []
        for r, suffix in SUFFIXES.items():
            seq = session.sequences[r] + suffix
            if len(seq) - session.prompt_lengths[r] < N:
                rows.append(r)
                ids.append(seq)
        key = jax.random.fold_in(jax.random.key(seed), turn)
        turns.append((rows, ids, session.next(rows, ids, key), key))
    return session, turns


@pytest.mark.parametrize("name", ["greedy", "sampled"])
def test_a_continued_turn_samples_what_a_fresh_prefill_samples(model, name):
    config = configs()[name]
    session, turns = run_turns(model, config)
    fresh = Sampler(model, engine="static")
    for rows, ids, new, key in turns:
        assert rows
        budgets = [
            N - (len(seq) - session.prompt_lengths[r]) for r, seq in zip(rows, ids, strict=True)
        ]
        want = fresh(None, ids, config, seed=key, max_new_tokens=budgets)
        lengths = np.asarray(want.completion_mask_BN).sum(axis=1)
        ids_want = np.asarray(want.completion_ids_BN)
        assert new == [ids_want[i, : lengths[i]].tolist() for i in range(len(rows))]


def test_logprobs_over_turns_equal_one_full_forward(model):
    """Each row's sampled tokens (first turn and continued turns; the suffixes are not
    sampled) have the log-probs a full forward of its final sequence gives."""
    session, turns = run_turns(model, configs()["sampled"], seed=4)
    sampled_positions = {r: [] for r in range(len(session.sequences))}
    for r, seq in enumerate(session.sequences):
        n = session.prompt_lengths[r]
        # Which positions of the final sequence were sampled: all but the suffix tokens.
        sampled_positions[r] = list(range(n, len(seq)))
    for rows, ids, _, _ in turns:
        for r, seq in zip(rows, ids, strict=True):
            n_suffix = len(SUFFIXES[r])
            for k in range(len(seq) - n_suffix, len(seq)):
                sampled_positions[r].remove(k)
    for r, seq in enumerate(session.sequences):
        logits = model(jnp.asarray([seq]))[0]
        logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
        want = [float(logp[k - 1, seq[k]]) for k in sampled_positions[r]]
        np.testing.assert_allclose(session.logprobs[r], want, atol=1e-5)
    assert sum(len(rows) for rows, *_ in turns) >= 4  # rows really were continued


def test_a_row_that_does_not_extend_its_sequence_is_refused(model):
    session = TurnSession(Sampler(model), None, configs()["greedy"])
    session.first(PROMPTS, 0, group_size=2)
    with pytest.raises(ValueError, match="do not extend its sequence"):
        session.next([1], [[3, 4]], 0)
