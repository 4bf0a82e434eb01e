"""jaxrl: TRL for JAX. SFT, reward modelling and DPO as pure-functional, sharded JAX.

The public API mirrors TRL's names: `SFTTrainer`/`SFTConfig`, `RewardTrainer`/`RewardConfig`,
`DPOTrainer`/`DPOConfig`, HF-style callbacks, `set_seed`, and TRL's scripting surface
(`TrlParser`, `ScriptArguments`, `ModelConfig`, `get_dataset`, ...), so TRL's example scripts
run with their imports changed from `trl` to `jaxrl`.
"""

import random

import numpy as np

from jaxrl.callbacks.base import TrainerCallback, TrainerControl, TrainerState
from jaxrl.callbacks.bema import BEMACallback
from jaxrl.callbacks.sync_ref import SyncRefModelCallback
from jaxrl.config import DPOConfig, RewardConfig, SFTConfig, TrainingConfig
from jaxrl.scripting import (
    DatasetMixtureConfig,
    ModelConfig,
    ScriptArguments,
    TrlParser,
    get_dataset,
    get_peft_config,
    get_quantization_config,
)
from jaxrl.trainers import DPOTrainer, EvalPrediction, RewardTrainer, SFTTrainer

__version__ = "0.1.0"


def set_seed(seed: int) -> None:
    """Seed Python and NumPy (host-side shuffles); JAX randomness comes from `config.seed`."""
    random.seed(seed)
    np.random.seed(seed)


__all__ = [
    "BEMACallback",
    "DPOConfig",
    "DatasetMixtureConfig",
    "DPOTrainer",
    "EvalPrediction",
    "ModelConfig",
    "RewardConfig",
    "RewardTrainer",
    "SFTConfig",
    "ScriptArguments",
    "SFTTrainer",
    "SyncRefModelCallback",
    "TrainerCallback",
    "TrainerControl",
    "TrainerState",
    "TrainingConfig",
    "TrlParser",
    "get_dataset",
    "get_peft_config",
    "get_quantization_config",
    "set_seed",
]
