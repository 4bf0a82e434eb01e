"""RewardTrainer: Bradley-Terry reward modelling with TRL `RewardTrainer` semantics.

The model is a sequence-classification model (score head on any supported family, read at the
last non-pad token). Chosen and rejected rows go through one forward; the loss is
`-log_sigmoid(r_c - r_r - margin)` (+ `center_rewards_coefficient * (r_c + r_r)^2`).
Metrics: `accuracy`, `margin`, `min_reward`, `mean_reward`, `max_reward`, `num_tokens`. The
traced math is `jaxrl.algos.reward`; this file is the host shell around it.
"""

from __future__ import annotations

from typing import Any

import datasets
import numpy as np

from jaxrl.algos import reward as reward_algo
from jaxrl.data.collate import collate_reward
from jaxrl.data.reward import prepare_reward_dataset
from jaxrl.trainers.base import Trainer
from jaxrl.trainers.reward_config import RewardConfig


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
        return reward_algo.make_loss(
            self.args, self.apply_model, pad_token_id=self.processing_class.pad_token_id
        )

    _predictions_per_position = False  # [B, 2] pair scores; only the input ids are rows

    def _prediction_fn(self):
        pad_id = self.processing_class.pad_token_id
        return lambda model, mb: reward_algo.pair_predictions(model, mb, pad_id)
