"""PPO's host-side statistics, as TRL v0.7.2 reports them: the per-mini-batch train stats of the
epochs that ran, `record_step_stats`' dict (TRL's stat names), the `env/reward_*` entries of
`log_stats` and of `train()`'s metrics, TRL's `convert_to_scalar`, the learning rate of an injectable optimizer, and NumPy's
global generator state (checkpointed so the minibatch permutations resume exactly).

NumPy on fetched arrays only; no traced code, no logging backends (the trainer sends the logs).
"""

from __future__ import annotations

import warnings
from typing import Any

import jax
import numpy as np

from jaxrl.algos import ppo

WANDB_PADDING = -1  # TRL's fill value for NaN advantages in the logged arrays


def learning_rate_hyperparams(opt_state: Any) -> list[Any]:
    """The `inject_hyperparams` states in `opt_state` that expose a `learning_rate`."""
    found = []

    def visit(node):
        if hasattr(node, "hyperparams") and "learning_rate" in node.hyperparams:
            found.append(node)
        elif isinstance(node, tuple | list):
            for child in node:
                visit(child)

    visit(opt_state)
    return found


def numpy_rng_state() -> np.ndarray:
    """NumPy's global MT19937 state as one uint32 vector: 624 keys, then the position (no
    Gaussian is ever cached here: only `permutation` draws from it)."""
    _, keys, pos, _, _ = np.random.get_state()
    return np.append(np.asarray(keys, np.uint32), np.uint32(pos))


def set_numpy_rng_state(state: Any) -> None:
    """Restore NumPy's global generator from `numpy_rng_state()`'s vector."""
    keys = np.asarray(state).astype(np.uint32)
    np.random.set_state(("MT19937", keys[:-1], int(keys[-1])))


def to_scalar(v: Any) -> Any:
    """TRL's `convert_to_scalar`: 0-d or one-element arrays become Python floats."""
    if isinstance(v, np.ndarray | jax.Array) and (v.ndim == 0 or (v.ndim == 1 and v.shape[0] == 1)):
        return float(np.asarray(v).reshape(()))
    return v


def train_stats(out: dict, ratio_threshold: float) -> dict[str, np.ndarray]:
    """Per-mini-batch stats of the epochs that ran, in TRL's order (epoch, backward batch,
    mini-batch): scalars `[n_minibatches]`, arrays flattened into one row."""
    ran = np.asarray(out["epoch_ran"], bool)
    stats = {k: np.asarray(out["sum"][k])[ran].reshape(-1) for k in ppo.UPDATE_SCALARS}
    skipped = int(stats.pop("ratio_skipped").sum())
    if skipped:
        warnings.warn(
            f"{skipped} mini-batch(es) had an average ratio above ratio_threshold="
            f"{ratio_threshold:.2f}; their loss was zeroed (batch skipped).",
            UserWarning,
            stacklevel=4,  # the caller of `PPOTrainer.step()`
        )
    adv = np.asarray(out["arrays"]["policy/advantages"])[ran].reshape(1, -1)
    stats["policy/advantages"] = np.nan_to_num(adv, nan=WANDB_PADDING)
    stats["policy/ratio"] = np.asarray(out["arrays"]["policy/ratio"])[ran].reshape(1, -1)
    return stats


def record_step_stats(kl_coef: float, **data: Any) -> dict[str, Any]:
    """TRL's step statistics from the rollout and the per-mini-batch train stats."""
    mask = np.asarray(data.pop("masks"), np.float32)
    logprobs, ref_logprobs = np.asarray(data["logprobs"]), np.asarray(data["ref_logprobs"])
    kl_list = ((logprobs - ref_logprobs) * mask).sum(axis=-1)
    mean_kl = kl_list.mean()
    mean_entropy = (-logprobs * mask).sum(axis=-1).mean()
    non_score = np.asarray(data["non_score_reward"])
    mean_non_score_reward = (non_score * mask).sum() / mask.sum()
    scores = np.asarray(data["scores"], np.float32)
    if mean_kl < -1.0:
        warnings.warn(
            f"KL divergence is starting to become negative: {mean_kl:.2f} - this might be a "
            "precursor for failed training. sometimes this happens because the generation "
            "kwargs are not correctly set. Please make sure that the generation kwargs are "
            "set correctly, or review your training hyperparameters.",
            UserWarning,
            stacklevel=3,
        )
    stats: dict[str, Any] = {
        "objective/kl": float(mean_kl),
        "objective/kl_dist": kl_list,
        "objective/logprobs": logprobs,
        "objective/ref_logprobs": ref_logprobs,
        "objective/kl_coef": float(kl_coef),
        "objective/entropy": float(mean_entropy),
        "ppo/mean_non_score_reward": float(mean_non_score_reward),
        "ppo/mean_scores": float(scores.mean()),
        "ppo/std_scores": float(scores.std(ddof=1)) if scores.size > 1 else float("nan"),
    }
    query_lens = np.array([len(q) for q in data["queries"]], np.float32)
    response_lens = np.array([len(r) for r in data["responses"]], np.float32)
    for name, lens in (("queries", query_lens), ("responses", response_lens)):
        stats[f"tokens/{name}_len_mean"] = float(lens.mean())
        stats[f"tokens/{name}_len_std"] = float(lens.std(ddof=1)) if lens.size > 1 else float("nan")
        stats[f"tokens/{name}_dist"] = lens
    for k, v in data["train_stats"].items():
        mean = np.mean(np.asarray(v), axis=0)
        stats[f"ppo/{k}"] = float(mean) if np.ndim(mean) == 0 else mean
    stats["ppo/val/var_explained"] = 1 - stats["ppo/val/error"] / stats["ppo/returns/var"]
    return stats


def reward_logs(rewards: np.ndarray) -> dict[str, Any]:
    """`log_stats`' `env/reward_mean`, `env/reward_std` (unbiased) and `env/reward_dist`."""
    return {
        "env/reward_mean": float(rewards.mean()),
        "env/reward_std": float(rewards.std(ddof=1)) if rewards.size > 1 else float("nan"),
        "env/reward_dist": rewards,
    }


def train_metrics(stats: dict[str, Any], scores: list[float]) -> dict[str, float]:
    """`train()`'s logged metrics of one step: `step()`'s scalar stats plus `env/reward_mean`
    and `env/reward_std` of the scores (0.0 for a single score)."""
    metrics = {
        k: float(np.asarray(v).reshape(()))
        for k, v in stats.items()
        if np.ndim(v) == 0 or np.size(v) == 1
    }
    scores_B = np.asarray(scores, np.float32)
    metrics["env/reward_mean"] = float(scores_B.mean())
    metrics["env/reward_std"] = float(scores_B.std(ddof=1)) if scores_B.size > 1 else 0.0
    return metrics


def as_rewards(rewards: Any) -> np.ndarray:
    """`log_stats`' rewards (tensors, arrays or floats) as one float32 vector."""
    return np.asarray(
        [np.asarray(r.detach().cpu() if hasattr(r, "detach") else r, np.float32) for r in rewards]
    ).reshape(-1)
