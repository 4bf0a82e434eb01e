"""`DDPOConfig`: TRL v0.7.2's DDPOConfig (every field, same defaults, same checks) plus the loop
fields jaxrl's `TrainLoop` reads.

TRL fields that configure PyTorch/Accelerate machinery with no JAX meaning are accepted at their
default and rejected with a message naming the jaxrl equivalent otherwise. TRL's checkpoint and
tracker fields are mapped onto the loop fields in `__post_init__`:
save_freq -> save_steps (one loop step is one DDPO epoch), num_checkpoint_limit ->
save_total_limit, log_with -> report_to, resume_from -> resume_from_checkpoint,
num_epochs -> num_train_epochs, logdir -> output_dir (when output_dir is not given).
"""

from __future__ import annotations

import dataclasses
import os
import sys
from typing import Any

import yaml

from jaxrl.config_checks import check_mesh_fields
from jaxrl.loop_options import parse_resume_from_checkpoint


def _exp_name() -> str:
    return os.path.basename(sys.argv[0])[: -len(".py")]


@dataclasses.dataclass
class DDPOConfig:
    # ---- TRL v0.7.2 fields (trl/trainer/ddpo_config.py), same defaults
    exp_name: str = dataclasses.field(default_factory=_exp_name)
    run_name: str | None = ""
    seed: int = 0
    log_with: str | None = None
    tracker_kwargs: dict = dataclasses.field(default_factory=dict)
    accelerator_kwargs: dict = dataclasses.field(default_factory=dict)
    project_kwargs: dict = dataclasses.field(default_factory=dict)
    tracker_project_name: str = "trl"
    logdir: str = "logs"
    num_epochs: int = 100
    save_freq: int = 1
    num_checkpoint_limit: int = 5
    mixed_precision: str | None = "fp16"
    allow_tf32: bool = True
    resume_from: str | None = ""
    sample_num_steps: int = 50
    sample_eta: float = 1.0
    sample_guidance_scale: float = 5.0
    sample_batch_size: int = 1
    sample_num_batches_per_epoch: int = 2
    train_batch_size: int = 1
    train_use_8bit_adam: bool = False
    train_learning_rate: float = 3e-4
    train_adam_beta1: float = 0.9
    train_adam_beta2: float = 0.999
    train_adam_weight_decay: float = 1e-4
    train_adam_epsilon: float = 1e-8
    train_gradient_accumulation_steps: int = 1
    train_max_grad_norm: float = 1.0
    train_num_inner_epochs: int = 1
    train_cfg: bool = True
    train_adv_clip_max: float = 5
    train_clip_range: float = 1e-4
    train_timestep_fraction: float = 1.0
    per_prompt_stat_tracking: bool = False
    per_prompt_stat_tracking_buffer_size: int = 16
    per_prompt_stat_tracking_min_count: int = 16
    async_reward_computation: bool = False
    max_workers: int = 2
    negative_prompts: str | None = ""

    # ---- jaxrl additions
    # TRL's DefaultDDPOStableDiffusionPipeline(pretrained_model, use_lora=...) arguments, for the
    # CLI and for a path `sd_pipeline` (empty pretrained_model: the package's tiny pipeline).
    pretrained_model: str = ""
    use_lora: bool = True
    lora_rank: int = 4  # diffusers LoRAAttnProcessor's default rank, what TRL trains
    # Compute dtype of the frozen weights (TRL: mixed_precision casts them); "float32"/"bfloat16".
    dtype: str = "float32"
    # The device mesh (jaxrl.parallel, as the other trainers' fields): prompts are split over
    # data x fsdp (the `batch` rule), UNet/VAE/text-encoder weights over fsdp (`embed`) and
    # tensor (`mlp`, `heads`); -1 takes the remaining devices.
    mesh_data: int = 1
    mesh_fsdp: int = -1
    mesh_tensor: int = 1
    # [[logical_name, mesh_axis | [mesh_axes] | null], ...] overriding jaxrl.parallel's rules.
    logical_axis_rules: list | None = None
    # TrainLoop fields (HF TrainingArguments names). Derived from the TRL fields when left None.
    output_dir: str | None = None
    report_to: Any = None
    # Progress as every trainer shows it (HF's default; TRL's DDPO shows tqdm bars on the main
    # process): a live bar on a terminal, one line per log otherwise.
    disable_tqdm: bool = False
    logging_steps: float = 1
    logging_first_step: bool = False
    logging_strategy: str = "steps"
    eval_strategy: str = "no"
    eval_steps: float | None = None
    eval_on_start: bool = False
    save_strategy: str | None = None
    save_steps: float | None = None
    save_total_limit: int | None = None
    resume_from_checkpoint: Any = None
    max_steps: int = -1
    num_train_epochs: float | None = None

    def __post_init__(self):
        self._reject_torch_only()
        if self.log_with not in (None, "wandb", "tensorboard"):
            raise ValueError(
                f"log_with={self.log_with!r}: use None, 'wandb' or 'tensorboard' (TRL's choices)."
            )
        if self.log_with == "tensorboard":
            raise ValueError(
                "log_with='tensorboard' is not supported by jaxrl; metrics are always written to "
                "output_dir/metrics.jsonl, and log_with='wandb' also logs them (and images) to "
                "Weights & Biases."
            )
        if self.tracker_kwargs and (
            self.log_with != "wandb" or set(self.tracker_kwargs) - {"wandb"}
        ):
            raise ValueError(
                f"tracker_kwargs={self.tracker_kwargs!r}: as in TRL, a dict of init arguments per "
                "tracker; jaxrl's only tracker is wandb, so use log_with='wandb' and "
                "tracker_kwargs={'wandb': {...wandb.init arguments}}."
            )
        if self.dtype not in ("float32", "bfloat16"):
            raise ValueError(f"dtype={self.dtype!r}: use 'float32' or 'bfloat16'.")
        check_mesh_fields(self)
        for name in (
            "sample_num_steps",
            "sample_batch_size",
            "sample_num_batches_per_epoch",
            "train_batch_size",
            "train_gradient_accumulation_steps",
            "train_num_inner_epochs",
            "max_workers",
            "save_freq",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1.")
        if not 0.0 < self.train_timestep_fraction <= 1.0:
            raise ValueError(
                f"train_timestep_fraction={self.train_timestep_fraction} must be in (0, 1]."
            )
        if self.num_train_timesteps < 1:
            raise ValueError(
                f"int(sample_num_steps * train_timestep_fraction) = {self.num_train_timesteps}: "
                "no timestep would be trained."
            )
        # TRL `_config_check` (num_processes is 1: jaxrl is single-controller; the batch is
        # sharded over devices inside one program).
        if self.sample_batch_size < self.train_batch_size:
            raise ValueError(
                f"Sample batch size ({self.sample_batch_size}) must be greater than or equal to "
                f"the train batch size ({self.train_batch_size})"
            )
        if self.sample_batch_size % self.train_batch_size != 0:
            raise ValueError(
                f"Sample batch size ({self.sample_batch_size}) must be divisible by the train "
                f"batch size ({self.train_batch_size})"
            )
        per_update = self.train_batch_size * self.train_gradient_accumulation_steps
        if (self.sample_batch_size * self.sample_num_batches_per_epoch) % per_update != 0:
            raise ValueError(
                f"Number of samples per epoch ({self.sample_batch_size} * "
                f"{self.sample_num_batches_per_epoch}) must be divisible by train_batch_size * "
                f"train_gradient_accumulation_steps ({per_update})"
            )
        # TRL fields -> loop fields.
        if self.output_dir is None:
            self.output_dir = self.logdir
        if self.report_to is None:
            self.report_to = [self.log_with] if self.log_with else []
        if self.save_strategy is None:
            self.save_strategy = "steps"
        if self.save_steps is None:
            self.save_steps = self.save_freq
        if self.save_total_limit is None:
            self.save_total_limit = self.num_checkpoint_limit
        if self.resume_from_checkpoint is None:
            self.resume_from_checkpoint = self.resume_from
        # The CLI gives "true" (what the SIGTERM message says to run): not a path.
        self.resume_from_checkpoint = parse_resume_from_checkpoint(self.resume_from_checkpoint)
        if self.num_train_epochs is None:
            self.num_train_epochs = self.num_epochs

    def _reject_torch_only(self) -> None:
        rejected = {
            "mixed_precision": (
                ("fp16", "no", None),
                "jaxrl keeps trainable (LoRA) params in f32 and sets the frozen weights' "
                "compute dtype with `dtype` ('float32' or 'bfloat16'); fp16 autocast is not used",
            ),
            "allow_tf32": ((True,), "matmul precision is JAX's `jax_default_matmul_precision`"),
            "train_use_8bit_adam": (
                (False,),
                "bitsandbytes AdamW8bit has no JAX build; jaxrl uses optax.adamw",
            ),
            "accelerator_kwargs": (
                ({},),
                "there is no Accelerator; devices are used through jaxrl.parallel's mesh",
            ),
            "project_kwargs": (
                ({},),
                "checkpoints go to output_dir/checkpoints (save_freq, num_checkpoint_limit)",
            ),
        }
        for name, (allowed, instead) in rejected.items():
            value = getattr(self, name)
            if value not in allowed:
                raise ValueError(
                    f"DDPOConfig.{name}={value!r} has no JAX meaning and is not supported: "
                    f"{instead}."
                )

    @property
    def num_train_timesteps(self) -> int:
        """Timesteps trained per sample, TRL: int(sample_num_steps * train_timestep_fraction)."""
        return int(self.sample_num_steps * self.train_timestep_fraction)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


# Defaults of `python -m jaxrl.train --algo ddpo` without --pretrained_model: the tiny random
# pipeline, small enough that the compressibility reward rises within minutes on a CPU. Full
# fine-tuning with a wide clip range: the tiny random UNet's rank-4 attention adapters and TRL's
# clip range 1e-4 move the policy too little to show a trend in a few epochs. One optimizer step
# per epoch over all 32 samples (4 batches of 8, accumulated): the JPEG reward is noisy, and
# steps from 4 samples each followed the noise (the reward did not rise in 20 epochs).
TINY_CLI_DEFAULTS: dict[str, Any] = dict(
    num_epochs=8,
    use_lora=False,
    train_clip_range=0.1,
    sample_num_steps=4,
    sample_batch_size=16,
    sample_num_batches_per_epoch=2,
    train_batch_size=8,
    train_gradient_accumulation_steps=4,
    train_learning_rate=3e-3,
    mixed_precision="no",
    # outputs/<algo>, as every embedded job (the recipes' output_dir); output_dir follows TRL's
    # logdir unless given, so `--logdir DIR` or `--output_dir DIR` moves it.
    logdir="outputs/ddpo",
)
CLI_REWARDS = ("jpeg_compressibility", "jpeg_incompressibility")


def _coerce(text: str, default: Any) -> Any:
    if isinstance(default, bool):
        if text.lower() not in ("true", "false", "1", "0"):
            raise ValueError(f"expected true/false, got {text!r}")
        return text.lower() in ("true", "1")
    if isinstance(default, int):
        return int(text)
    if isinstance(default, float):
        return float(text)
    if text.lower() in ("none", "null"):
        return None
    return text


def parse_ddpo_cli(argv: list[str]) -> tuple[DDPOConfig, str]:
    """`--field value` / `--field=value` pairs -> (DDPOConfig, reward name). `--reward` picks
    one of CLI_REWARDS (default jpeg_compressibility)."""
    values: dict[str, str] = {}
    i = 0
    while i < len(argv):
        arg = argv[i]
        if not arg.startswith("--"):
            raise ValueError(f"unexpected argument {arg!r}; use --field value.")
        if "=" in arg:
            k, v = arg[2:].split("=", 1)
            i += 1
        else:
            if i + 1 >= len(argv):
                raise ValueError(f"{arg} needs a value.")
            k, v = arg[2:], argv[i + 1]
            i += 2
        values[k] = v
    reward = values.pop("reward", "jpeg_compressibility")
    if reward not in CLI_REWARDS:
        raise ValueError(f"--reward {reward!r} is not one of {CLI_REWARDS}.")
    fields = {f.name: f for f in dataclasses.fields(DDPOConfig)}
    unknown = sorted(set(values) - set(fields))
    if unknown:
        raise ValueError(f"unknown DDPOConfig field(s): {', '.join(unknown)}.")
    base = {} if values.get("pretrained_model") else dict(TINY_CLI_DEFAULTS)
    kwargs: dict[str, Any] = dict(base)
    for k, v in values.items():
        f = fields[k]
        default = f.default if f.default is not dataclasses.MISSING else None
        # A list field takes YAML/JSON, e.g. --logical_axis_rules '[["embed", null]]'.
        try:
            kwargs[k] = (
                yaml.safe_load(v) if k == "logical_axis_rules" else _coerce(v, base.get(k, default))
            )
        except (ValueError, yaml.YAMLError) as e:
            kind = type(base.get(k, default)).__name__
            raise ValueError(f"--{k} expects {kind}; got {v!r} ({e}).") from None
    return DDPOConfig(**kwargs), reward
