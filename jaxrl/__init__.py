"""jaxrl: TRL for JAX. SFT, reward modelling, DPO, KTO, PPO, GRPO, RLOO, distillation and DDPO as
pure-functional JAX.

The public API mirrors TRL's names: `SFTTrainer`/`SFTConfig`, `RewardTrainer`/`RewardConfig`,
`DPOTrainer`/`DPOConfig`, `KTOTrainer`/`KTOConfig`, `GRPOTrainer`/`GRPOConfig`,
`RLOOTrainer`/`RLOOConfig`, `DistillationTrainer`/`DistillationConfig`, `PPOTrainer`/`PPOConfig`
(TRL v0.7.2's API), HF-style callbacks, `set_seed`, and TRL's scripting
surface (`TrlParser`, `ScriptArguments`, `ModelConfig`, `get_dataset`, ...), so TRL's example
scripts run with their imports changed from `trl` to `jaxrl`.
"""

# ruff: noqa: E402 (the re-exec check runs before the package's imports)
from jaxrl._malloc import maybe_reexec, trim_after_compiles

maybe_reexec()  # the CLIs only: huge pages for XLA:CPU buffers (see jaxrl/_malloc.py)

import logging

# transformers announces on import that PyTorch is absent ("PyTorch was not found. Models won't be
# available ..."). jaxrl uses transformers for configs and tokenizers only and computes in JAX,
# so on the base install (no torch) the notice is noise on every run. Filtered on transformers'
# library logger before any jaxrl module imports it; its other messages pass.
logging.getLogger("transformers").addFilter(
    lambda record: not str(record.msg).startswith("PyTorch was not found")
)

from jaxrl.callbacks.base import (
    EarlyStoppingCallback,
    TrainerCallback,
    TrainerControl,
    TrainerState,
)
from jaxrl.callbacks.bema import BEMACallback
from jaxrl.callbacks.completions import LogCompletionsCallback, WeaveCallback
from jaxrl.callbacks.sync_ref import SyncRefModelCallback
from jaxrl.config import TrainingConfig
from jaxrl.lora.value_head import AutoModelForCausalLMWithValueHead
from jaxrl.models.resize import clone_chat_template
from jaxrl.scripting import (
    DatasetMixtureConfig,
    ModelConfig,
    ScriptArguments,
    TrlParser,
    get_dataset,
    get_peft_config,
    get_quantization_config,
)
from jaxrl.seeding import set_seed
from jaxrl.trainers import (
    DDPOConfig,
    DDPOTrainer,
    DistillationConfig,
    DistillationTrainer,
    DPOConfig,
    DPOTrainer,
    EvalPrediction,
    GRPOConfig,
    GRPOTrainer,
    KTOConfig,
    KTOTrainer,
    RewardConfig,
    RewardTrainer,
    RLOOConfig,
    RLOOTrainer,
    SFTConfig,
    SFTTrainer,
)
from jaxrl.trainers.ppo import PPOTrainer
from jaxrl.trainers.ppo_config import PPOConfig

__version__ = "0.1.0"

trim_after_compiles()  # compiler scratch back to the OS before a step runs (see jaxrl/_malloc.py)


__all__ = [
    "AutoModelForCausalLMWithValueHead",
    "DDPOConfig",
    "DDPOTrainer",
    "BEMACallback",
    "DPOConfig",
    "DatasetMixtureConfig",
    "DistillationConfig",
    "DistillationTrainer",
    "DPOTrainer",
    "EvalPrediction",
    "GRPOConfig",
    "GRPOTrainer",
    "KTOConfig",
    "KTOTrainer",
    "LogCompletionsCallback",
    "PPOConfig",
    "PPOTrainer",
    "ModelConfig",
    "RewardConfig",
    "RewardTrainer",
    "RLOOConfig",
    "RLOOTrainer",
    "SFTConfig",
    "ScriptArguments",
    "SFTTrainer",
    "SyncRefModelCallback",
    "EarlyStoppingCallback",
    "TrainerCallback",
    "TrainerControl",
    "TrainerState",
    "TrainingConfig",
    "WeaveCallback",
    "TrlParser",
    "get_dataset",
    "clone_chat_template",
    "get_peft_config",
    "get_quantization_config",
    "set_seed",
]
