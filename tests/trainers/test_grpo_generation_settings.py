"""GRPO/RLOO rollouts sample with TRL's generation settings: `temperature`, `top_p`, `top_k`,
`min_p`, `repetition_penalty`, then `generation_kwargs` over them (TRL: its keys override the
fields); options the sampler does not implement are errors that name them."""

from __future__ import annotations

import pytest
from onpolicy_utils import RecordingReward, prompt_rows
from trainer_utils import base_args

from jaxrl.config import ConfigError
from jaxrl.generation import GenerationConfig
from jaxrl.trainers.grpo import GRPOTrainer
from jaxrl.trainers.grpo_config import GRPOConfig
from jaxrl.trainers.rloo import RLOOTrainer
from jaxrl.trainers.rloo_config import RLOOConfig


def _trainer(hf_model_dir, tokenizer, out, cls=GRPOTrainer, reward=None, **kw):
    config_cls = GRPOConfig if cls is GRPOTrainer else RLOOConfig
    settings = dict(
        per_device_train_batch_size=8,
        num_generations=4,
        max_completion_length=6,
        max_steps=1,
    )
    return cls(
        hf_model_dir,
        reward_funcs=reward or RecordingReward(),
        args=config_cls(**base_args(out, **{**settings, **kw})),
        train_dataset=prompt_rows(8),
        processing_class=tokenizer,
    )


def test_defaults_sample_as_before(hf_model_dir, tokenizer, tmp_path):
    trainer = _trainer(hf_model_dir, tokenizer, tmp_path, temperature=0.7, top_k=5, top_p=0.9)
    assert trainer.rollout_generation_config == GenerationConfig(
        max_new_tokens=6,
        do_sample=True,
        temperature=0.7,
        top_k=5,
        top_p=0.9,
        eos_token_id=tuple(trainer.eos_token_ids),
        pad_token_id=tokenizer.pad_token_id,
    )


@pytest.mark.parametrize("cls", [GRPOTrainer, RLOOTrainer], ids=["grpo", "rloo"])
def test_fields_and_generation_kwargs_reach_the_sampler(cls, hf_model_dir, tokenizer, tmp_path):
    trainer = _trainer(
        hf_model_dir,
        tokenizer,
        tmp_path,
        cls=cls,
        temperature=0.7,
        min_p=0.05,
        repetition_penalty=1.3,
        generation_kwargs={"temperature": 0.5, "top_k": 3, "min_new_tokens": 2},
    )
    config = trainer.rollout_generation_config
    assert (config.min_p, config.repetition_penalty) == (0.05, 1.3)
    assert (config.temperature, config.top_k, config.min_new_tokens) == (0.5, 3, 2)  # kwargs win


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"num_beams": 2}, "does not implement these generation options: {'num_beams': 2}"),
        ({"suppress_tokens": [3]}, "suppress_tokens"),
        ({"watermarking_config": {}}, r"generation_kwargs \['watermarking_config'\] are not"),
    ],
)
def test_unsupported_generation_kwargs_are_errors(
    kwargs, message, hf_model_dir, tokenizer, tmp_path
):
    with pytest.raises(ConfigError, match=message):
        _trainer(hf_model_dir, tokenizer, tmp_path, generation_kwargs=kwargs)


def test_min_p_one_samples_the_greedy_completions(hf_model_dir, tokenizer, tmp_path):
    """`min_p=1.0` keeps only the most likely token: the sampled rollouts are the greedy ones
    (`generation_kwargs={"do_sample": False}`), the same for every completion of a prompt."""
    completions = {}
    for name, kw in {
        "min_p": dict(min_p=1.0),
        "greedy": dict(generation_kwargs={"do_sample": False}),
        "sampled": {},
    }.items():
        reward = RecordingReward()
        _trainer(hf_model_dir, tokenizer, tmp_path / name, reward=reward, **kw).train()
        completions[name] = reward.calls[0]["completions"]
    assert completions["min_p"] == completions["greedy"]
    groups = [completions["greedy"][i : i + 4] for i in range(0, 8, 4)]
    assert all(len(set(g)) == 1 for g in groups)
    assert completions["sampled"] != completions["greedy"]


@pytest.mark.parametrize("cls", [GRPOTrainer, RLOOTrainer], ids=["grpo", "rloo"])
def test_engines_train_alike(cls, hf_model_dir, tokenizer, tmp_path):
    """`generation_engine="static"` and the default continuous engine with fewer slots than
    rows (refills) give the same completions, rewards and loss, step for step."""
    logs, completions = [], []
    for i, engine in enumerate(({"generation_engine": "static"}, {"generation_num_slots": 3})):
        reward = RecordingReward()
        trainer = _trainer(
            hf_model_dir, tokenizer, tmp_path / str(i), cls=cls, reward=reward, max_steps=2,
            logging_steps=1, **engine,
        )  # fmt: skip
        trainer.train()
        assert trainer.rollout_sampler.engine == engine.get("generation_engine", "continuous")
        logs.append([h for h in trainer.state.log_history if "loss" in h])
        completions.append([(c["completions"], c["ids"]) for c in reward.calls])
    assert completions[0] == completions[1] and len(logs[0]) == 2
    for ours, theirs in zip(*logs, strict=True):
        for key in ("loss", "reward", "completions/mean_length"):
            assert ours[key] == pytest.approx(theirs[key], abs=1e-5), key


def test_bad_engine_fields_are_errors(hf_model_dir, tokenizer, tmp_path):
    with pytest.raises(ConfigError, match="generation_engine='vllm'"):
        _trainer(hf_model_dir, tokenizer, tmp_path, generation_engine="vllm")
    with pytest.raises(ConfigError, match="generation_num_slots=0"):
        _trainer(hf_model_dir, tokenizer, tmp_path, generation_num_slots=0)
