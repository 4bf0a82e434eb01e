"""`RLOOConfig`: TRL 1.16's `RLOOConfig` fields and defaults for `RLOOTrainer`.

Shared generation/batching fields live in `OnPolicyConfig`; RLOO adds the reward shaping
(`beta` as a KL penalty in the reward, `reward_clip_range`) and `normalize_advantages`.
"""

from __future__ import annotations

from dataclasses import dataclass

from jaxrl.config import ConfigError
from jaxrl.trainers.onpolicy_config import OnPolicyConfig


@dataclass
class RLOOConfig(OnPolicyConfig):
    """TRL `RLOOConfig` (1.16): REINFORCE leave-one-out with a sequence-level clipped ratio."""

    num_generations: int = 2
    max_completion_length: int = 512
    beta: float = 0.05
    normalize_advantages: bool = False
    reward_clip_range: list[float] | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.reward_clip_range is not None:
            lo_hi = tuple(float(x) for x in self.reward_clip_range)
            if len(lo_hi) != 2 or lo_hi[0] > lo_hi[1]:
                raise ConfigError(
                    f"`reward_clip_range` must be (min, max) with min <= max; got "
                    f"{self.reward_clip_range}."
                )
            self.reward_clip_range = list(lo_hi)
