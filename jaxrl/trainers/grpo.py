"""GRPOTrainer: group relative policy optimisation with TRL 1.16 `GRPOTrainer` semantics.

The online shell (prompts -> sampler -> rewards -> update) is `OnPolicyTrainer`; this file
supplies the group-relative advantages (`jaxrl.losses.grpo.grpo_advantages`, TRL's reward
metrics) and the loss function (`grpo_loss`: every TRL loss type, token- or sequence-level
importance sampling, optional k3 KL to the reference, top-entropy masking).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl.losses.grpo import grpo_advantages, grpo_loss, high_entropy_mask
from jaxrl.rewards import group_reward_metrics
from jaxrl.trainers.grpo_config import GRPOConfig
from jaxrl.trainers.onpolicy import OnPolicyTrainer, completion_logprobs


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

    def _loss_fn(self):
        a = self.args
        chunk = a.logprob_chunk_size
        loss_kwargs = dict(
            loss_type=a.loss_type,
            epsilon=a.epsilon,
            epsilon_high=a.epsilon_high,
            max_completion_length=a.max_completion_length,
            importance_sampling_level=a.importance_sampling_level,
            beta=a.beta,
            delta=a.delta,
            sapo_temperature_neg=a.sapo_temperature_neg,
            sapo_temperature_pos=a.sapo_temperature_pos,
            vespo_k_pos=a.vespo_k_pos,
            vespo_lambda_pos=a.vespo_lambda_pos,
            vespo_k_neg=a.vespo_k_neg,
            vespo_lambda_neg=a.vespo_lambda_neg,
            use_bias_correction_kl=a.use_bias_correction_kl,
            off_policy_mask_threshold=a.off_policy_mask_threshold,
        )

        spg = self.steps_per_generation
        token_normalised = a.loss_type in ("dapo", "cispo", "vespo")

        def loss_fn(params, state, mb, rng, extras) -> tuple[jax.Array, Any]:
            model = self.apply_model(params, state)
            logps_BC, stats = completion_logprobs(
                model, mb, temperature=a.temperature, chunk_size=chunk, with_stats=True
            )
            mask_BC = mb["completion_mask"]
            entropy_mask = (
                high_entropy_mask(stats["entropy"], mask_BC, a.top_entropy_quantile)
                if a.top_entropy_quantile < 1.0
                else None
            )
            loss_sum, aux = grpo_loss(
                logps_BC,
                mb["advantages"],
                mask_BC,
                old_per_token_logps_BT=mb.get("old_logps"),
                ref_per_token_logps_BT=mb.get("ref_logps"),
                entropy_mask_BT=entropy_mask,
                entropies_BT=stats["entropy"],
                # TRL: the generation batch's tokens x accumulation / steps_per_generation per
                # optimizer step, i.e. its tokens / steps_per_generation per micro-batch. An eval
                # batch carries none: TRL's eval normaliser is the batch's own token count.
                token_count=(
                    jnp.maximum(mb["num_items_in_batch"][0], 1.0) / spg
                    if token_normalised and "num_items_in_batch" in mb
                    else None
                ),
                **loss_kwargs,
            )
            return loss_sum, (aux, extras)

        return loss_fn
