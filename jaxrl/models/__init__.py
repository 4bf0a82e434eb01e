"""Flax NNX decoder-only LMs (Llama, Mistral, Qwen2/2.5, Qwen3, Gemma, Gemma 3 text, SmolLM3,
OLMo 2, GPT-OSS, GPT-2) and Gemma 3's image-text model (`vision=True`) with HF checkpoint I/O.

Every model holds only `nnx.Param` state carrying logical axis names, so
`graphdef, params = nnx.split(model)` / `nnx.merge(graphdef, params)` is the functional API.
"""

from jaxrl.models.causal_lm import CausalLM
from jaxrl.models.config import ModelConfig
from jaxrl.models.families import SUPPORTED_MODEL_TYPES
from jaxrl.models.gpt2 import GPT2ForCausalLM, GPT2Model
from jaxrl.models.gpt_oss import GptOssForCausalLM, GptOssModel
from jaxrl.models.heads import (
    CausalLMWithValueHead,
    ScoreHead,
    SequenceClassificationModel,
    ValueHead,
)
from jaxrl.models.hf import (
    build_model,
    from_config,
    from_pretrained,
    save_pretrained,
)
from jaxrl.models.hf_config import config_from_hf
from jaxrl.models.hf_objects import from_transformers
from jaxrl.models.llama import LlamaForCausalLM, LlamaModel
from jaxrl.models.presets import count_params, flops_per_token, get_preset
from jaxrl.models.vision import Gemma3ForConditionalGeneration

__all__ = [
    "SUPPORTED_MODEL_TYPES",
    "CausalLM",
    "CausalLMWithValueHead",
    "GPT2ForCausalLM",
    "Gemma3ForConditionalGeneration",
    "GPT2Model",
    "GptOssForCausalLM",
    "GptOssModel",
    "LlamaForCausalLM",
    "LlamaModel",
    "ModelConfig",
    "ScoreHead",
    "SequenceClassificationModel",
    "ValueHead",
    "build_model",
    "config_from_hf",
    "count_params",
    "flops_per_token",
    "from_config",
    "from_pretrained",
    "from_transformers",
    "get_preset",
    "save_pretrained",
]
