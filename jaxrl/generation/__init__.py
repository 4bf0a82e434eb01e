"""The KV-cache sampler of jaxrl's causal LMs (`sampler.py`) and its settings (`config.py`)."""

from jaxrl.generation.config import _UNSUPPORTED_HF_FIELDS, GenerationConfig
from jaxrl.generation.sampler import (
    MIN_BUCKET,
    SampleOutput,
    Sampler,
    SamplingState,
    StopTables,
    bucket_length,
    left_pad,
    row_limits,
)

__all__ = [
    "MIN_BUCKET",
    "_UNSUPPORTED_HF_FIELDS",
    "GenerationConfig",
    "SampleOutput",
    "Sampler",
    "SamplingState",
    "StopTables",
    "bucket_length",
    "left_pad",
    "row_limits",
]
