"""TRL's sampling-correction stats in `PPOTrainer.train()` (`sampling/sampling_logp_difference/*`,
`sampling/importance_sampling_ratio/*`, as GRPO/RLOO log them): the sampler's log-prob of each
response token against the rollout forward's `old_logprobs` of `step()`, over the response
tokens. `step()` called by user code has no sampler log-probs, so its stats (TRL v0.7.2's, the
golden tests') are unchanged.

float32: equal to rounding (measured |diff| max 2.4e-7; asserted <= 1e-5). bfloat16 bound: the
sampler's cached one-token decode and the rollout forward over the whole row round activations
differently (the log-probs themselves are float32). Measured on this tiny Qwen2 in bf16 (8 rows
x up to 8 tokens, temperature 1): |diff| max 0.00096, mean 0.00018, sequence ratios 0.9989 to
1.0009; asserted as GRPO's: |diff| max < 0.02, mean < 0.005, ratios within [0.95, 1.05].
At a temperature other than 1 they disagree on purpose: TRL v0.7.2 scores `old_logprobs` at
temperature 1 whatever the sampling temperature, and these stats show that gap."""

from __future__ import annotations

import datasets
import numpy as np
import pytest
from flax import nnx

from jaxrl.algos.rollout import rollout_sampling_metrics
from jaxrl.data import task
from jaxrl.generation import GenerationConfig
from jaxrl.lora.value_head import AutoModelForCausalLMWithValueHead
from jaxrl.trainers import ppo_inputs
from jaxrl.trainers.ppo import PPOTrainer
from jaxrl.trainers.ppo_config import PPOConfig

KEYS = (
    "sampling/sampling_logp_difference/mean",
    "sampling/sampling_logp_difference/max",
    "sampling/importance_sampling_ratio/min",
    "sampling/importance_sampling_ratio/mean",
    "sampling/importance_sampling_ratio/max",
)


def _reward(prompts, completions):
    return [float(c.count("1")) for c in completions]


def _train(model, out, **kw) -> tuple[PPOTrainer, list[dict]]:
    settings = dict(
        batch_size=4, mini_batch_size=2, ppo_epochs=1, learning_rate=1e-3, seed=0,
        output_dir=str(out), disable_tqdm=True, response_length=8, max_steps=1,
        save_strategy="no",
    )  # fmt: skip
    rows = task.sft_examples("train", 4, seed=0)
    dataset = datasets.Dataset.from_list([{"query": r["prompt"]} for r in rows])
    trainer = PPOTrainer(
        PPOConfig(**{**settings, **kw}), model, tokenizer=task.load_tokenizer(), dataset=dataset,
        reward=_reward,
    )  # fmt: skip
    trainer.train()
    return trainer, [h for h in trainer.state.log_history if "ppo/loss/total" in h]


@pytest.mark.slow  # two PPO runs
def test_train_logs_the_stats_and_step_alone_does_not(hf_model_dir, tmp_path):
    trainer, (log,) = _train(hf_model_dir, tmp_path / "t1")
    assert log["tokens/responses_len_mean"] > 2  # the premise: responses to compare
    assert log["sampling/sampling_logp_difference/max"] <= 1e-5
    assert log["sampling/sampling_logp_difference/mean"] <= 1e-5
    for key in ("min", "mean", "max"):
        assert abs(log[f"sampling/importance_sampling_ratio/{key}"] - 1.0) <= 1e-5
    # step() from user code (TRL v0.7.2's API): its stats only, no sampler log-probs to compare.
    queries = [np.array([5, 6, 15]), np.array([7, 15]), np.array([8, 15]), np.array([9, 15])]
    responses = [np.array([4, 5, 1]), np.array([6]), np.array([7, 8]), np.array([9, 1])]
    stats = trainer.step(queries, responses, [np.float32(s) for s in (1, 0, 2, 1)])
    assert "ppo/loss/total" in stats and not set(KEYS) & set(stats)
    # Sampling at temperature 0.5 against TRL's temperature-1 old_logprobs: a real gap.
    _, (hot,) = _train(hf_model_dir, tmp_path / "t05", temperature=0.5)
    assert hot["sampling/sampling_logp_difference/max"] > 0.05


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_sampler_agrees_with_the_rollout_forward(dtype, hf_model_dir, tokenizer, tmp_path):
    """What train() compares, on a trainer's own pieces: its sampler's log-probs vs TRL's
    `batched_forward_pass` (the rollout forward of `step()`), placed by the response mask."""
    model = AutoModelForCausalLMWithValueHead.from_pretrained(
        hf_model_dir, dtype=dtype, param_dtype=dtype
    )
    config = PPOConfig(batch_size=8, mini_batch_size=8, output_dir=str(tmp_path), seed=0)
    trainer = PPOTrainer(config, model, tokenizer=tokenizer)
    queries = [
        np.asarray(tokenizer(r["prompt"])["input_ids"])
        for r in task.sft_examples("train", 8, seed=0)
    ]
    gen = GenerationConfig(
        max_new_tokens=8, do_sample=True, top_k=0, eos_token_id=1, pad_token_id=0
    )
    out = trainer.rollout_sampler(nnx.state(model.pretrained_model), queries, gen, seed=3)
    ids_BN, mask_BN, logps_BN = (
        np.asarray(x) for x in (out.completion_ids_BN, out.completion_mask_BN, out.logprobs_BN)
    )
    lengths = mask_BN.sum(axis=1)
    responses = [ids_BN[i, :n] for i, n in enumerate(lengths)]
    sampled = [logps_BN[i, :n] for i, n in enumerate(lengths)]
    inputs = trainer.prepare_model_inputs(queries, responses)
    logps_BT, _, _, mask_BT = trainer.batched_forward_pass(model, queries, responses, inputs)
    sampled_BT = ppo_inputs.response_values(queries, responses, inputs["attention_mask"], sampled)
    got = {
        k: float(v)
        for k, v in rollout_sampling_metrics(
            config, logps_BT, sampled_BT, {"completion_mask": mask_BT}
        ).items()
    }
    assert mask_BT.sum() > 30 and (lengths < 8).any()  # some rows end early
    if dtype == "float32":
        assert got["sampling/sampling_logp_difference/max"] <= 1e-5
        for key in ("min", "mean", "max"):
            assert abs(got[f"sampling/importance_sampling_ratio/{key}"] - 1.0) <= 1e-5
    else:
        assert 0.0 < got["sampling/sampling_logp_difference/max"] < 0.02
        assert got["sampling/sampling_logp_difference/mean"] < 0.005
        assert 0.95 < got["sampling/importance_sampling_ratio/min"]
        assert got["sampling/importance_sampling_ratio/max"] < 1.05


def test_response_values_sit_on_the_response_mask_left_and_right_padded():
    queries = [np.array([5, 6, 7]), np.array([8])]
    responses = [np.array([9, 10]), np.array([11, 12, 13])]
    values = [np.array([-1.0, -2.0]), np.array([-3.0, -4.0, -5.0])]
    for side in ("right", "left"):
        inputs = ppo_inputs.model_inputs(queries, responses, 0, side, None)
        mask = ppo_inputs.response_mask(queries, responses, inputs["attention_mask"], None)
        got = ppo_inputs.response_values(queries, responses, inputs["attention_mask"], values)
        for j in range(2):  # each row's values, in order, exactly where its mask is
            np.testing.assert_array_equal(got[j][mask[j] == 1], values[j])
            assert not got[j][mask[j] == 0].any()
        # Train log-probs equal to the values there: the stats see no gap; off by 0.5: 0.5.
        batch = {"completion_mask": mask}
        same = rollout_sampling_metrics(PPOConfig(), got + 7.0 * (mask == 0), got, batch)
        assert float(same["sampling/sampling_logp_difference/max"]) == 0.0
        off = rollout_sampling_metrics(PPOConfig(), got - 0.5 * mask, got, batch)
        assert float(off["sampling/sampling_logp_difference/mean"]) == pytest.approx(0.5)
    with pytest.raises(ValueError, match="Response 0 has 2 tokens but 3 values"):
        ppo_inputs.response_values(queries, responses, inputs["attention_mask"], values[::-1])
