"""`PPOConfig`: every field and default of TRL v0.7.2's `PPOConfig` (plus v0.7.3's
`whiten_rewards` and `optimize_device_cache`), with the same validation.

Fields that only configure PyTorch/accelerate machinery either have a JAX meaning or are
rejected when set (see each field's comment); none is silently ignored.

jaxrl additions (no TRL v0.7.2 counterpart; TRL users write the loop themselves): the fields of
`PPOTrainer.train()`'s loop (output directory, logging and checkpoint cadence, resume; HF
TrainingArguments names and meanings) and the generation settings of its rollouts (defaults of
TRL's PPO examples: sampling at temperature 1 with top-k and top-p off).
"""

from __future__ import annotations

import dataclasses
import math
import os
import sys
import warnings
from typing import Any

from jaxrl.config_checks import TEMPERATURE_MAX, check_generation_engine, check_number
from jaxrl.loop_options import parse_resume_from_checkpoint

KL_PENALTIES = ("kl", "abs", "mse", "full")


def _default_exp_name() -> str:
    # TRL: the script's file name without ".py" (it slices off three characters blindly).
    return os.path.basename(sys.argv[0])[: -len(".py")]


def _flatten(d: dict, prefix: str = "", sep: str = "/") -> dict:
    out = {}
    for k, v in d.items():
        key = f"{prefix}{sep}{k}" if prefix else str(k)
        if isinstance(v, dict):
            out.update(_flatten(v, key, sep))
        else:
            out[key] = v
    return out


@dataclasses.dataclass
class PPOConfig:
    """Configuration of `PPOTrainer` (TRL v0.7.2 names and defaults)."""

    # ---- common parameters
    exp_name: str = dataclasses.field(default_factory=_default_exp_name)  # tracking only
    seed: int = 0  # JAX rng of the trainer (epoch permutations, value-head init) and numpy/random
    log_with: str | None = None  # "wandb" only (see __post_init__)
    task_name: str | None = None  # tracking only
    model_name: str | None = None  # tracking only
    query_dataset: str | None = None  # tracking only
    reward_model: str | None = None  # tracking; `jaxrl.train --algo ppo`: reward model dir
    remove_unused_columns: bool = True  # prepare_dataloader drops columns the model does not use
    tracker_kwargs: dict = dataclasses.field(default_factory=dict)  # {"wandb": {...}} -> init
    accelerator_kwargs: dict = dataclasses.field(default_factory=dict)  # no JAX meaning: must be {}
    project_kwargs: dict = dataclasses.field(default_factory=dict)  # no JAX meaning: must be {}
    tracker_project_name: str = "trl"  # wandb project
    push_to_hub_if_best_kwargs: dict = dataclasses.field(default_factory=dict)  # must be {}

    # ---- hyperparameters
    steps: int = 20000
    learning_rate: float = 1e-5  # Adam, no weight decay
    adap_kl_ctrl: bool = True
    init_kl_coef: float | None = 0.2
    kl_penalty: str = "kl"  # one of KL_PENALTIES
    target: float | None = 6
    horizon: float | None = 10000
    gamma: float = 1
    lam: float = 0.95
    cliprange: float = 0.2
    cliprange_value: float = 0.2
    vf_coef: float = 0.1
    batch_size: int = 256
    forward_batch_size: int | None = None  # deprecated alias of mini_batch_size (TRL)
    mini_batch_size: int = 1
    gradient_accumulation_steps: int = 1
    world_size: int | None = None  # filled by the trainer: jax.process_count()
    ppo_epochs: int = 4
    max_grad_norm: float | None = None  # clips every optimizer update (see trainer doc)
    # PyTorch allocator hints: XLA owns device memory, so these have no effect (a warning
    # says so when they are set).
    optimize_cuda_cache: bool = False
    optimize_device_cache: bool = False
    early_stopping: bool = False
    target_kl: float = 1
    compare_steps: int = 1  # only used with push_to_hub_if_best_kwargs, which jaxrl rejects
    ratio_threshold: float = 10.0
    use_score_scaling: bool = False
    use_score_norm: bool = False  # only applies with use_score_scaling (as in TRL)
    score_clip: float | None = None
    whiten_rewards: bool = False  # TRL v0.7.3: whiten rewards (no mean shift) before GAE

    # ---- jaxrl extension (no TRL counterpart)
    # Pad rollouts to a multiple of this length so fewer sequence lengths are compiled; None
    # pads to the batch's longest sequence, as TRL (stats arrays then have TRL's shapes).
    pad_to_multiple_of: int | None = None

    # ---- jaxrl: PPOTrainer.train() loop (HF TrainingArguments semantics)
    output_dir: str = "outputs/ppo"  # metrics.jsonl, checkpoints/, final/
    max_steps: int = -1  # PPO steps; -1: TRL's total_ppo_epochs = ceil(steps / batch_size)
    logging_steps: float = 1  # log every n steps (a ratio < 1 of max_steps, as HF)
    logging_first_step: bool = False
    save_strategy: str = "steps"  # "no" or "steps"
    save_steps: float = 500  # checkpoint every n steps (a ratio < 1 of max_steps, as HF)
    save_total_limit: int | None = None  # keep the newest n checkpoints
    resume_from_checkpoint: str | bool | None = None  # True/"latest" or a step directory
    overwrite_output_dir: bool = False
    disable_tqdm: bool = False
    # ---- jaxrl: rollout generation of PPOTrainer.train()
    response_length: int = 16  # max_new_tokens per rollout (TRL examples: output_max_length)
    min_response_length: int = 0  # min_new_tokens (EOS masked before it)
    temperature: float = 1.0
    top_k: int = 0  # 0: off (TRL examples pass top_k=0.0)
    top_p: float = 1.0
    generation_engine: str = "continuous"  # jaxrl's sampler: "continuous" or "static"
    generation_num_slots: int | None = None  # continuous engine's decode slots (None: default)
    # The loop has no evaluation pass: these are fixed (TrainLoop reads them).
    eval_strategy: str = dataclasses.field(default="no", init=False)
    eval_steps: int | None = dataclasses.field(default=None, init=False)
    eval_on_start: bool = dataclasses.field(default=False, init=False)

    # ---- filled at runtime
    is_encoder_decoder: bool | None = None
    is_peft_model: bool | None = None
    backward_batch_size: int | None = None
    global_backward_batch_size: int | None = None
    global_batch_size: int | None = None

    def __post_init__(self) -> None:
        if self.forward_batch_size is not None:
            warnings.warn(
                "`forward_batch_size` is deprecated, use `mini_batch_size` instead; it now sets "
                "mini_batch_size (forward and PPO mini-batch size).",
                FutureWarning,
                stacklevel=3,
            )
            self.mini_batch_size = self.forward_batch_size
        for name in ("batch_size", "mini_batch_size", "gradient_accumulation_steps", "ppo_epochs"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}.")
        self.backward_batch_size = self.mini_batch_size * self.gradient_accumulation_steps
        if self.batch_size % self.backward_batch_size:
            raise ValueError(
                f"`batch_size` ({self.batch_size}) must be a multiple of `mini_batch_size * "
                f"gradient_accumulation_steps` ({self.backward_batch_size})."
            )
        if self.kl_penalty not in KL_PENALTIES:
            raise ValueError(
                f"kl_penalty={self.kl_penalty!r} is not supported; use one of {KL_PENALTIES}."
            )
        if self.log_with not in (None, "wandb"):
            raise ValueError(
                f"log_with={self.log_with!r} is not supported by jaxrl; use 'wandb' or None "
                "(stats are also returned by step() for any other logger)."
            )
        for name, why in (
            ("accelerator_kwargs", "there is no accelerate Accelerator in jaxrl"),
            ("project_kwargs", "there is no accelerate ProjectConfiguration in jaxrl"),
            (
                "push_to_hub_if_best_kwargs",
                "jaxrl does not push to the Hub during training; save with "
                "PPOTrainer.save_pretrained and push the directory",
            ),
        ):
            if getattr(self, name):
                raise ValueError(f"{name} must be empty: {why}.")
        if self.optimize_cuda_cache or self.optimize_device_cache:
            warnings.warn(
                "optimize_cuda_cache/optimize_device_cache have no effect in jaxrl: XLA frees "
                "device buffers itself.",
                stacklevel=3,
            )
        # The CLI gives "true" (what the SIGTERM message says to run): not a path.
        self.resume_from_checkpoint = parse_resume_from_checkpoint(self.resume_from_checkpoint)
        if self.pad_to_multiple_of is not None and self.pad_to_multiple_of < 1:
            raise ValueError(f"pad_to_multiple_of must be >= 1, got {self.pad_to_multiple_of}.")
        self.total_ppo_epochs = int(math.ceil(self.steps / self.batch_size))
        if self.save_strategy not in ("no", "steps"):
            raise ValueError(f"save_strategy must be 'no' or 'steps', got {self.save_strategy!r}.")
        for name in ("logging_steps", "save_steps"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}.")
        if self.response_length < 1 or not 0 <= self.min_response_length <= self.response_length:
            raise ValueError(
                "Need 1 <= response_length and 0 <= min_response_length <= response_length, got "
                f"{self.response_length} and {self.min_response_length}."
            )
        check_generation_engine(self.generation_engine, self.generation_num_slots)
        check_number(
            "temperature",
            self.temperature,
            minimum=0,
            exclusive_minimum=True,
            maximum=TEMPERATURE_MAX,
            why="Logits are divided by it: 1.0 (TRL's examples) samples the model as trained, "
            "and far above 1 sampling is uniform over the vocabulary.",
        )
        if not self.temperature > 0 or self.top_k < 0 or not 0 < self.top_p <= 1:
            raise ValueError(
                f"Need temperature > 0, top_k >= 0 (0 = off) and 0 < top_p <= 1; got "
                f"{self.temperature}, {self.top_k}, {self.top_p}."
            )

    @property
    def report_to(self) -> list[str]:
        """The loop's loggers, from TRL's `log_with` (metrics.jsonl is always written)."""
        return ["wandb"] if self.log_with == "wandb" else []

    @property
    def run_name(self) -> str:
        return self.exp_name

    def to_dict(self) -> dict[str, Any]:
        """All fields (nested dicts flattened with "/"), TRL's `to_dict`."""
        return _flatten(dict(self.__dict__))
