"""GRPO/RLOO `evaluate()` logs TRL 1.16's `eval_loss` and HF's speed metrics.

TRL's eval runs `prediction_step` per eval batch: sample `num_generations_eval` completions per
prompt, score them, take the batch's advantages, then `compute_loss` on them with the evaluated
policy's log-probs as the old ones (ratio 1) and, when `beta > 0`, the reference KL. HF averages
the batch losses, each repeated `eval_batch_size` times, the last cut to accelerate's remainder
`len(eval_dataset) % eval_batch_size` (prompts, under TRL's repeat sampler). Here each eval
batch's completions are recorded as the trainer scores them and the loss is recomputed by hand
(numpy) from the rewards and from log-probs of freshly loaded models.
"""

from __future__ import annotations

import math

import jax
import numpy as np
import pytest
from flax import nnx
from onpolicy_utils import prompt_rows, split_model_logps
from trainer_utils import base_args

from jaxrl import models
from jaxrl.trainers.evaluation import hf_eval_loss
from jaxrl.trainers.grpo import GRPOTrainer
from jaxrl.trainers.grpo_config import GRPOConfig
from jaxrl.trainers.rloo import RLOOTrainer
from jaxrl.trainers.rloo_config import RLOOConfig

BETA = 0.2
G_EVAL = 2  # != num_generations (4): the eval advantages must use num_generations_eval
EVAL_BATCH = 4  # completions, i.e. 2 prompts per eval batch
N_EVAL = 5  # prompts: batches of 2, 2, 1 prompts; HF weights 4, 4, 5 % 4 = 1
HF_WEIGHTS = np.array([4.0, 4.0, 1.0])


def digit_sum_reward(prompts, completions, completion_ids, **kw):
    return [float(sum(ids) % 5) for ids in completion_ids]


def make(trainer_cls, model_dir, tokenizer, out, **kw):
    config_cls = GRPOConfig if trainer_cls is GRPOTrainer else RLOOConfig
    settings = dict(
        per_device_train_batch_size=8,
        num_generations=4,
        num_generations_eval=G_EVAL,
        per_device_eval_batch_size=EVAL_BATCH,
        max_completion_length=8,  # long enough for some completions to end early (EOS)
        max_steps=2,
        learning_rate=1e-2,  # moves the policy away from the reference: a non-zero KL
        beta=BETA,
    )
    args = config_cls(**base_args(out, **{**settings, **kw}))
    return trainer_cls(
        model_dir,
        reward_funcs=digit_sum_reward,
        args=args,
        train_dataset=prompt_rows(16),
        eval_dataset=prompt_rows(N_EVAL, "test"),
        processing_class=tokenizer,
    )


def record_eval_batches(trainer) -> list[dict]:
    """Each eval batch's rows (as the loss sees them) and rewards, recorded as evaluated."""
    batches = []
    rows_of = trainer._rollout_rows

    def spy(s):
        rows = rows_of(s)
        batches.append({**jax.device_get(rows), "rewards": np.asarray(s["rewards_NK"])})
        return rows

    trainer._rollout_rows = spy
    return batches


def run_eval(trainer_cls, hf_model_dir, tokenizer, out, **kw):
    trainer = make(trainer_cls, hf_model_dir, tokenizer, out, **kw)
    trainer.train()
    batches = record_eval_batches(trainer)
    metrics = trainer.evaluate()
    assert len(batches) == len(HF_WEIGHTS)  # the premise: 3 eval batches
    policy_dir = trainer.save_model(str(out / "policy"))
    # Independent f32 forwards of the evaluated policy (as saved) and the reference, loaded
    # from disk.
    policy = nnx.split(models.from_pretrained(policy_dir))
    ref = nnx.split(models.from_pretrained(hf_model_dir))
    for batch in batches:
        rows = {k: batch[k] for k in ("input_ids", "attention_mask", "completion_mask")}
        batch["policy_logps"] = np.asarray(split_model_logps(*policy, rows), np.float64)
        batch["ref_logps"] = np.asarray(split_model_logps(*ref, rows), np.float64)
    return trainer, metrics, batches


@pytest.fixture(scope="module")
def grpo_eval(hf_model_dir, tokenizer, tmp_path_factory):
    out = tmp_path_factory.mktemp("grpo_eval")
    return run_eval(GRPOTrainer, hf_model_dir, tokenizer, out, loss_type="dapo")


@pytest.fixture(scope="module")
def rloo_eval(hf_model_dir, tokenizer, tmp_path_factory):
    out = tmp_path_factory.mktemp("rloo_eval")
    return run_eval(RLOOTrainer, hf_model_dir, tokenizer, out)


def grpo_advantages_by_hand(rewards_N: np.ndarray, group: int) -> np.ndarray:
    g = rewards_N.reshape(-1, group)
    return ((g - g.mean(1, keepdims=True)) / (g.std(1, ddof=1, keepdims=True) + 1e-4)).ravel()


def grpo_dapo_parts(batch: dict) -> tuple[float, float]:
    """`(policy term, KL term)` of TRL's dapo loss on one eval batch, ratio 1: per token
    `-A + beta * k3`, summed over the batch's active tokens and divided by their count
    (`num_items_in_batch`, not rescaled in eval)."""
    mask = batch["completion_mask"].astype(np.float64)
    adv = grpo_advantages_by_hand(batch["rewards"].astype(np.float64).sum(1), G_EVAL)
    d = batch["ref_logps"] - batch["policy_logps"]
    k3 = np.exp(d) - d - 1
    n = max(mask.sum(), 1.0)
    return float((-adv[:, None] * mask).sum() / n), float((k3 * mask).sum() / n)


def weighted(values) -> float:
    return float(np.sum(HF_WEIGHTS * np.asarray(values)) / HF_WEIGHTS.sum())


def test_grpo_eval_loss_is_trls_dapo_loss_with_the_kl_term(grpo_eval):
    _, metrics, batches = grpo_eval
    policy, kl = np.array([grpo_dapo_parts(b) for b in batches]).T
    want = weighted(policy + BETA * kl)
    assert metrics["eval_loss"] == pytest.approx(want, rel=1e-4, abs=2e-6)
    # The premises that make this a test: the KL term (and so beta) moves eval_loss far beyond
    # the tolerance, completions differ in length (dapo's token weighting is not a plain mean of
    # the advantages, which sum to 0 per group), and the last batch's weight matters.
    assert BETA * weighted(kl) > 1e-3
    assert abs(weighted(policy)) > 1e-3
    assert weighted(policy + BETA * kl) != pytest.approx(np.mean(policy + BETA * kl), abs=1e-4)


def check_speed_metrics(trainer, metrics: dict) -> None:
    runtime = metrics["eval_runtime"]
    assert 0 < runtime < 600
    # HF: samples = len(eval_dataset) (prompts), steps = ceil(samples / eval batch size), each
    # rate rounded to 3 decimals (up to 5e-4 off; a relative bound alone fails once a loaded
    # machine makes the rate small) from the runtime before its rounding to 4 decimals (which
    # moves the rate by up to rate x 5e-5 / runtime more).
    def close(rate: float, count: int) -> bool:
        want = count / runtime
        return abs(rate - want) <= 5e-4 + want * 5e-5 / runtime + 1e-9

    assert close(metrics["eval_samples_per_second"], N_EVAL)
    steps = math.ceil(N_EVAL / EVAL_BATCH)
    assert close(metrics["eval_steps_per_second"], steps)
    (logged,) = [h for h in trainer.state.log_history if h.get("eval_runtime") == runtime]
    for key in ("eval_loss", "eval_samples_per_second", "eval_steps_per_second"):
        assert logged[key] == metrics[key]


def test_grpo_speed_metrics_as_hf_counts_them(grpo_eval):
    trainer, metrics, _ = grpo_eval
    check_speed_metrics(trainer, metrics)
    assert "eval_reward" in trainer.state.log_history[-1]


def test_rloo_eval_loss_is_minus_the_mean_advantage(rloo_eval):
    """RLOO's eval loss is `-mean(A)` (ratio 1). Leave-one-out advantages sum to 0 over each
    group, KL-shaped reward or not, so TRL's eval_loss is 0 up to rounding, while the advantages
    (reward minus beta x the sequence KL of the evaluated policy, in groups of
    num_generations_eval) are not."""
    trainer, metrics, batches = rloo_eval
    for batch in batches:
        mask = batch["completion_mask"].astype(np.float64)
        kl = ((batch["policy_logps"] - batch["ref_logps"]) * mask).sum(1)
        shaped = batch["rewards"].astype(np.float64).sum(1) - BETA * kl
        g = shaped.reshape(-1, G_EVAL)
        batch["adv"] = (g - (g.sum(1, keepdims=True) - g) / (G_EVAL - 1)).ravel()
    assert max(np.abs(b["adv"]).max() for b in batches) > 0.1
    want = weighted([-b["adv"].mean() for b in batches])
    assert metrics["eval_loss"] == pytest.approx(want, abs=1e-5)
    check_speed_metrics(trainer, metrics)


def test_rloo_eval_loss_averages_the_batches_as_hf(rloo_eval):
    """With each batch's advantages shifted by a known amount, each batch loss is minus that
    shift: eval_loss is HF's weighted mean of the batch means (weights 4, 4, 1)."""
    trainer, _, _ = rloo_eval
    advantages_of = type(trainer)._advantages.__get__(trainer)
    shifts = iter([1.0, 2.0, 3.0])

    def shifted(rewards_NK, rollout, num_generations=None):
        assert num_generations == G_EVAL
        adv, metrics = advantages_of(rewards_NK, rollout, num_generations)
        return adv + next(shifts), metrics

    trainer._advantages = shifted
    try:
        metrics = trainer.evaluate()
    finally:
        del trainer._advantages
    assert metrics["eval_loss"] == pytest.approx(-weighted([1.0, 2.0, 3.0]), abs=1e-5)


def test_hf_eval_loss_weights():
    losses = [1.0, 2.0, 4.0]
    # 5 prompts, eval batch 4: the last batch counts 5 % 4 = 1 time, the others 4.
    assert hf_eval_loss(losses, 5, 4) == pytest.approx((4 + 8 + 4) / 9)
    # No remainder: every batch counts the same, the last included.
    assert hf_eval_loss(losses, 8, 4) == pytest.approx(7 / 3)
    # logging_nan_inf_filter: non-finite batch losses are left out while some are finite.
    assert hf_eval_loss([1.0, math.nan, 3.0], 12, 4) == pytest.approx(2.0)
    assert math.isnan(hf_eval_loss([math.nan], 4, 4))
    assert math.isnan(hf_eval_loss([], 0, 4))


def test_grpo_eval_metrics_are_means_of_batch_values(grpo_eval):
    """TRL appends each eval batch's scoring and loss metrics and `log()` averages them: the
    batches count alike (2, 2 and 1 prompts here), unlike a mean over every completion."""
    trainer, metrics, batches = grpo_eval
    rewards = [b["rewards"].astype(np.float64).sum(1) for b in batches]
    per_batch = [r.mean() for r in rewards]
    assert metrics["eval_reward"] == pytest.approx(np.mean(per_batch), rel=1e-5)
    assert np.mean(per_batch) != pytest.approx(np.concatenate(rewards).mean(), rel=1e-3)
    stds = [r.std(ddof=1) for r in rewards]
    assert metrics["eval_reward_std"] == pytest.approx(np.mean(stds), rel=1e-5)
    lengths = [b["completion_mask"].sum(1).mean() for b in batches]
    assert metrics["eval_completions/mean_length"] == pytest.approx(np.mean(lengths), rel=1e-6)
    # The loss's own metrics ride along (GRPO's kl: the mean k3 per batch, then averaged).
    kls = []
    for b in batches:
        d, mask = b["ref_logps"] - b["policy_logps"], b["completion_mask"].astype(np.float64)
        kls.append(((np.exp(d) - d - 1) * mask).sum() / mask.sum())
    assert metrics["eval_kl"] == pytest.approx(np.mean(kls), rel=1e-3)
    assert "eval_entropy" in metrics and "eval_clip_ratio/region_mean" in metrics
    train_logs = [h for h in trainer.state.log_history if "loss" in h and "num_tokens" in h]
    assert metrics["eval_num_tokens"] == train_logs[-1]["num_tokens"] > 0  # training's so far
