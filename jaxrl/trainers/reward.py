"""RewardTrainer: Bradley-Terry reward modelling with TRL `RewardTrainer` semantics.

The model is a sequence-classification model (score head on any supported family, read at the
last non-pad token). Chosen and rejected rows go through one forward; the loss is
`-log_sigmoid(r_c - r_r - margin)` (+ `center_rewards_coefficient * (r_c + r_r)^2`).
Metrics: `accuracy`, `margin`, `min_reward`, `mean_reward`, `max_reward`, `num_tokens`.
"""

from __future__ import annotations

from typing import Any

import datasets
import jax
import jax.numpy as jnp
import numpy as np

from jaxrl.data.collate import collate_reward, model_masks
from jaxrl.data.reward import prepare_reward_dataset
from jaxrl.losses.reward import reward_loss
from jaxrl.models.heads import score_mask
from jaxrl.trainers.base import Trainer
from jaxrl.trainers.reward_config import RewardConfig


def pair_scores(model, mb: dict, pad_token_id: int | None = None) -> tuple[dict, jax.Array]:
    """The pairs' rows `[2B, T]` (chosen rows, then rejected rows) and their f32 scores `[2B]`,
    read at each row's last real token that is not `pad_token_id` (`score_mask`, as TRL's model
    reads it with `config.pad_token_id` set to the tokenizer's pad; None: the mask alone)."""
    rows = {
        k: jnp.concatenate([v[:, 0], v[:, 1]], axis=0)
        for k, v in mb.items()
        if v.ndim >= 3 or k in ("input_ids", "attention_mask")
    }
    # Right-padded single-document rows run unmasked (`model_masks`); the score is still read
    # at each row's last real token.
    attention_mask, segment_ids = model_masks(rows)
    h_2BTD = model.hidden_states(rows["input_ids"], attention_mask, rows["positions"], segment_ids)
    mask_2BT = score_mask(rows["input_ids"], rows["attention_mask"], pad_token_id)
    scores_2B = model.last_token_scores(h_2BTD, mask_2BT)[:, 0]
    return rows, scores_2B.astype(jnp.float32)


class RewardTrainer(Trainer):
    """Reward-model training (TRL `RewardTrainer` API; `args` is a `RewardConfig`)."""

    config_class = RewardConfig
    _name = "Reward"
    _tag_names = ("trl", "reward-trainer")
    model_task = "sequence_classification"

    def _default_peft_task(self) -> str:
        # PEFT's SEQ_CLS task puts the score head in modules_to_save, so it is trained too.
        return "SEQ_CLS"

    def _prepare_dataset(self, dataset: Any, split: str) -> datasets.Dataset:
        dataset = self._load_data(dataset, split)
        return prepare_reward_dataset(
            dataset,
            self.processing_class,
            max_length=self.args.max_length,
            num_proc=self.args.dataset_num_proc,
        )

    def _example_lengths(self, dataset: datasets.Dataset) -> list[int]:
        c, r = dataset["chosen_input_ids"], dataset["rejected_input_ids"]
        return [max(len(a), len(b)) for a, b in zip(c, r, strict=True)]

    def _collate(self, examples: list[dict], seq_len: int | None = None) -> dict[str, np.ndarray]:
        pad_id = self.processing_class.pad_token_id
        rows = collate_reward(examples, seq_len or self.seq_len, pad_id)
        b = len(examples)
        batch = {k: np.stack([v[:b], v[b:]], axis=1) for k, v in rows.items() if k != "margin"}
        batch["margin"] = rows["margin"]
        return batch

    def _loss_fn(self):
        coef = self.args.center_rewards_coefficient
        pad_id = self.processing_class.pad_token_id

        def loss_fn(params, state, mb, rng, extras):
            rows, scores_2B = pair_scores(self.apply_model(params, state), mb, pad_id)
            b = scores_2B.shape[0] // 2
            rc_B, rr_B = scores_2B[:b], scores_2B[b:]
            losses_B = reward_loss(
                rc_B, rr_B, margin_B=mb["margin"], center_rewards_coefficient=coef
            )
            w_B = mb["example_mask"] if "example_mask" in mb else jnp.ones_like(losses_B)
            n = jnp.sum(w_B)
            loss_sum = jnp.sum(losses_B * w_B)
            both_w = jnp.concatenate([w_B, w_B])
            big = jnp.finfo(jnp.float32).max
            aux = {
                "sum": {
                    "loss": loss_sum,
                    "accuracy": jnp.sum((rc_B > rr_B) * w_B),
                    "margin": jnp.sum((rc_B - rr_B) * w_B),
                    "mean_reward": jnp.sum(scores_2B * both_w),
                },
                "count": {"loss": n, "accuracy": n, "margin": n, "mean_reward": 2 * n},
                "min": {"min_reward": jnp.min(jnp.where(both_w > 0, scores_2B, big))},
                "max": {"max_reward": jnp.max(jnp.where(both_w > 0, scores_2B, -big))},
                "total": {
                    "num_tokens": jnp.sum(rows["attention_mask"] * both_w[:, None]).astype(
                        jnp.float32
                    )
                },
            }
            return loss_sum, (aux, extras)

        return loss_fn

    _predictions_per_position = False  # [B, 2] pair scores; only the input ids are rows

    def _prediction_fn(self):
        pad_id = self.processing_class.pad_token_id

        def predict(model, mb):
            _, scores_2B = pair_scores(model, mb, pad_id)
            b = scores_2B.shape[0] // 2
            # [B, 2] (chosen, rejected) scores; label 0 names the preferred column, so
            # `argmax(predictions, 1) == label_ids` is the pair accuracy (TRL's old
            # `compute_accuracy` layout).
            scores_B2 = jnp.stack([scores_2B[:b], scores_2B[b:]], axis=1)
            return scores_B2, jnp.zeros((b,), jnp.int32)

        return predict
