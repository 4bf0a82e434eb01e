"""`GRPOConfig`: TRL 1.16's `GRPOConfig` fields and defaults for `GRPOTrainer`.

The shared generation/batching fields live in `OnPolicyConfig`; this file adds the GRPO loss
fields (`max_tool_calling_iterations`: `jaxrl.trainers.onpolicy_agentic`). Fields for features
jaxrl does not implement (vLLM importance-sampling correction) are accepted at their defaults
and rejected otherwise.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from jaxrl.config import ConfigError
from jaxrl.losses.grpo import IMPORTANCE_SAMPLING_LEVELS, LOSS_TYPES, resolve_scale_rewards
from jaxrl.trainers.onpolicy_config import OnPolicyConfig

MULTI_OBJECTIVE_AGGREGATIONS = ("sum_then_normalize", "normalize_then_sum")
_UNSUPPORTED_GRPO = {
    # The vLLM importance-sampling correction only acts when generating with vLLM.
    "vllm_importance_sampling_correction": (True, "vLLM is not used"),
    "vllm_importance_sampling_mode": ("sequence_mask", "vLLM is not used"),
    "vllm_importance_sampling_clip_max": (3.0, "vLLM is not used"),
    "vllm_importance_sampling_clip_min": (None, "vLLM is not used"),
    "vllm_importance_sampling_cap": (None, "vLLM is not used"),
    "log_completions_hub_repo": (
        None,
        "completion logs are not uploaded to the Hub; `log_completions` writes them to "
        "output_dir/completions/",
    ),
}


@dataclass
class GRPOConfig(OnPolicyConfig):
    """TRL `GRPOConfig` (1.16): group-relative policy optimisation and its loss variants."""

    # Logits and log-probs are always accumulated in f32 (jaxrl.core.logprobs), which is what
    # this TRL flag buys; accepted either way. (Not a TRL RLOOConfig field, so not RLOO's.)
    cast_lm_head_to_fp32: bool = False
    num_generations: int = 8
    max_completion_length: int = 512
    beta: float = 0.0  # 0: no reference model is built or stored
    delta: float | None = None
    sapo_temperature_neg: float = 1.05
    sapo_temperature_pos: float = 1.0
    vespo_k_pos: float = 2.0
    vespo_lambda_pos: float = 3.0
    vespo_k_neg: float = 3.0
    vespo_lambda_neg: float = 2.0
    importance_sampling_level: str = "token"
    multi_objective_aggregation: str = "sum_then_normalize"
    scale_rewards: str | bool = "group"
    loss_type: str = "dapo"
    top_entropy_quantile: float = 1.0
    entropy_coef: float = 0.0
    use_adaptive_entropy: bool = False
    entropy_coef_min: float = 0.0
    entropy_coef_max: float = 1.0
    entropy_coef_delta: float = 0.005
    entropy_target: float = 0.2
    max_tool_calling_iterations: int | None = None
    vllm_importance_sampling_correction: bool = True
    vllm_importance_sampling_mode: str = "sequence_mask"
    vllm_importance_sampling_clip_max: float = 3.0
    vllm_importance_sampling_clip_min: float | None = None
    vllm_importance_sampling_cap: float | None = None
    off_policy_mask_threshold: float | None = None
    use_bias_correction_kl: bool = True
    log_completions_hub_repo: str | None = None

    @classmethod
    def unsupported_fields(cls) -> dict:
        return {**super().unsupported_fields(), **_UNSUPPORTED_GRPO}

    def __post_init__(self) -> None:
        super().__post_init__()
        try:
            self.scale_rewards = resolve_scale_rewards(self.scale_rewards)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        for name, choices in (
            ("loss_type", LOSS_TYPES),
            ("importance_sampling_level", IMPORTANCE_SAMPLING_LEVELS),
            ("multi_objective_aggregation", MULTI_OBJECTIVE_AGGREGATIONS),
        ):
            if getattr(self, name) not in choices:
                raise ConfigError(
                    f"`{name}={getattr(self, name)!r}` is not valid; choose one of {list(choices)}."
                )
        if not 0.0 < self.top_entropy_quantile <= 1.0:
            raise ConfigError(
                f"`top_entropy_quantile` must be in (0, 1]; got {self.top_entropy_quantile}."
            )
        if self.delta is not None and self.delta <= 1.0:
            raise ConfigError(f"`delta` must be > 1 (a cap on the ratio); got {self.delta}.")
        self._check_entropy_bonus()

    def _check_entropy_bonus(self) -> None:
        """TRL 1.16 checks none of the entropy-bonus fields; jaxrl rejects the settings its
        controller cannot mean: a NaN anywhere (it would poison the loss or freeze the
        controller), and under `use_adaptive_entropy` an empty clamp range or a negative step."""
        names = (
            "entropy_coef",
            "entropy_coef_min",
            "entropy_coef_max",
            "entropy_coef_delta",
            "entropy_target",
        )
        for name in names:
            if math.isnan(getattr(self, name)):
                raise ConfigError(f"`{name}` must be a number; got nan.")
        if not math.isfinite(self.entropy_coef):
            raise ConfigError(
                f"`entropy_coef` must be finite (the loss subtracts entropy_coef x entropy); "
                f"got {self.entropy_coef}."
            )
        if not self.use_adaptive_entropy:
            return
        if self.entropy_coef_min > self.entropy_coef_max:
            raise ConfigError(
                f"`entropy_coef_min` ({self.entropy_coef_min}) must be <= `entropy_coef_max` "
                f"({self.entropy_coef_max}): adaptive entropy control clamps the coefficient "
                "to [entropy_coef_min, entropy_coef_max]."
            )
        if self.entropy_coef_delta < 0:
            raise ConfigError(
                f"`entropy_coef_delta` must be >= 0 (the step adaptive entropy control moves "
                f"the coefficient by); got {self.entropy_coef_delta}."
            )
