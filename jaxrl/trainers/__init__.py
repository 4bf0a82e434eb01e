"""Trainers: the shared loop in `base.py`, one thin file per algorithm."""

from jaxrl.trainers.base import EvalPrediction, Trainer, TrainingInterrupted
from jaxrl.trainers.dpo import DPOTrainer
from jaxrl.trainers.reward import RewardTrainer
from jaxrl.trainers.sft import SFTTrainer

__all__ = [
    "DPOTrainer",
    "EvalPrediction",
    "RewardTrainer",
    "SFTTrainer",
    "Trainer",
    "TrainingInterrupted",
]
