"""Fields shared by the online trainers' configs (`GRPOConfig`, `RLOOConfig`): TRL 1.16's
generation, batching, reference-sync and logging fields with TRL's defaults and validation.

TRL fields for backends jaxrl does not have (vLLM, transformers continuous batching, tool
calling, DeepSpeed) are accepted at their defaults, so recipes written for TRL parse, and rejected
with a message naming the fix when set to anything else. The generation batch resolution
(`generation_batch_size` vs `steps_per_generation`) needs the data-parallel size, so the trainer
finishes it (`resolve_generation_batch`); the checks that do not depend on it run here.
"""

from __future__ import annotations

import typing
from dataclasses import dataclass
from typing import Any

from jaxrl.config import ConfigError, TrainingConfig
from jaxrl.config_checks import (
    BETA_MAX,
    TEMPERATURE_MAX,
    check_generation_engine,
    check_number,
)

# Field -> value at which it is inactive; any other value is rejected (see `_reject_unsupported`).
_UNSUPPORTED = {
    "use_vllm": (False, "jaxrl generates with its own KV-cache sampler (jaxrl.generation)"),
    "vllm_mode": ("colocate", "vLLM is not used"),
    "vllm_model_impl": ("vllm", "vLLM is not used"),
    "vllm_enable_sleep_mode": (False, "vLLM is not used"),
    "vllm_structured_outputs_regex": (None, "vLLM is not used"),
    "vllm_server_base_url": (None, "vLLM is not used"),
    "vllm_server_host": ("0.0.0.0", "vLLM is not used"),
    "vllm_server_port": (8000, "vLLM is not used"),
    "vllm_server_timeout": (240.0, "vLLM is not used"),
    "vllm_group_port": (51216, "vLLM is not used"),
    "vllm_gpu_memory_utilization": (0.3, "vLLM is not used"),
    "vllm_max_model_length": (None, "vLLM is not used"),
    "vllm_tensor_parallel_size": (1, "vLLM is not used; shard with mesh_tensor instead"),
    "use_transformers_continuous_batching": (False, "jaxrl batches continuously in its own sampler (generation_engine)"),
    "transformers_continuous_batching_config": (None, "jaxrl batches continuously in its own sampler (generation_engine)"),
    "use_transformers_paged": (False, "jaxrl batches continuously in its own sampler (generation_engine)"),
    "ds3_gather_for_generation": (True, "DeepSpeed is not used (params are sharded by the mesh)"),
    "trust_remote_code": (False, "jaxrl loads only its own model families"),
    "cache_implementation": (None, "the sampler always uses its own static KV cache"),
    # HF TrainingArguments fields the offline trainers honour but TRL's GRPO/RLOO do not.
    "neftune_noise_alpha": (
        None,
        "NEFTune is implemented for the SFT, reward and DPO training forwards only, not for "
        "on-policy updates",
    ),
    "data_seed": (None, "TRL's GRPO/RLOO RepeatSampler orders the prompts by `seed`"),
    "train_sampling_strategy": (
        "random",
        "TRL's GRPO/RLOO sample prompts with their RepeatSampler; use `shuffle_dataset`",
    ),
    "length_column_name": ("length", "TRL's GRPO/RLOO never group prompts by length"),
    "include_for_metrics": (
        [],
        "TRL's GRPO/RLOO take no `compute_metrics`, and neither does jaxrl's",
    ),
    "batch_eval_metrics": (
        False,
        "TRL's GRPO/RLOO take no `compute_metrics`, and neither does jaxrl's",
    ),
    "include_num_input_tokens_seen": (
        "no",
        "TRL's GRPO/RLOO count their prompt and completion tokens themselves, which jaxrl logs "
        "as `num_tokens`",
    ),
}


@dataclass
class OnPolicyConfig(TrainingConfig):
    """Generation and batching fields of TRL's `GRPOConfig` / `RLOOConfig` (TRL 1.16 defaults).

    `per_device_train_batch_size` counts completions, as in TRL: one generation batch holds
    `generation_batch_size / num_generations` distinct prompts.
    """

    learning_rate: float = 1e-6
    # TRL default False: the policy's loss forward applies the model config's dropout (GPT-2's
    # and Phi-3's, any family's attention_dropout); True turns it off. Sampling and the old /
    # reference log-prob passes never drop (`jaxrl.algos.model_dropout`).
    disable_dropout: bool = False
    # TRL's default "auto" pads to 128 on Neuron devices and not at all elsewhere, so it is None
    # here (resolved by `TrainingConfig`); an int buckets the sampler's prompt lengths to its
    # multiples.
    pad_to_multiple_of: int | str | None = "auto"
    # False: every dataset column besides `prompt` reaches the reward functions (TRL default);
    # True: only `prompt` does.
    remove_unused_columns: bool = False
    _keeps_unused_columns: typing.ClassVar[bool] = True
    trust_remote_code: bool = False
    # TRL: weight of the MoE load-balancing loss (transformers' `aux_loss`) of the policy's loss
    # forward, added to each micro-batch's loss divided by the accumulation steps; None takes
    # the model config's own `router_aux_loss_coef`, 0.0 turns it off; nonzero on a model
    # without MoE layers is an error (`jaxrl.algos.router_aux`).
    router_aux_loss_coef: float | None = None
    num_generations: int = 8
    num_generations_eval: int | None = None
    max_completion_length: int = 512
    ds3_gather_for_generation: bool = True
    shuffle_dataset: bool = True
    generation_batch_size: int | None = None
    steps_per_generation: int | None = None
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
    beta: float = 0.0
    num_iterations: int = 1
    epsilon: float = 0.2
    epsilon_high: float | None = None
    reward_weights: list[float] | None = None
    mask_truncated_completions: bool = False
    sync_ref_model: bool = False
    ref_model_mixup_alpha: float = 0.6
    ref_model_sync_steps: int = 512
    log_completions: bool = False
    # Image prompts: the completion logs hold the prompts without their images (TRL's parquet
    # files); wandb tables with the images are refused (set False).
    log_multimodal: bool = True
    num_completions_to_print: int | None = None
    log_unique_prompts: bool = False
    use_transformers_continuous_batching: bool = False
    transformers_continuous_batching_config: dict | None = None
    use_transformers_paged: bool = False

    def __post_init__(self) -> None:
        check_generation_engine(self.generation_engine, self.generation_num_slots)
        if self.max_completion_length is None:
            raise ConfigError(
                "`max_completion_length=None` is not supported by jaxrl: the sampler needs a "
                "fixed completion budget (TRL then falls back to the model's generation "
                "max_length); set an integer, e.g. 512 (TRL's default)."
            )
        super().__post_init__()
        self._reject_unsupported()
        if self.steps_per_generation is not None and self.generation_batch_size is not None:
            raise ConfigError(
                "'generation_batch_size' and 'steps_per_generation' can not be both configured "
                "at the same time; set one of them."
            )
        if self.num_generations < 2:
            raise ConfigError(
                "GRPO/RLOO need at least 2 generations per prompt to compare completions; got "
                f"num_generations={self.num_generations}."
            )
        if (
            self.generation_batch_size is not None
            and self.generation_batch_size % self.num_generations
        ):
            raise ConfigError(
                f"generation_batch_size ({self.generation_batch_size}) must be divisible by "
                f"num_generations ({self.num_generations})."
            )
        for name in ("max_completion_length", "num_iterations", "ref_model_sync_steps"):
            if getattr(self, name) < 1:
                raise ConfigError(f"`{name}` must be >= 1; got {getattr(self, name)}.")
        for name in ("steps_per_generation", "generation_batch_size", "num_generations_eval"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ConfigError(f"`{name}` must be None or >= 1; got {value}.")
        check_number(
            "temperature",
            self.temperature,
            minimum=0,
            exclusive_minimum=True,
            maximum=TEMPERATURE_MAX,
            why="Logits are divided by it: 1.0 (TRL's default) samples the model as trained, "
            "near 0 is greedy, and far above 1 sampling is uniform over the vocabulary.",
        )
        check_number(
            "beta",
            self.beta,
            minimum=0,
            maximum=BETA_MAX,
            why="beta weighs the KL to the reference model (0 loads none); TRL's defaults are "
            "0.0 (GRPO) and 0.05 (RLOO), published runs use up to about 0.1.",
        )
        check_number(
            "epsilon",
            self.epsilon,
            minimum=0,
            why="The ratio is clipped to [1 - epsilon, 1 + epsilon_high] (TRL's default 0.2).",
        )
        if self.epsilon_high is not None:
            check_number("epsilon_high", self.epsilon_high, minimum=0, why="See epsilon.")
        if not 0.0 < self.top_p <= 1.0:
            raise ConfigError(f"`top_p` must be in (0, 1]; got {self.top_p}.")
        if self.top_k < 0:
            raise ConfigError(f"`top_k` must be >= 0 (0 = off); got {self.top_k}.")
        if not 0.0 <= self.ref_model_mixup_alpha <= 1.0:
            raise ConfigError(
                f"`ref_model_mixup_alpha` must be in [0, 1]; got {self.ref_model_mixup_alpha}."
            )
        if self.sync_ref_model and self.beta == 0.0:
            raise ConfigError(
                "sync_ref_model=True needs a reference model, but beta=0.0 loads none; set "
                "beta > 0 or sync_ref_model=False."
            )

    def check_eval_batch(self, dp: int) -> None:
        """TRL: when evaluating, the global eval batch (`per_device_eval_batch_size` x `dp`
        data-parallel devices, TRL's processes) holds whole groups of `num_generations_eval`."""
        g_eval = self.num_generations_eval or self.num_generations
        if self.eval_strategy != "no" and (self.per_device_eval_batch_size * dp) % g_eval:
            raise ConfigError(
                f"The global eval batch size ({self.per_device_eval_batch_size} x {dp} devices) "
                f"must be divisible by the number of generations used for evaluation ({g_eval}); "
                "change per_device_eval_batch_size or num_generations_eval."
            )

    @classmethod
    def unsupported_fields(cls) -> dict[str, tuple[Any, str]]:
        """TRL fields accepted only at the value where they do nothing: name -> (that value,
        why jaxrl has no other)."""
        return dict(_UNSUPPORTED)

    def _reject_unsupported(self) -> None:
        for name, (inactive, why) in self.unsupported_fields().items():
            value = getattr(self, name)
            if value != inactive:
                raise ConfigError(
                    f"`{name}={value!r}` is not supported by jaxrl ({why}); remove the setting "
                    f"(default {inactive!r})."
                )

    def resolve_generation_batch(self, dp: int) -> tuple[int, int]:
        """`(generation_batch_size, steps_per_generation)` over `dp` data-parallel devices, as
        TRL resolves them over its processes (default: one generation per optimizer step)."""
        per_step = self.per_device_train_batch_size * dp
        if self.generation_batch_size is None:
            spg = self.steps_per_generation or self.gradient_accumulation_steps
            gbs = per_step * spg
        else:
            gbs = self.generation_batch_size
            if gbs % per_step:
                raise ConfigError(
                    f"generation_batch_size ({gbs}) must be divisible by the global batch size "
                    f"({self.per_device_train_batch_size} x {dp} devices = {per_step})."
                )
            spg = gbs // per_step
        if gbs % self.num_generations:
            raise ConfigError(
                f"generation_batch_size ({gbs}) must be divisible by num_generations "
                f"({self.num_generations}); change per_device_train_batch_size or "
                "steps_per_generation."
            )
        return gbs, spg
