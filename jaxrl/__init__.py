"""jaxrl: TRL for JAX. SFT, reward modelling and DPO as pure-functional, sharded JAX.

The public API mirrors TRL's names: `SFTTrainer`/`SFTConfig`, `RewardTrainer`/`RewardConfig`,
`DPOTrainer`/`DPOConfig`, HF-style callbacks, and `set_seed`.
"""

import random

import numpy as np

from jaxrl.callbacks.base import TrainerCallback, TrainerControl, TrainerState
from jaxrl.callbacks.bema import BEMACallback
from jaxrl.callbacks.completions import LogCompletionsCallback, WeaveCallback
from jaxrl.callbacks.sync_ref import SyncRefModelCallback
from jaxrl.config import DPOConfig, RewardConfig, SFTConfig, TrainingConfig
from jaxrl.trainers import (
    DDPOConfig,
    DDPOTrainer,
    DPOTrainer,
    EvalPrediction,
    RewardTrainer,
    SFTTrainer,
)

__version__ = "0.1.0"


def set_seed(seed: int) -> None:
    """Seed Python and NumPy (host-side shuffles); JAX randomness comes from `config.seed`."""
    random.seed(seed)
    np.random.seed(seed)


__all__ = [
    "DDPOConfig",
    "DDPOTrainer",
    "BEMACallback",
    "DPOConfig",
    "DPOTrainer",
    "EvalPrediction",
    "LogCompletionsCallback",
    "RewardConfig",
    "RewardTrainer",
    "SFTConfig",
    "SFTTrainer",
    "SyncRefModelCallback",
    "TrainerCallback",
    "TrainerControl",
    "TrainerState",
    "TrainingConfig",
    "WeaveCallback",
    "set_seed",
]
