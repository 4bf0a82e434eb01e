"""The one table of jaxrl's algorithms: per `--algo` name, its config class, trainer class,
embedded recipe and command-line script flags.

`python -m jaxrl.train`, `jaxrl.bench` and `jaxrl.config_docs` look an algorithm up here instead
of keeping lists of their own. An entry only names classes; how the command line builds each
trainer (datasets, reward functions, the embedded task) stays in `jaxrl.train`.
"""

from __future__ import annotations

import dataclasses

from jaxrl.config_cli import OnlineScriptArguments, ScriptArguments
from jaxrl.trainers.ddpo import DDPOTrainer
from jaxrl.trainers.ddpo_config import DDPOConfig
from jaxrl.trainers.distill import DistillationTrainer
from jaxrl.trainers.distill_config import DistillationConfig
from jaxrl.trainers.dpo import DPOTrainer
from jaxrl.trainers.dpo_config import DPOConfig
from jaxrl.trainers.grpo import GRPOTrainer
from jaxrl.trainers.grpo_config import GRPOConfig
from jaxrl.trainers.kto import KTOTrainer
from jaxrl.trainers.kto_config import KTOConfig
from jaxrl.trainers.ppo import PPOTrainer
from jaxrl.trainers.ppo_config import PPOConfig
from jaxrl.trainers.reward import RewardTrainer
from jaxrl.trainers.reward_config import RewardConfig
from jaxrl.trainers.rloo import RLOOTrainer
from jaxrl.trainers.rloo_config import RLOOConfig
from jaxrl.trainers.sft import SFTTrainer
from jaxrl.trainers.sft_config import SFTConfig


@dataclasses.dataclass(frozen=True)
class Algorithm:
    """One algorithm of `python -m jaxrl.train --algo NAME`."""

    name: str
    config_class: type
    trainer_class: type
    # The embedded job's recipe, `jaxrl/recipes/RECIPE.yaml`; None: no shipped recipe (DDPO's
    # defaults are its embedded job).
    recipe: str | None
    # The script-level flags `parse_config` returns beside the config (TRL's `ScriptArguments`,
    # or `GRPOScriptArguments`' reward flags for the algorithms scored by reward functions);
    # None: the algorithm's own CLI reads its config class only (DDPO, `parse_ddpo_cli`).
    script_class: type | None

    @property
    def takes_reward_funcs(self) -> bool:
        """Whether the CLI scores this algorithm with `--reward_funcs` / a reward model (GRPO,
        RLOO: TRL's `GRPOScriptArguments`)."""
        return self.script_class is OnlineScriptArguments


ALGORITHMS: dict[str, Algorithm] = {
    a.name: a
    for a in (
        Algorithm("sft", SFTConfig, SFTTrainer, "sft", ScriptArguments),
        Algorithm("reward", RewardConfig, RewardTrainer, "reward", ScriptArguments),
        Algorithm("dpo", DPOConfig, DPOTrainer, "dpo", ScriptArguments),
        Algorithm("kto", KTOConfig, KTOTrainer, "kto", ScriptArguments),
        Algorithm("ppo", PPOConfig, PPOTrainer, "ppo", ScriptArguments),
        Algorithm("grpo", GRPOConfig, GRPOTrainer, "grpo", OnlineScriptArguments),
        Algorithm("rloo", RLOOConfig, RLOOTrainer, "rloo", OnlineScriptArguments),
        Algorithm("distill", DistillationConfig, DistillationTrainer, "distill", ScriptArguments),
        Algorithm("ddpo", DDPOConfig, DDPOTrainer, None, None),
    )
}
