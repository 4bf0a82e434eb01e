"""GRPOTrainer: group relative policy optimisation with TRL 1.16 `GRPOTrainer` semantics.

The online shell (prompts -> sampler -> rewards -> update) is `OnPolicyTrainer`; this file
supplies the group-relative advantages (`jaxrl.losses.grpo.grpo_advantages`, TRL's reward
metrics) and wires in GRPO's traced update, `jaxrl.algos.grpo` (the loss function with every TRL
loss type, importance-sampling level, the KL term, top-entropy masking, TRL's entropy bonus and
its adaptive controller; the loss-unit counts of the MoE load-balancing loss). Its module doc
says how the entropy bonus and the load-balancing loss are counted.
"""

from __future__ import annotations

import jax
import numpy as np

from jaxrl.algos import grpo
from jaxrl.losses.grpo import (
    grpo_advantages,
)
from jaxrl.rewards import group_reward_metrics
from jaxrl.trainers.grpo_config import GRPOConfig
from jaxrl.trainers.onpolicy import OnPolicyTrainer


class GRPOTrainer(OnPolicyTrainer):
    """TRL `GRPOTrainer` API: `GRPOTrainer(model, reward_funcs, args=GRPOConfig(...),
    train_dataset=..., eval_dataset=..., processing_class=..., reward_processing_classes=...)`.
    """

    config_class = GRPOConfig

    def _advantages(
        self,
        rewards_NK: np.ndarray,
        rollout: dict[str, jax.Array],
        num_generations: int | None = None,
    ) -> tuple[jax.Array, dict[str, float]]:
        a = self.args
        advantages_N, is_std_zero_N = grpo_advantages(
            rewards_NK,
            self.reward_weights,
            num_generations=num_generations or a.num_generations,
            scale_rewards=a.scale_rewards,
            multi_objective_aggregation=a.multi_objective_aggregation,
        )
        metrics = group_reward_metrics(
            rewards_NK, self.reward_weights, self.reward_func_names, np.asarray(is_std_zero_N)
        )
        return advantages_N, metrics

    def _init_extras(self) -> dict:
        return {**super()._init_extras(), **grpo.init_extras(self.args)}

    def _loss_units(self):
        return grpo.make_loss_units(self.args, self.steps_per_generation)

    def _loss_fn(self):
        return grpo.make_loss(
            self.args,
            self.apply_model,
            steps_per_generation=self.steps_per_generation,
            router_aux_loss_coef=self.router_aux_loss_coef,
        )
