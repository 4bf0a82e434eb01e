"""`generation_kwargs={"stop_strings": [...]}` in GRPO/RLOO (and PPO's `generate`) (TRL hands `generation_kwargs` to
transformers' `GenerationConfig`): a completion ends at the token where a stop string completes
(transformers' `StopStringCriteria`; the trainer passes its tokenizer to the sampler), one that
never meets the string runs to its limit, and stop options transformers would silently ignore
(vLLM's `stop`, `stop_token_ids`; `stop_sequences`) are refused with the fix."""

from __future__ import annotations

import collections

import numpy as np
import pytest
from onpolicy_utils import RecordingReward, prompt_rows
from trainer_utils import base_args

from jaxrl.config import ConfigError
from jaxrl.trainers.grpo import GRPOTrainer
from jaxrl.trainers.grpo_config import GRPOConfig
from jaxrl.trainers.ppo import PPOTrainer
from jaxrl.trainers.ppo_config import PPOConfig
from jaxrl.trainers.rloo import RLOOTrainer
from jaxrl.trainers.rloo_config import RLOOConfig

LIMIT = 8  # max_completion_length


def _run(hf_model_dir, tokenizer, out, cls=GRPOTrainer, train=True, **kw):
    config_cls = GRPOConfig if cls is GRPOTrainer else RLOOConfig
    reward = RecordingReward()
    settings = dict(
        per_device_train_batch_size=8, num_generations=4, max_completion_length=LIMIT,
        max_steps=1,
    )  # fmt: skip
    trainer = cls(
        hf_model_dir,
        reward_funcs=reward,
        args=config_cls(**base_args(out, **{**settings, **kw})),
        train_dataset=prompt_rows(8),
        processing_class=tokenizer,
    )
    if train:
        trainer.train()
    return trainer, reward


def _first_hit(tokens: list[str], stop: str) -> int | None:
    """Index of the completion token at which the two-character `stop` completes (each digit
    is one token of the test tokenizer; the prompts end with '=', so no match reaches back)."""
    for t in range(1, len(tokens)):
        if tokens[t - 1] + tokens[t] == stop:
            return t
    return None


def test_stop_strings_end_grpo_completions_where_the_string_completes(
    hf_model_dir, tokenizer, tmp_path
):
    _, free = _run(hf_model_dir, tokenizer, tmp_path / "free")
    free_ids = free.calls[0]["ids"]
    assert all(p.endswith("=") for p in free.calls[0]["prompts"])
    # The stop string: the digit pair that completes in the most rows without stopping all.
    pairs = collections.Counter()
    for ids in free_ids:
        toks = tokenizer.convert_ids_to_tokens(ids)
        pairs.update({a + b for a, b in zip(toks[:-1], toks[1:], strict=True) if (a + b).isdigit()})
    stop = next(p for p, n in pairs.most_common() if n < sum(len(ids) == LIMIT for ids in free_ids))

    trainer, cut = _run(
        hf_model_dir, tokenizer, tmp_path / "cut", generation_kwargs={"stop_strings": [stop]}
    )
    assert trainer.rollout_generation_config.stop_strings == (stop,)
    cut_ids = cut.calls[0]["ids"]
    hits, full = 0, 0
    for before, after in zip(free_ids, cut_ids, strict=True):
        t = _first_hit(tokenizer.convert_ids_to_tokens(before), stop)
        if t is None:  # same sampling keys: the row is unchanged (its limit or its EOS)
            assert after == before
            full += len(before) == LIMIT
        else:  # cut after the token that completes the string, that token kept
            assert after == before[: t + 1]
            assert stop in tokenizer.decode(after) and stop not in tokenizer.decode(after[:-1])
            hits += t + 1 < LIMIT
    assert hits >= 1 and full >= 1  # the premise: some rows stop early, some run to the limit
    # The loss mask covers exactly those tokens (the rows the reward saw, in another order).
    mask = np.asarray(trainer.rollout["completion_mask"])
    assert sorted(mask.sum(axis=1).tolist()) == sorted(len(ids) for ids in cut_ids)
    # A row the string ended early is a proper end (TRL: transformers pads after it), not a
    # clipped one; a row at its limit without EOS is clipped.
    stops = {tokenizer.eos_token_id, tokenizer.pad_token_id}
    clipped = [len(ids) == LIMIT and ids[-1] not in stops for ids in cut_ids]
    log = next(h for h in trainer.state.log_history if "completions/clipped_ratio" in h)
    assert log["completions/clipped_ratio"] == pytest.approx(np.mean(clipped))
    # (the early rows end with a digit, not EOS: by the last token alone they would be clipped)
    assert np.mean(clipped) < np.mean([ids[-1] not in stops for ids in cut_ids])


def test_rloo_takes_stop_strings(hf_model_dir, tokenizer, tmp_path):
    trainer, _ = _run(
        hf_model_dir, tokenizer, tmp_path, cls=RLOOTrainer, train=False,
        generation_kwargs={"stop_strings": "12", "temperature": 0.5},
    )  # fmt: skip
    config = trainer.rollout_generation_config
    assert (config.stop_strings, config.temperature) == (("12",), 0.5)


@pytest.mark.parametrize("key", ["stop", "stop_token_ids", "stop_sequences"])
def test_stop_options_transformers_ignores_are_refused(key, hf_model_dir, tokenizer, tmp_path):
    message = rf"generation_kwargs {key} \(.*never reads.*pass stop_strings=\[\.\.\.\]"
    with pytest.raises(ConfigError, match=message):
        _run(hf_model_dir, tokenizer, tmp_path, train=False, generation_kwargs={key: [[5]]})


def test_ppo_generate_takes_stop_strings(hf_model_dir, tokenizer, tmp_path):
    """TRL v0.7.2's `generate(**generation_kwargs)` hands them to transformers' `generate`, which
    takes `stop_strings` with `tokenizer=`."""
    config = PPOConfig(batch_size=4, mini_batch_size=4, output_dir=str(tmp_path), seed=0)
    trainer = PPOTrainer(config, hf_model_dir, tokenizer=tokenizer)
    queries = [np.asarray(tokenizer(p)["input_ids"]) for p in ("12+34=", "5+6=", "77+8=")]
    greedy = dict(do_sample=False, max_new_tokens=LIMIT, return_prompt=False)
    free = trainer.generate(queries, **greedy)
    # This model's greedy completions of these prompts repeat '=' to the limit (the premise);
    # the prompt's last '=' counts towards a string (transformers matches prompt + completion).
    assert all(tokenizer.decode(ids) == "=" * LIMIT for ids in free)
    cut = trainer.generate(queries, stop_strings=["==="], tokenizer=tokenizer, **greedy)
    assert all(len(ids) == 2 and (ids == free[0][:2]).all() for ids in cut)
    ref = trainer.generate(queries, stop_strings="=+", generate_ref_response=True, **greedy)
    for ids in (*ref[0], *ref[1]):  # never met (policy and reference): the limit
        np.testing.assert_array_equal(ids, free[0])

    class OtherTokenizer:
        def get_vocab(self):
            return {"a": 0}

    with pytest.raises(ValueError, match="another vocabulary"):
        trainer.generate(queries, stop_strings=["==="], tokenizer=OtherTokenizer(), **greedy)
