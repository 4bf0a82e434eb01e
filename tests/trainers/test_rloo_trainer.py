"""RLOOTrainer: one step equals a hand computation with the pure RLOO functions on the same
rollout (leave-one-out advantages with the KL-shaped reward, sequence-level ratio loss), reward
clipping, and TRL's RLOOConfig defaults."""

from __future__ import annotations

import random

import jax
import numpy as np
import pytest
from onpolicy_utils import RecordingReward, prompt_rows, recompute_logps
from trainer_utils import base_args, killed_after_checkpoint, train_logs

from jaxrl.losses.rloo import rloo_advantages, rloo_loss
from jaxrl.trainers.rloo import RLOOTrainer
from jaxrl.trainers.rloo_config import RLOOConfig


def make(model_dir, tokenizer, tmp_path, **kw):
    settings = dict(
        per_device_train_batch_size=8, num_generations=4, max_completion_length=4, max_steps=1
    )
    args = RLOOConfig(**base_args(tmp_path, **{**settings, **kw}))
    reward = RecordingReward()
    trainer = RLOOTrainer(
        model_dir,
        reward_funcs=reward,
        args=args,
        train_dataset=prompt_rows(16),
        processing_class=tokenizer,
    )
    return trainer, reward


@pytest.mark.slow
def test_one_step_equals_pure_rloo(hf_model_dir, tokenizer, tmp_path):
    trainer, reward = make(
        hf_model_dir, tokenizer, tmp_path, beta=0.05, reward_clip_range=[0.0, 1.0]
    )
    trainer.train()
    (log,) = train_logs(trainer)
    rollout = jax.device_get(trainer.rollout)
    logps = recompute_logps(hf_model_dir, rollout)
    mask = rollout["completion_mask"] > 0
    # The KL in the reward uses the sampler's log-probs against the reference (the initial
    # policy at step 1): both equal the f32 forward.
    np.testing.assert_allclose(rollout["old_logps"][mask], logps[mask], atol=2e-5)
    np.testing.assert_allclose(rollout["ref_logps"][mask], logps[mask], atol=2e-5)
    (call,) = reward.calls
    raw = reward(prompts=call["prompts"], completions=call["completions"], completion_ids=None)
    rewards = np.array([[np.nan if r is None else r] for r in raw], np.float32)
    kl = ((rollout["old_logps"] - rollout["ref_logps"]) * rollout["completion_mask"]).sum(1)
    assert np.abs(kl).max() < 1e-4
    adv, _ = rloo_advantages(
        rewards,
        np.ones(1, np.float32),
        num_generations=4,
        beta=0.05,
        kl_N=np.zeros(8, np.float32),
        reward_clip_range=(0.0, 1.0),
    )
    np.testing.assert_allclose(np.sort(rollout["advantages"]), np.sort(np.asarray(adv)), atol=1e-4)
    old_B = (rollout["old_logps"] * rollout["completion_mask"]).sum(1)
    loss_sum, aux = rloo_loss(
        logps, rollout["advantages"], rollout["completion_mask"], old_logps_B=old_B
    )
    np.testing.assert_allclose(log["loss"], loss_sum / aux["count"]["loss"], atol=1e-6)
    assert log["reward"] == pytest.approx(np.nanmean(rewards))  # logged before clipping, as TRL
    for key in ("kl", "entropy", "clip_ratio/region_mean", "rewards/ones/mean", "num_tokens"):
        assert key in log


@pytest.mark.slow
def test_no_reference_without_beta(hf_model_dir, tokenizer, tmp_path):
    trainer, _ = make(hf_model_dir, tokenizer, tmp_path, beta=0.0)
    trainer.train()
    assert trainer.train_state.frozen == {}
    assert "ref_logps" not in trainer.rollout and "kl" not in train_logs(trainer)[0]


def noisy_ones(prompts, completions, **kwargs):
    """The '1' count of each completion plus noise from Python's and NumPy's global generators
    (a sampled judge, a reward model with dropout): host randomness a resume must replay."""
    return [c.count("1") + random.random() + float(np.random.rand()) for c in completions]


@pytest.mark.slow
def test_resume_is_exact_with_host_randomness(hf_model_dir, tokenizer, tmp_path):
    """Killed after its step-2 checkpoint and resumed in a process whose global generators hold
    anything: steps 3-4 log exactly what the uninterrupted run logged, as the checkpoint carries
    those generators' states (HF's rng_state.pth). Resumed with the CLI's spelling "true"."""
    save = dict(max_steps=4, save_strategy="steps", save_steps=2, beta=0.05)

    def trainer(out, **kw):
        args = RLOOConfig(**base_args(out, per_device_train_batch_size=8, num_generations=4,
                                      max_completion_length=4, **save, **kw))  # fmt: skip
        return RLOOTrainer(hf_model_dir, reward_funcs=noisy_ones, args=args,
                           train_dataset=prompt_rows(16), processing_class=tokenizer)  # fmt: skip

    full = trainer(tmp_path / "a")
    full.train()
    killed_after_checkpoint(tmp_path / "a", 2, tmp_path / "b")
    random.seed(7)  # a new process's generators
    np.random.seed(7)
    resumed = trainer(tmp_path / "b", resume_from_checkpoint="true")
    resumed.train()
    want = train_logs(full)[2:]
    got = [x for x in train_logs(resumed) if x["step"] > 2]
    assert [x["step"] for x in got] == [3, 4]
    assert got == want
    assert want[0]["reward"] != want[1]["reward"]


def test_config_defaults():
    c = RLOOConfig()
    assert (c.num_generations, c.beta, c.learning_rate, c.normalize_advantages) == (
        2,
        0.05,
        1e-6,
        False,
    )
