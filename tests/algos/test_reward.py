"""algos.reward: the Bradley-Terry loss of a tiny scorer against TRL's formula
`-logsigmoid(r_c - r_r - margin) + coef * (r_c + r_r)^2` on scores of each sequence run alone,
its metrics over the real pairs only, and the eval predictions, without a trainer."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl import RewardConfig
from jaxrl.algos import reward
from jaxrl.data.collate import collate_reward

from .tiny import PAD, apply_model, np_scores, scorer

T = 8
EXAMPLES = [
    {"chosen_input_ids": [3, 4, 5, 6], "rejected_input_ids": [3, 4, 7], "margin": 0.5},
    {"chosen_input_ids": [8, 9], "rejected_input_ids": [8, 10, 11, 12, 13], "margin": -0.25},
    {"chosen_input_ids": [14, 15, 16], "rejected_input_ids": [14, 17], "margin": 1.0},
]
EXAMPLE_MASK = np.array([1.0, 1.0, 0.0], np.float32)  # the third fills a partial batch


def _batch() -> dict:
    """The trainer's layout: `[B, 2, T]` (chosen, rejected) rows, `margin` `[B]`."""
    rows = collate_reward(EXAMPLES, T, PAD)
    b = len(EXAMPLES)
    batch = {k: np.stack([v[:b], v[b:]], axis=1) for k, v in rows.items() if k != "margin"}
    batch["margin"] = rows["margin"]
    batch["example_mask"] = EXAMPLE_MASK
    return {k: jnp.asarray(v) for k, v in batch.items()}


def _scores(graphdef, params) -> tuple[np.ndarray, np.ndarray]:
    chosen = np_scores(graphdef, params, [ex["chosen_input_ids"] for ex in EXAMPLES])
    rejected = np_scores(graphdef, params, [ex["rejected_input_ids"] for ex in EXAMPLES])
    return chosen, rejected


def _log_sigmoid(x):
    return -np.logaddexp(0.0, -x)


@pytest.mark.parametrize("coef", [None, 0.01])
def test_loss_is_bradley_terry_with_margin_and_centering(tmp_path, coef):
    graphdef, params = scorer()
    config = RewardConfig(output_dir=str(tmp_path), center_rewards_coefficient=coef)
    loss_fn = reward.make_loss(config, apply_model(graphdef), pad_token_id=PAD)
    loss_sum, (aux, _) = jax.jit(loss_fn)(params, None, _batch(), None, {})

    rc, rr = _scores(graphdef, params)
    margin = np.array([ex["margin"] for ex in EXAMPLES])
    losses = -_log_sigmoid(rc - rr - margin) + (coef or 0.0) * (rc + rr) ** 2
    real = EXAMPLE_MASK > 0
    np.testing.assert_allclose(loss_sum, losses[real].sum(), rtol=1e-5)
    n = real.sum()
    assert {k: float(v) for k, v in aux["count"].items()} == {
        "loss": n, "accuracy": n, "margin": n, "mean_reward": 2 * n,
    }  # fmt: skip
    np.testing.assert_allclose(aux["sum"]["accuracy"], np.sum(rc[real] > rr[real]))
    np.testing.assert_allclose(aux["sum"]["margin"], np.sum(rc[real] - rr[real]), rtol=1e-5)
    both = np.concatenate([rc[real], rr[real]])
    np.testing.assert_allclose(aux["sum"]["mean_reward"], both.sum(), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(aux["min"]["min_reward"], both.min(), rtol=1e-5)
    np.testing.assert_allclose(aux["max"]["max_reward"], both.max(), rtol=1e-5)
    assert float(aux["total"]["num_tokens"]) == (4 + 3) + (2 + 5)  # the real pairs' tokens


def test_pair_predictions_are_chosen_rejected_scores_with_label_zero():
    graphdef, params = scorer()
    mb = _batch()
    scores_B2, labels_B = jax.jit(
        lambda params, mb: reward.pair_predictions(apply_model(graphdef)(params, None), mb, PAD)
    )(params, mb)
    rc, rr = _scores(graphdef, params)
    np.testing.assert_allclose(scores_B2, np.stack([rc, rr], axis=1), rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(labels_B, [0, 0, 0])
