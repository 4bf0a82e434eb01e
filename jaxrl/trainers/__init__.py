"""Trainers: the shared loop in `loop.py`, the language-model shell in `base.py`, one thin file
per algorithm beside its config (`*_config.py`), and the table of algorithms in `registry.py`."""

from jaxrl.trainers.base import Trainer
from jaxrl.trainers.ddpo import DDPOTrainer
from jaxrl.trainers.ddpo_config import DDPOConfig
from jaxrl.trainers.distill import DistillationTrainer
from jaxrl.trainers.distill_config import DistillationConfig
from jaxrl.trainers.dpo import DPOTrainer
from jaxrl.trainers.dpo_config import DPOConfig
from jaxrl.trainers.evaluation import EvalPrediction, PredictionOutput
from jaxrl.trainers.grpo import GRPOTrainer
from jaxrl.trainers.grpo_config import GRPOConfig
from jaxrl.trainers.kto import KTOTrainer
from jaxrl.trainers.kto_config import KTOConfig
from jaxrl.trainers.loop import TrainingInterrupted, TrainLoop, TrainOutput
from jaxrl.trainers.onpolicy import OnPolicyTrainer
from jaxrl.trainers.reward import RewardTrainer
from jaxrl.trainers.reward_config import RewardConfig
from jaxrl.trainers.rloo import RLOOTrainer
from jaxrl.trainers.rloo_config import RLOOConfig
from jaxrl.trainers.sft import SFTTrainer
from jaxrl.trainers.sft_config import SFTConfig

__all__ = [
    "DDPOConfig",
    "DDPOTrainer",
    "DPOConfig",
    "DistillationConfig",
    "DistillationTrainer",
    "DPOTrainer",
    "EvalPrediction",
    "GRPOConfig",
    "GRPOTrainer",
    "KTOConfig",
    "KTOTrainer",
    "OnPolicyTrainer",
    "PredictionOutput",
    "RLOOConfig",
    "RLOOTrainer",
    "RewardConfig",
    "RewardTrainer",
    "SFTConfig",
    "SFTTrainer",
    "Trainer",
    "TrainLoop",
    "TrainOutput",
    "TrainingInterrupted",
]
