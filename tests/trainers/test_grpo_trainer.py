"""GRPOTrainer: one step equals a hand computation with the pure GRPO losses on the same rollout,
sampler log-probs equal a recomputed f32 forward, generation reuse (steps_per_generation,
num_iterations), one prefill per prompt batch, resume exactness, reference handling (beta=0,
sync_ref_model), conversational prompts and reward models."""

from __future__ import annotations

import functools

import chex
import jax
import numpy as np
import pytest
from onpolicy_utils import RecordingReward, prompt_rows, recompute_logps
from trainer_utils import base_args, killed_after_checkpoint, train_logs

from jaxrl.config import ConfigError
from jaxrl.generation import continuous
from jaxrl.losses.grpo import grpo_advantages, grpo_loss
from jaxrl.trainers.grpo import GRPOTrainer
from jaxrl.trainers.grpo_config import GRPOConfig


def make(model_dir, tokenizer, tmp_path, reward=None, train=None, callbacks=None, **kw):
    settings = dict(
        per_device_train_batch_size=8, num_generations=4, max_completion_length=4, max_steps=1
    )
    args = GRPOConfig(**base_args(tmp_path, **{**settings, **kw}))
    reward = reward if reward is not None else RecordingReward()
    trainer = GRPOTrainer(
        model_dir,
        reward_funcs=reward,
        args=args,
        train_dataset=train if train is not None else prompt_rows(16),
        processing_class=tokenizer,
        callbacks=callbacks,
    )
    return trainer, reward


@pytest.mark.slow
def test_one_step_equals_pure_loss_on_the_rollout_and_syncs_the_reference(
    hf_model_dir, tokenizer, tmp_path
):
    """One 1-step run with beta > 0 and a reference synced after every step (alpha 1): the step
    equals the pure loss on its rollout, and the synced reference is the updated policy. Was two
    tests, each building and compiling a trainer of its own (the sync check was the second half of
    test_reference_only_when_beta_and_sync, beta=0.04, sync every step, alpha 1, lr 1e-2); the
    sync acts after the step, so step 1's rollout, loss and KL (reference = initial policy) are
    those of a run without it, and the learning rate moves nothing the step-1 checks read."""
    trainer, reward = make(
        hf_model_dir, tokenizer, tmp_path, beta=0.04, loss_type="dapo", sync_ref_model=True,
        ref_model_sync_steps=1, ref_model_mixup_alpha=1.0, learning_rate=1e-2,
    )  # fmt: skip
    trainer.train()
    (log,) = train_logs(trainer)
    rollout = jax.device_get(trainer.rollout)
    assert "old_logps" not in rollout  # aligned generation: on-policy, no old log-probs
    # Rewards as the trainer saw them (unshuffled), advantages as TRL computes them.
    (call,) = reward.calls
    assert len(call["prompts"]) == 8 and call["prompts"][0] == call["prompts"][3]
    rewards = np.array([[np.nan if r is None else r] for r in reward(**_call_args(call))])
    # Jitted, as the losses below: called eagerly, each of their operations compiled a program.
    advantages = jax.jit(functools.partial(grpo_advantages, num_generations=4))
    adv, _ = advantages(rewards, np.ones(1, np.float32))
    np.testing.assert_allclose(np.sort(rollout["advantages"]), np.sort(np.asarray(adv)), atol=1e-6)
    np.testing.assert_allclose(log["reward"], np.nanmean(rewards), rtol=1e-6)
    logps = recompute_logps(hf_model_dir, rollout)
    # Step 1: the reference is the initial policy, so the ref log-probs equal the forward.
    np.testing.assert_allclose(rollout["ref_logps"], logps, atol=2e-5)
    loss_sum, aux = jax.jit(functools.partial(grpo_loss, beta=0.04, loss_type="dapo"))(
        logps,
        rollout["advantages"],
        rollout["completion_mask"],
        ref_per_token_logps_BT=rollout["ref_logps"],
    )
    np.testing.assert_allclose(log["loss"], loss_sum / aux["count"]["loss"], atol=1e-6)
    assert log["kl"] == pytest.approx(0.0, abs=1e-6)
    lengths = rollout["completion_mask"].sum(1)
    assert log["completions/mean_length"] == pytest.approx(lengths.mean())
    assert log["num_tokens"] == rollout["attention_mask"].sum()
    for key in ("entropy", "clip_ratio/region_mean", "frac_reward_zero_std", "grad_norm"):
        assert key in log
    # The reference synced after the step (alpha=1: ref <- policy); beta=0 (no reference params)
    # is checked on the default run of test_default_run_one_prefill_no_reference_and_resume.
    ref, params = trainer.train_state.frozen["ref"], trainer.train_state.params
    chex.assert_trees_all_equal(ref, params, strict=True)


def _call_args(call):
    return dict(
        prompts=call["prompts"], completions=call["completions"], completion_ids=call["ids"]
    )


class DistinctOnes(RecordingReward):
    """RecordingReward's calls, with rewards distinct within every group (the '1' count plus
    0.01 x the row), so that every advantage and the step's dapo loss are non-zero."""

    def __call__(self, prompts, completions, completion_ids, **kwargs):
        super().__call__(prompts, completions, completion_ids, **kwargs)
        return [float(c.count("1")) + 0.01 * i for i, c in enumerate(completions)]


@pytest.mark.slow
def test_sampler_logps_are_old_logps_and_dapo_normalises_by_the_generation_batch_tokens(
    hf_model_dir, tokenizer, tmp_path
):
    """steps_per_generation=2 (> gradient_accumulation_steps=1): one generation serves two
    optimizer steps, so the update needs the sampling policy's log-probs; with num_iterations=1
    they are the sampler's own. And TRL divides each step's token loss by the generation batch's
    active tokens x 1 / 2, not by the step's own tokens. Two checks on one run: the second was
    test_dapo_normalises_by_the_generation_batch_tokens in test_onpolicy_trl_parity.py, a 1-step
    run of the same settings and this reward (step 1 is the same here; the second step only
    adds the generation reuse this test checks)."""
    trainer, reward = make(
        hf_model_dir, tokenizer, tmp_path, reward=DistinctOnes(), steps_per_generation=2,
        max_steps=2, loss_type="dapo",
    )  # fmt: skip
    trainer.train()
    assert len(reward.calls) == 1  # 16 completions generated once, consumed by two steps
    rollout = jax.device_get(trainer.rollout)
    mask = rollout["completion_mask"] > 0
    logps = recompute_logps(hf_model_dir, rollout)  # step 1 runs with the initial weights
    np.testing.assert_allclose(rollout["old_logps"][mask], logps[mask], atol=2e-5)

    log = train_logs(trainer)[0]
    assert log["step"] == 1
    cm = rollout["completion_mask"]
    half = slice(0, 8)  # step 1 trains on slice 0 of the shuffled 16-row generation batch
    loss_sum, aux = jax.jit(functools.partial(grpo_loss, loss_type="dapo"))(
        logps[half],
        rollout["advantages"][half],
        cm[half],
        old_per_token_logps_BT=rollout["old_logps"][half],
    )
    assert cm.sum() / 2 != cm[half].sum()  # the premise: the two normalisers differ
    np.testing.assert_allclose(log["loss"], loss_sum / (cm.sum() / 2), rtol=1e-5, atol=1e-7)


@pytest.mark.slow
def test_num_iterations_reuses_generations(hf_model_dir, tokenizer, tmp_path):
    trainer, reward = make(hf_model_dir, tokenizer, tmp_path, num_iterations=2, max_steps=4)
    trainer.train()
    assert len(reward.calls) == 2
    # The same prompts return for the second iteration; a new batch after that.
    logs = train_logs(trainer)
    assert logs[0]["reward"] == logs[1]["reward"] and len(logs) == 4
    assert "old_logps" in trainer.rollout
    # The recomputed log-probs are the training forward's: TRL's sampling-correction metrics
    # compare the sampler's against them (float32: equal to rounding).
    for log in logs:
        assert log["sampling/sampling_logp_difference/max"] < 1e-5
        assert log["sampling/sampling_logp_difference/mean"] < 1e-5
        for key in ("min", "mean", "max"):
            assert abs(log[f"sampling/importance_sampling_ratio/{key}"] - 1.0) < 1e-5


RESUME = dict(max_steps=4, save_strategy="steps", save_steps=2)


@pytest.mark.slow
def test_default_run_one_prefill_no_reference_and_resume(
    hf_model_dir, tokenizer, tmp_path, monkeypatch
):
    """Four checks on one uninterrupted run of the default settings (4 steps, checkpoints at 2
    and 4), one test so that the run is built once (three tests built a trainer of these
    settings each; a module fixture shared by them was built on both xdist workers when
    worksteal split them): (1) one prefill per prompt batch (was
    test_one_prefill_per_prompt_batch, on a 1-step run of the same settings); (2) beta=0: no
    reference params, when the state is built and after training (was the first half of
    test_reference_only_when_beta_and_sync); (3) killed after step 2 and resumed, a run logs
    what the uninterrupted one logged (test_resume_gives_the_same_metrics); (4) no completion
    logs by default."""
    full, _ = make(hf_model_dir, tokenizer, tmp_path / "a", **RESUME)
    full._ensure_state()
    assert full.train_state.frozen == {}  # (2)
    seen = []
    refill = continuous.refill_program

    def spy(spec, params, state, outputs, prompt_ids_nP, *rest):
        group_size, chunk, width = rest[7:10]
        seen.append((prompt_ids_nP.shape[0], group_size, chunk, width))
        return refill(spec, params, state, outputs, prompt_ids_nP, *rest)

    monkeypatch.setattr(continuous, "refill_program", spy)
    full.train()
    # (1) Each step's generation: 2 prompts, one refill of all 8 rows (8 slots: the CPU
    # default) that prefills the 2 prompts once, their caches shared by 4 completions each.
    assert seen == [(2, 4, 8, 2)] * 4
    assert full.rollout["input_ids"].shape[0] == 8
    assert full.train_state.frozen == {}  # (2)
    # (4) log_completions is off by default: no completion logs written (was
    # test_log_completions.py::test_off_by_default, a 3-step run of its own).
    assert full.args.log_completions is False
    assert not (tmp_path / "a" / "completions").exists()

    # (3) From the uninterrupted run's step-2 checkpoint: what a run killed then leaves.
    killed_after_checkpoint(tmp_path / "a", 2, tmp_path / "b")
    resumed, _ = make(hf_model_dir, tokenizer, tmp_path / "b", **RESUME)
    resumed.train(resume_from_checkpoint=True)
    a = train_logs(full)[2:]
    b = [x for x in train_logs(resumed) if x["step"] > 2]
    assert [x["step"] for x in b] == [3, 4]
    for x, y in zip(a, b, strict=True):
        for k in ("loss", "reward", "completions/mean_length", "grad_norm", "num_tokens"):
            assert x[k] == pytest.approx(y[k], rel=1e-5, abs=1e-7), k


@pytest.mark.slow
def test_conversational_prompts(hf_model_dir, tmp_path):
    from jaxrl.data.char_tokenizer import build_char_tokenizer
    from jaxrl.data.task import CHARS

    template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    tok = build_char_tokenizer(CHARS, chat_template=template)
    rows = [{"prompt": [{"role": "user", "content": f"{a}+{a}="}], "x": a} for a in range(10, 18)]
    import datasets

    trainer, reward = make(hf_model_dir, tok, tmp_path, train=datasets.Dataset.from_list(rows))
    trainer.train()
    (call,) = reward.calls
    assert call["prompts"][0][0]["role"] == "user"
    assert call["completions"][0][0]["role"] == "assistant"
    assert call["kwargs"]["x"][0] == call["kwargs"]["x"][3]  # extra columns reach the reward


@pytest.mark.slow
def test_reward_model_scores_texts(hf_model_dir, tokenizer, tmp_path):
    import torch
    from trainer_utils import tiny_config
    from transformers import Qwen2ForSequenceClassification

    torch.manual_seed(1)
    rm_dir = tmp_path / "rm"
    cfg = tiny_config()
    cfg.num_labels = 1
    rm = Qwen2ForSequenceClassification(cfg).eval()
    rm.save_pretrained(rm_dir)
    tokenizer.save_pretrained(rm_dir)
    recorder = RecordingReward()
    trainer, _ = make(hf_model_dir, tokenizer, tmp_path / "out", reward=[str(rm_dir), recorder])
    trainer.train()
    (log,) = train_logs(trainer)
    (call,) = recorder.calls
    texts = [p + c for p, c in zip(call["prompts"], call["completions"], strict=True)]
    with torch.no_grad():
        scores = [rm(torch.tensor([tokenizer(t)["input_ids"]])).logits[0, 0].item() for t in texts]
    assert log["rewards/rm/mean"] == pytest.approx(np.mean(scores), abs=1e-4)


def test_config_validation():
    with pytest.raises(ConfigError, match="can not be both"):
        GRPOConfig(generation_batch_size=16, steps_per_generation=2)
    with pytest.raises(ConfigError, match="at least 2"):
        GRPOConfig(num_generations=1)
    with pytest.raises(ConfigError, match="use_vllm"):
        GRPOConfig(use_vllm=True)
    assert GRPOConfig(max_tool_calling_iterations=2).max_tool_calling_iterations == 2  # tools=
    assert GRPOConfig(scale_rewards=False).scale_rewards == "none"
    c = GRPOConfig()
    assert (c.learning_rate, c.num_generations, c.max_completion_length, c.beta, c.loss_type) == (
        1e-6,
        8,
        512,
        0.0,
        "dapo",
    )
    with pytest.raises(ConfigError, match="divisible by num_generations"):
        GRPOConfig(per_device_train_batch_size=6).resolve_generation_batch(1)


@pytest.mark.slow
def test_learns_a_learnable_reward(hf_model_dir, tokenizer, tmp_path):
    """The update moves the policy toward higher reward: on a random tiny model rewarded for '1'
    characters, the mean reward of the last 4 of 12 steps clearly exceeds the first 4's (TRL 1.16's
    GRPOTrainer on the same model and settings: 0.07-0.09 -> 0.15-0.23; a flipped advantage sign
    drives it to 0)."""

    def ones(prompts, completions, **kw):
        return [c.count("1") / 4.0 for c in completions]

    trainer, _ = make(
        hf_model_dir, tokenizer, tmp_path, reward=ones, train=prompt_rows(64),
        per_device_train_batch_size=32, num_generations=8, max_steps=12, learning_rate=3e-3,
    )  # fmt: skip
    trainer.train()
    rewards = [r["reward"] for r in train_logs(trainer) if "reward" in r]
    assert len(rewards) == 12
    assert np.mean(rewards[-4:]) > np.mean(rewards[:4]) + 0.04, rewards


def test_mixed_precision_reference_is_the_same_in_bf16_weights(
    hf_model_dir, tokenizer, tmp_path, monkeypatch
):
    """bf16 over f32 params with a KL term: the frozen reference stores its matmul weights in
    bf16 (the same forward, in less memory); the step's metrics equal an all-f32 copy's."""
    kw = dict(beta=0.04, bf16=True)
    trainer, _ = make(hf_model_dir, tokenizer, tmp_path / "a", **kw)
    trainer.train()
    ref_dtypes = {x.dtype for x in jax.tree.leaves(trainer.train_state.ref_params)}
    assert ref_dtypes == {np.dtype(np.float32), np.dtype(jax.numpy.bfloat16)}
    monkeypatch.setattr(
        GRPOTrainer, "_frozen_copy", lambda self, p: jax.tree.map(jax.numpy.copy, p)
    )
    f32, _ = make(hf_model_dir, tokenizer, tmp_path / "b", **kw)
    f32.train()
    assert {x.dtype for x in jax.tree.leaves(f32.train_state.ref_params)} == {np.dtype(np.float32)}
    np.testing.assert_array_equal(trainer.rollout["ref_logps"], f32.rollout["ref_logps"])
    assert train_logs(trainer) == train_logs(f32)
