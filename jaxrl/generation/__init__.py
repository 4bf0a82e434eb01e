"""The KV-cache sampler of jaxrl's causal LMs (`sampler.py`: the host side; `continuous.py` and
`static.py`: its two engines; `steps.py`: what both trace) and its settings (`config.py`)."""

from jaxrl.generation.config import _UNSUPPORTED_HF_FIELDS, GenerationConfig
from jaxrl.generation.sampler import (
    ENGINES,
    MIN_BUCKET,
    SampleOutput,
    Sampler,
    bucket_length,
    left_pad,
    row_limits,
)
from jaxrl.generation.steps import SamplingState, StopTables

__all__ = [
    "ENGINES",
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
