"""`DistillationConfig`: TRL 1.16's `DistillationConfig` fields and defaults for
`DistillationTrainer` (on-policy distillation, "On-Policy Distillation of Language Models").

TRL 1.16's distillation is on-policy only: the student generates every completion, and there is
no on-/off-policy mix field (GKD's `lmbda` lives in TRL's experimental `GKDTrainer`, not here).
TRL fields for backends jaxrl does not have (vLLM, DeepSpeed, tool calling, remote code) are
accepted at their defaults so TRL recipes parse, and rejected with a message naming the fix when
set to anything else. jaxrl adds `teacher_model_quantization` (an int8 weight-only teacher, as
DPO's `ref_model_quantization`).
"""

from __future__ import annotations

import typing
from dataclasses import dataclass
from typing import Any

from jaxrl.config import ConfigError, TrainingConfig
from jaxrl.config_checks import check_generation_engine
from jaxrl.trainers.onpolicy_config import OnPolicyConfig

_SHARED_UNSUPPORTED = (
    "use_vllm",
    "vllm_mode",
    "vllm_model_impl",
    "vllm_enable_sleep_mode",
    "vllm_structured_outputs_regex",
    "vllm_server_base_url",
    "vllm_server_host",
    "vllm_server_port",
    "vllm_server_timeout",
    "vllm_group_port",
    "vllm_gpu_memory_utilization",
    "vllm_max_model_length",
    "vllm_tensor_parallel_size",
    "ds3_gather_for_generation",
    "trust_remote_code",
    "cache_implementation",
)
_UNSUPPORTED = {
    **{k: v for k, v in OnPolicyConfig.unsupported_fields().items() if k in _SHARED_UNSUPPORTED},
    "max_tool_calling_iterations": (None, "jaxrl's DistillationTrainer takes no tools"),
    "teacher_model_revision": (
        None,
        "give the teacher's local directory (or hub id at its main revision) as "
        "teacher_model_name_or_path",
    ),
    "neftune_noise_alpha": (
        None,
        "NEFTune is implemented for the SFT, reward and DPO training forwards only",
    ),
    "data_seed": (None, "TRL's distillation RepeatSampler orders the prompts by `seed`"),
    "train_sampling_strategy": ("random", "TRL's distillation sampler; use `shuffle_dataset`"),
    "length_column_name": ("length", "TRL's distillation never groups prompts by length"),
    "include_for_metrics": ([], "TRL's DistillationTrainer takes no `compute_metrics`"),
    "batch_eval_metrics": (False, "TRL's DistillationTrainer takes no `compute_metrics`"),
    "include_num_input_tokens_seen": (
        "no",
        "TRL's distillation counts its prompt and completion tokens itself (`num_tokens`)",
    ),
}


@dataclass
class DistillationConfig(TrainingConfig):
    """TRL `DistillationConfig` (1.16): the student samples, the teacher scores every token,
    the loss is the generalised JSD selected by `beta` (0 forward KL, 0.5 JSD, 1 reverse KL)."""

    learning_rate: float = 1e-6
    model_init_kwargs: dict | str | None = None
    trust_remote_code: bool = False
    teacher_model_name_or_path: str | None = None
    teacher_model_revision: str | None = None
    # TRL: kwargs for the teacher's `from_pretrained`; jaxrl reads `dtype`/`torch_dtype` (the
    # teacher's stored dtype) and refuses the others.
    teacher_model_init_kwargs: dict | str | None = None
    disable_dropout: bool = False
    remove_unused_columns: bool = False
    _keeps_unused_columns: typing.ClassVar[bool] = True
    max_completion_length: int = 512
    ds3_gather_for_generation: bool = True
    shuffle_dataset: bool = True
    pad_to_multiple_of: int | str | None = "auto"
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float | None = None
    generation_kwargs: dict | None = None
    chat_template_kwargs: dict | None = None
    repetition_penalty: float = 1.0
    cache_implementation: str | None = None
    # jaxrl's sampler (no TRL field: TRL generates with transformers or vLLM).
    generation_engine: str = "continuous"
    generation_num_slots: int | None = None
    use_vllm: bool = False
    vllm_mode: str = "colocate"
    vllm_model_impl: str = "vllm"
    vllm_enable_sleep_mode: bool = False
    vllm_structured_outputs_regex: str | None = None
    vllm_server_base_url: str | None = None
    vllm_server_host: str = "0.0.0.0"
    vllm_server_port: int = 8000
    vllm_server_timeout: float = 240.0
    vllm_group_port: int = 51216
    vllm_gpu_memory_utilization: float = 0.3
    vllm_max_model_length: int | None = None
    vllm_tensor_parallel_size: int = 1
    beta: float = 1.0
    max_tool_calling_iterations: int | None = None
    log_completions: bool = False
    num_completions_to_print: int | None = None
    log_unique_prompts: bool = False
    # jaxrl: "int8" stores the frozen teacher as int8 weights with per-channel scales (each
    # weight dequantized where it is used, as DPO's `ref_model_quantization`); None: as loaded.
    teacher_model_quantization: str | None = None

    def __post_init__(self) -> None:
        check_generation_engine(self.generation_engine, self.generation_num_slots)
        if self.max_completion_length is None:
            raise ConfigError(
                "`max_completion_length=None` is not supported by jaxrl: the sampler needs a "
                "fixed completion budget; set an integer, e.g. 512 (TRL's default)."
            )
        super().__post_init__()
        for name, (inactive, why) in self.unsupported_fields().items():
            value = getattr(self, name)
            if value != inactive:
                raise ConfigError(
                    f"`{name}={value!r}` is not supported by jaxrl ({why}); remove the setting "
                    f"(default {inactive!r})."
                )
        if not 0.0 <= self.beta <= 1.0:
            raise ConfigError(f"beta must be in [0.0, 1.0], got {self.beta}.")
        if self.max_completion_length < 1:
            raise ConfigError(
                f"`max_completion_length` must be >= 1; got {self.max_completion_length}."
            )
        if not self.temperature > 0:
            raise ConfigError(f"`temperature` must be > 0; got {self.temperature}.")
        if not 0.0 < self.top_p <= 1.0:
            raise ConfigError(f"`top_p` must be in (0, 1]; got {self.top_p}.")
        if self.top_k < 0:
            raise ConfigError(f"`top_k` must be >= 0 (0 = off); got {self.top_k}.")
        if self.teacher_model_quantization not in (None, "int8"):
            raise ConfigError(
                f"`teacher_model_quantization={self.teacher_model_quantization!r}`: use 'int8' "
                "or None."
            )
        self.teacher_model_init_kwargs = self._teacher_kwargs(self.teacher_model_init_kwargs)

    @staticmethod
    def _teacher_kwargs(kwargs: dict | str | None) -> dict | None:
        if isinstance(kwargs, str):
            import json

            kwargs = json.loads(kwargs)
        if kwargs is None:
            return None
        unknown = sorted(set(kwargs) - {"dtype", "torch_dtype"})
        if unknown:
            raise ConfigError(
                f"teacher_model_init_kwargs {unknown} are not supported by jaxrl; it reads "
                "'dtype' (or 'torch_dtype') only."
            )
        return dict(kwargs)

    @classmethod
    def unsupported_fields(cls) -> dict[str, tuple[Any, str]]:
        """TRL fields accepted only at the value where they do nothing: name -> (that value,
        why jaxrl has no other)."""
        return dict(_UNSUPPORTED)
