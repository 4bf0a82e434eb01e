"""Host-side callbacks with HF Trainer names: lifecycle, progress display and metric sinks."""

from jaxrl.callbacks.base import (
    CallbackHandler,
    DefaultFlowCallback,
    EarlyStoppingCallback,
    ExportableState,
    TrainerCallback,
    TrainerControl,
    TrainerState,
)
from jaxrl.callbacks.jsonl import JsonlMetricsCallback
from jaxrl.callbacks.progress import RichProgressCallback
from jaxrl.callbacks.wandb import WandbCallback

__all__ = [
    "CallbackHandler",
    "DefaultFlowCallback",
    "EarlyStoppingCallback",
    "ExportableState",
    "JsonlMetricsCallback",
    "RichProgressCallback",
    "TrainerCallback",
    "TrainerControl",
    "TrainerState",
    "WandbCallback",
]
