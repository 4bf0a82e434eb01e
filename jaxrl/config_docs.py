"""What the config fields mean, for people: docs/config_fields.md (every field of TRL's configs
and how jaxrl treats it) and `python -m jaxrl.train --help` (`usage`: each algorithm's flags in
groups, one line each, refused ones marked).

`python -m jaxrl.config_docs > docs/config_fields.md` regenerates the page and
`python -m jaxrl.config_docs --help-table` the descriptions `--help` prints
(`assets/flag_help.json`), both from the installed `transformers` and `trl` and jaxrl's config
classes; tests fail when they, the classes and the installed TRL disagree. Only those generators
import trl; `usage` reads the committed table.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

from jaxrl import scripting
from jaxrl.config import TrainingConfig
from jaxrl.trainers.registry import ALGORITHMS

# Fields jaxrl accepts and translates into its own terms (anything else it has is implemented
# as TRL documents it, or listed in config_fields.py as rejected when set).
MAPPED = {
    "optim": "HF names map to optax: `adamw_torch*`/`adamw` -> adamw, `sgd`, `adagrad`, "
    "`rmsprop`, `adafactor`, `lion`/`lion_32bit`; 8-bit/paged optimizers are rejected",
    "bf16": "torch autocast: bf16 matmuls, f32 residual stream and norms, params in `param_dtype`",
    "fp16": "compute dtype float16 with a dynamic loss scale (GPU only)",
    "gradient_checkpointing": "`jax.checkpoint` per layer; `remat_policy` picks what is saved",
    "activation_checkpointing": "HF v5 name of `gradient_checkpointing` (wins when set)",
    "gradient_checkpointing_kwargs": "only `use_reentrant` (no effect: both torch variants give "
    "the same gradients as jax.checkpoint)",
    "activation_checkpointing_kwargs": "HF v5 name of `gradient_checkpointing_kwargs`",
    "model_init_kwargs": "`dtype`/`torch_dtype` -> `param_dtype`; `attn_implementation` "
    "(eager/sdpa/flash_attention_*) -> XLA attention; `revision` only main; "
    "`trust_remote_code` only false",
    "average_tokens_across_devices": "always true: the loss is a mean over the global batch",
    "use_cpu": "the mesh is built from `jax.devices('cpu')`",
    "report_to": "`wandb`, `tensorboard` (tensorboardX), `none`/`all`; metrics.jsonl is always "
    "written",
    "do_train": "accepted; HF's Trainer does not read it either",
    "do_eval": "accepted; HF's Trainer does not read it either",
    "do_predict": "accepted; HF's Trainer does not read it either",
    "trust_remote_code": "only false: jaxrl runs its own model code",
    "pad_to_multiple_of": "rounds padded row lengths up (SFT/reward/DPO/KTO: the static length and "
    "its `length_buckets`; GRPO/RLOO: the prompt buckets); 'auto' (TRL's default) is None, as "
    "TRL off AWS Neuron",
    "push_to_hub": "`trainer.push_to_hub()` uploads the final model (TRL scripts); each save "
    "uploads as `hub_strategy` says",
    "hub_strategy": "HF's four; uploads are synchronous (HF's run in the background) and the "
    "checkpoint folders hold orbax checkpoints",
    "remove_unused_columns": "SFT/reward/DPO: always true (each example is tokenized into the "
    "model's inputs and no custom collator exists, so False is rejected); GRPO/RLOO: False passes "
    "the extra columns to reward functions",
    "truncation_mode": "SFT: only keep_start; DPO: which end of the prompt `max_prompt_length` "
    "keeps (keep_end needs max_prompt_length)",
    "loss_type": "SFT: only nll; DPO, KTO and GRPO: every TRL loss type",
    "log_multimodal": "image prompts: the completion logs hold the prompts without their "
    "images (TRL's parquet files); with wandb completion tables it is refused (set False)",
    "eval_accumulation_steps": "accepted; each eval batch's predictions reach the host as soon "
    "as it is done (HF's value 1), so none accumulate on the accelerator for any N, and HF's "
    "results do not depend on N either",
    "dtype": "-> `param_dtype` (via model_init_kwargs)",
    "attn_implementation": "eager/sdpa/flash_attention_* -> XLA attention",
    "model_revision": "only main",
}

# Notes on implemented fields whose scope or details differ somewhere from TRL's.
NOTES = {
    "neftune_noise_alpha": "SFT/reward/DPO: the policy's training forwards only (never the "
    "reference), magnitude from TRL's per-device padded length; GRPO/RLOO reject it",
    "disable_dropout": "the model config's dropout (GPT-2, Phi-3, any attention_dropout) in the "
    "policy's training forwards only: never references, evaluation, generation or GRPO/RLOO's "
    "old-log-prob pass (TRL runs the last two in train mode)",
    "eval_delay": "as HF, all trainers",
    "data_seed": "SFT/reward/DPO training order; GRPO/RLOO reject it (TRL's sampler uses `seed`)",
    "train_sampling_strategy": "random, sequential, group_by_length (HF's megabatches; eval "
    "keeps dataset order); batch_rebalance rejected (one row length per step); GRPO/RLOO reject "
    "it",
    "length_column_name": "read while the prepared rows are the dataset's examples one to one; "
    "else input_ids lengths (SFT) or an error naming the fix (reward/DPO, as HF)",
    "include_for_metrics": "SFT/reward/DPO: `EvalPrediction.inputs` (input ids, rows as the "
    "predictions'; reward `[N, 2, T]`) and `.losses` (each batch's loss once per example, as HF); "
    "GRPO/RLOO reject it (no compute_metrics, as TRL)",
    "batch_eval_metrics": "SFT/reward/DPO, HF's calls (`compute_result=True` on the last batch, "
    "whose return value is the metrics); each batch's `inputs` are its input ids like the "
    "concatenated ones (HF hands the collated batch dict); GRPO/RLOO reject it",
    "include_num_input_tokens_seen": "SFT/reward/DPO, counted on the batches as TRL collates "
    "them; GRPO/RLOO reject it (their `num_tokens` is TRL's count)",
}

# The algorithms whose config the installed TRL still has (PPO and DDPO follow TRL v0.7.2's).
TRL_ALGOS = ("sft", "reward", "dpo", "kto", "grpo", "rloo", "distill")

SECTIONS = (
    ("TrainingArguments (transformers)", "TrainingArguments", TrainingConfig),
    *(
        (f"{cls.__name__} (trl)", cls.__name__, cls)
        for cls in (ALGORITHMS[algo].config_class for algo in TRL_ALGOS)
    ),
    ("ScriptArguments (trl)", "ScriptArguments", scripting.ScriptArguments),
    ("ModelConfig (trl)", "ModelConfig", scripting.ModelConfig),
)


def reference_classes() -> dict[str, type]:
    import transformers
    import trl

    out = {"TrainingArguments": transformers.TrainingArguments}
    for _, name, _ in SECTIONS[1:]:
        out[name] = getattr(trl, name)
    return out


def status(cls: type, name: str) -> tuple[str, str]:
    """(status, note) of TRL field `name` on jaxrl class `cls`."""
    foreign = {f.name: f for f in getattr(cls, "_all_foreign_fields", lambda: ())()}
    if name in foreign:
        return "rejected when set", foreign[name].reason
    unsupported = getattr(cls, "unsupported_fields", dict)()
    if name in unsupported:
        return "rejected when set", unsupported[name][1]
    if name in ("metric_for_best_model", "greater_is_better"):
        return "implemented", "validated and defaulted as HF; best_metric tracked at each eval"
    if name in MAPPED:
        return "mapped", MAPPED[name]
    if name in {f.name for f in dataclasses.fields(cls)}:
        return "implemented", NOTES.get(name, "")
    return "missing", ""


def render() -> str:
    refs = reference_classes()
    hf_names = {f.name for f in dataclasses.fields(refs["TrainingArguments"])}
    lines = [
        "# TRL / HF config fields in jaxrl",
        "",
        "Generated by `python -m jaxrl.config_docs` from the installed transformers and trl; a test "
        "keeps it in sync. *implemented*: same meaning as in TRL; *mapped*: accepted and "
        "translated to its JAX counterpart; *rejected when set*: accepted with TRL's default so "
        "scripts parse, an error naming the alternative otherwise.",
    ]
    for title, ref_name, cls in SECTIONS:
        ref = refs[ref_name]
        names = [f.name for f in dataclasses.fields(ref)]
        if ref_name.endswith("Config") and ref_name != "ModelConfig":
            names = [n for n in names if n not in hf_names]  # the shared ones are listed above
        lines += ["", f"## {title}", "", "| field | jaxrl | note |", "| --- | --- | --- |"]
        for name in names:
            state, note = status(cls, name)
            lines.append(f"| `{name}` | {state} | {note} |")
        ours = [f.name for f in dataclasses.fields(cls) if f.init]
        if cls is TrainingConfig:
            trl_names = {f.name for r in refs.values() for f in dataclasses.fields(r)}
            extra = [n for n in ours if n not in trl_names]
        else:
            shared = {f.name for f in dataclasses.fields(TrainingConfig)}
            extra = [n for n in ours if n not in set(names) | hf_names | shared]
        if extra:
            lines += ["", "jaxrl-only: " + ", ".join(f"`{n}`" for n in extra) + "."]
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------- `python -m jaxrl.train --help`

HELP_FILE = Path(__file__).parent / "assets" / "flag_help.json"
REFUSED = "[refused when set]"
# Fields of TRL v0.7.2's PPO / DDPO configs that are refused unless left at TRL's default (their
# configs check them in __post_init__; a test sets each and expects the refusal).
LEGACY_REFUSED = {
    "PPOConfig": {
        "accelerator_kwargs": "there is no accelerate Accelerator in jaxrl",
        "project_kwargs": "there is no accelerate ProjectConfiguration in jaxrl",
        "push_to_hub_if_best_kwargs": "jaxrl does not push to the Hub during training",
    },
    "DDPOConfig": {
        "mixed_precision": "fp16 autocast is not used; set the frozen weights' dtype with `dtype`",
        "allow_tf32": "matmul precision is JAX's `jax_default_matmul_precision`",
        "train_use_8bit_adam": "bitsandbytes AdamW8bit has no JAX build; jaxrl uses optax.adamw",
        "accelerator_kwargs": "there is no accelerate Accelerator in jaxrl",
        "project_kwargs": "checkpoints go to output_dir/checkpoints",
    },
    # TRL ModelConfig's (the CLI's script flags): `LoraConfig.from_trl` refuses it.
    "ScriptArguments": {"use_dora": "DoRA is not implemented; use plain LoRA"},
}
# The groups of `--help`, in order; the algorithm's own fields are the third.
MODEL_AND_DATA = "Model and data"
TRAINING = "Training"
LOGGING = "Logging, evaluation and saving"
COMPAT = f"Accepted for TRL compatibility only {REFUSED}"
_MODEL_DATA_NAMES = {
    "model_init_kwargs", "max_length", "max_prompt_length", "max_completion_length",
    "max_seq_length", "packing", "packing_strategy", "padding_free", "pad_to_multiple_of",
    "truncation_mode", "chat_template_path", "eos_token", "pad_token", "padding_value",
    "label_pad_token_id", "completion_only_loss", "assistant_only_loss", "remove_unused_columns",
    "trust_remote_code", "model_revision", "dtype", "attn_implementation", "pretrained_model",
    "pretrained_revision", "query_dataset", "model_name", "reward_model", "param_dtype",
}  # fmt: skip
_MODEL_DATA_PREFIXES = ("dataset_", "model_", "tokenizer_", "lora_", "use_peft", "use_rslora",
                        "use_dora", "load_in_", "bnb_", "use_bnb", "reward_model", "reward_funcs")  # fmt: skip
_LOGGING_PREFIXES = (
    "logging_", "log_", "eval_", "save_", "hub_", "push_to_hub", "report_to", "run_name",
    "output_dir", "overwrite_output_dir", "resume_from", "disable_tqdm", "load_best_model",
    "metric_for_best", "greater_is_better", "per_device_eval", "prediction_loss_only",
    "include_for_metrics", "include_inputs_for_metrics", "batch_eval_metrics", "tracker_",
    "logdir", "exp_name", "num_checkpoint_limit", "generate_during_eval", "do_eval",
    "do_predict", "num_completions_to_print", "wandb_", "task_name", "restore_callback",
)  # fmt: skip


def refused_reason(cls: type, name: str) -> str | None:
    """Why field `name` of config class `cls` is refused when set, or None if it is not."""
    foreign = {f.name: f.reason for f in getattr(cls, "_all_foreign_fields", lambda: ())()}
    if name in foreign:
        return foreign[name]
    unsupported = getattr(cls, "unsupported_fields", dict)()
    if name in unsupported:
        return unsupported[name][1]
    for klass in cls.__mro__:
        if name in LEGACY_REFUSED.get(klass.__name__, {}):
            return LEGACY_REFUSED[klass.__name__][name]
    return None


def _refused(algo: str, name: str) -> str | None:
    for cls in flag_classes(algo):
        if name in _field_names(cls) and refused_reason(cls, name) is not None:
            return refused_reason(cls, name)
    return None


def flag_classes(algo: str) -> list[type]:
    """The classes whose fields are `--algo ALGO`'s flags (the script's first)."""
    spec = ALGORITHMS[algo]
    return [c for c in (spec.script_class, spec.config_class) if c is not None]


def flag_group(algo: str, name: str) -> str:
    """The `--help` group of flag `name` of `--algo ALGO`."""
    spec = ALGORITHMS[algo]
    if _refused(algo, name) is not None:
        return COMPAT
    shared = {f.name for f in dataclasses.fields(TrainingConfig)}
    if spec.script_class is not None and name in _field_names(spec.script_class):
        return MODEL_AND_DATA
    if name in _MODEL_DATA_NAMES or name.startswith(_MODEL_DATA_PREFIXES):
        return MODEL_AND_DATA
    if name.startswith(_LOGGING_PREFIXES):
        return LOGGING
    if name in shared or algo in ("ppo", "ddpo") and name in _LEGACY_TRAINING:
        return TRAINING
    return _algo_group(algo)


# PPO / DDPO (TRL v0.7.2, no TrainingArguments base): their optimiser and batch fields.
_LEGACY_TRAINING = {
    "steps", "learning_rate", "batch_size", "mini_batch_size", "forward_batch_size",
    "gradient_accumulation_steps", "max_grad_norm", "seed", "num_epochs", "max_steps",
    "train_batch_size", "train_learning_rate", "train_adam_beta1", "train_adam_beta2",
    "train_adam_epsilon", "train_adam_weight_decay", "train_max_grad_norm",
    "train_gradient_accumulation_steps", "mesh_data", "mesh_fsdp", "mesh_tensor",
    "logical_axis_rules", "num_train_epochs", "world_size", "optimize_cuda_cache",
    "optimize_device_cache", "use_lora", "lora_rank", "dtype", "sample_batch_size",
}  # fmt: skip


def _algo_group(algo: str) -> str:
    return f"{ALGORITHMS[algo].config_class.__name__} (the algorithm's own)"


def _field_names(cls: type) -> set[str]:
    return {f.name for f in dataclasses.fields(cls) if f.init}


def _flags(algo: str) -> list[dataclasses.Field]:
    seen: set[str] = set()
    out = []
    for cls in flag_classes(algo):
        for f in dataclasses.fields(cls):
            if f.init and f.name not in seen and f.name != "algo":
                seen.add(f.name)
                out.append(f)
    return out


def _default(f: dataclasses.Field) -> str:
    if f.default is not dataclasses.MISSING:
        return repr(f.default)
    if f.default_factory is not dataclasses.MISSING:
        return repr(f.default_factory())
    return "(required)"


def load_help() -> dict[str, dict[str, str]]:
    """The committed one-line descriptions: {config class name: {field: description}}."""
    return json.loads(HELP_FILE.read_text())


def describe(table: dict[str, dict[str, str]], algo: str, name: str) -> str:
    """Flag `name`'s description for `--algo ALGO`: the algorithm's class first, then the
    script's and TrainingConfig's (their fields are shared by every algorithm)."""
    for cls in (*reversed(flag_classes(algo)), TrainingConfig):
        text = table.get(cls.__name__, {}).get(name)
        if text:
            return text
    return ""


def usage(algo: str, synopsis: str = "") -> str:
    """`--help` of `python -m jaxrl.train --algo ALGO`: the flags in groups (model and data,
    training, the algorithm's own, logging and saving, TRL-compatibility-only last), each with
    its type, default and one-line description; refused ones say so."""
    table = load_help()
    order = [MODEL_AND_DATA, TRAINING, _algo_group(algo), LOGGING, COMPAT]
    groups: dict[str, list[str]] = {g: [] for g in order}
    # The model and the data before the PEFT / quantization flags (TRL's ModelConfig order).
    peft = ("lora_", "use_peft", "use_rslora", "use_dora", "load_in_", "bnb_", "use_bnb")
    for f in sorted(_flags(algo), key=lambda f: f.name.startswith(peft)):
        group = flag_group(algo, f.name)
        text = describe(table, algo, f.name)
        reason = _refused(algo, f.name)
        if reason is not None:
            text = f"{REFUSED} {reason}"
        kind = getattr(f.type, "__name__", None) or str(f.type)
        groups[group].append(f"  --{f.name} ({kind}, default {_default(f)})\n      {text}")
    lines = [synopsis.strip(), ""] if synopsis else []
    lines.append(f"Flags of --algo {algo} (--flag VALUE, --flag=VALUE; YAML keys alike):")
    for group in order:
        if groups[group]:
            lines += ["", f"{group}:", *groups[group]]
    return "\n".join(lines)


# ------------------------------------------------ the description table (development tool)

# Descriptions of fields TRL's installed configs do not have (jaxrl's own, TRL v0.7.2's PPO and
# DDPO fields) or where ours differ from TRL's help text. Everything else: TRL's / HF's own words.
OWN_HELP = {
    # script-level flags of `python -m jaxrl.train`
    "algo": "The algorithm: sft, reward, dpo, kto, grpo, rloo, distill, ppo or ddpo.",
    "config": "A YAML file of field: value pairs; flags on the command line override it.",
    "tokenizer_name_or_path": "The tokenizer's directory or Hub id (default: the model's).",
    "reward_model_name_or_path": "A reward model directory, scored before the reward functions.",
    "reward_funcs": "Reward functions: names from jaxrl.rewards or dotted import paths.",
    "tools": "Tool functions as module:function import paths (repeatable; TRL's tools=).",
    "environment_factory": "An environment class as a module:Class import path (TRL's "
    "environment_factory=): one instance per rollout, its public methods the tools.",
    "teacher_model_quantization": "int8: the teacher's weights stored in int8 (jaxrl).",
    # jaxrl's own TrainingConfig fields
    "mesh_data": "Devices on the data-parallel mesh axis (-1: the remaining devices).",
    "mesh_fsdp": "Devices the params, grads and optimizer state are sharded over (-1: the rest).",
    "mesh_tensor": "Devices each layer's weights are split over (tensor parallelism).",
    "logical_axis_rules": "[[logical axis, mesh axis or null], ...] overriding the sharding rules.",
    "scan_layers": "Run the layer stack as one scanned block (default: not on GPU, else yes).",
    "remat_policy": "What jax.checkpoint keeps per layer (default: full with "
    "gradient_checkpointing, else none).",
    "logprob_chunk_size": "Tokens per chunk of the log-prob computation (never full-vocab "
    "logits for the whole batch).",
    "param_dtype": "The dtype the params are stored and updated in (float32, bfloat16).",
    "residual_dtype": "The dtype of the residual stream (default: the wider of param and "
    "compute dtype).",
    "overwrite_output_dir": "Delete a previous run's checkpoints, metrics.jsonl and final/ in "
    "output_dir.",
    "warmup_ratio": "Ratio of total training steps used for a linear warmup (HF v4; set only "
    "one of it and warmup_steps).",
    "length_buckets": "Row lengths a step may be padded to (fewer compiled shapes); None: "
    "max_length only.",
    "max_seq_length": "TRL's former name of max_length.",
    "generation_engine": "The sampler's engine: continuous (decode slots refilled as rows "
    "finish) or static (the batch decoded in lockstep); both give the same completions.",
    "generation_num_slots": "The continuous engine's decode slots (KV-cache rows); None: one per "
    "row up to 64 rows on CPU, then a quarter of them; on accelerators what memory holds.",
    "DPOConfig.max_prompt_length": "Maximum prompt length in tokens (which end is kept: "
    "truncation_mode).",
    "DPOConfig.prefix_sharing": "Run chosen and rejected completions after one shared prompt "
    "(one prompt forward per pair).",
    "DPOConfig.ref_model_quantization": "Store the frozen reference as int8 or nf4 (less memory).",
    "DPOConfig.reference_free": "Compare with a uniform reference (no reference model).",
    "DPOConfig.generate_during_eval": "Log sampled completions of the policy and the reference "
    "at evaluation.",
    "label_pad_token_id": "Label id of padding, ignored by the loss.",
    "padding_value": "Pad token id of the batches (default: the tokenizer's).",
    # TRL v0.7.2 PPOConfig
    "PPOConfig.exp_name": "The experiment's name (tracking only).",
    "PPOConfig.seed": "Seed of the trainer's random numbers.",
    "PPOConfig.log_with": "'wandb' or None (metrics.jsonl is always written).",
    "PPOConfig.task_name": "Name of the task (tracking only).",
    "PPOConfig.model_name": "Name of the model (tracking only).",
    "PPOConfig.query_dataset": "Name of the dataset (tracking only).",
    "PPOConfig.reward_model": "The reward model (tracking; the CLI: a reward model directory).",
    "PPOConfig.remove_unused_columns": "prepare_dataloader drops the columns the model does "
    "not use.",
    "PPOConfig.tracker_kwargs": "Keyword arguments of the tracker ({'wandb': {...}}).",
    "PPOConfig.tracker_project_name": "The wandb project.",
    "PPOConfig.steps": "Number of training samples (PPO steps: steps / batch_size).",
    "PPOConfig.learning_rate": "Adam's learning rate (no weight decay).",
    "adap_kl_ctrl": "Use the adaptive KL controller (else a fixed KL coefficient).",
    "init_kl_coef": "Initial KL penalty coefficient (adaptive or fixed).",
    "kl_penalty": "KL estimator of the penalty: kl, abs, mse or full.",
    "target": "Target KL value of the adaptive controller.",
    "horizon": "Horizon of the adaptive KL controller.",
    "gamma": "Discount factor of the advantages (GAE).",
    "lam": "Lambda of generalised advantage estimation.",
    "cliprange": "Clip range of the policy ratio in the PPO loss.",
    "cliprange_value": "Clip range of the value function's loss.",
    "vf_coef": "Weight of the value function's loss.",
    "PPOConfig.batch_size": "Samples per optimisation step (PPO step).",
    "forward_batch_size": "Deprecated alias of mini_batch_size.",
    "mini_batch_size": "Samples per mini-batch of each PPO epoch.",
    "PPOConfig.gradient_accumulation_steps": "Mini-batches accumulated per optimiser update.",
    "world_size": "Filled by the trainer (the number of processes); leave unset.",
    "ppo_epochs": "Optimisation epochs over each batch.",
    "PPOConfig.max_grad_norm": "Clip gradients to this global norm (None: no clipping).",
    "optimize_cuda_cache": "A PyTorch allocator hint; no effect (XLA owns device memory).",
    "optimize_device_cache": "A PyTorch allocator hint; no effect (XLA owns device memory).",
    "early_stopping": "Stop a PPO step's epochs early once the KL exceeds target_kl.",
    "target_kl": "KL at which early_stopping stops the step's epochs.",
    "compare_steps": "Steps between comparisons of push_to_hub_if_best_kwargs (refused).",
    "ratio_threshold": "Skip mini-batches whose mean policy ratio exceeds this.",
    "use_score_scaling": "Scale the scores by their running standard deviation.",
    "use_score_norm": "With use_score_scaling: also subtract their running mean.",
    "score_clip": "Clip the scores to [-score_clip, score_clip].",
    "whiten_rewards": "Whiten the rewards (no mean shift) before computing advantages.",
    "PPOConfig.pad_to_multiple_of": "Pad rollouts to a multiple of this length (fewer "
    "compiled shapes).",
    "PPOConfig.max_steps": "PPO steps to run (-1: steps / batch_size).",
    "response_length": "Maximum new tokens per rollout.",
    "min_response_length": "Minimum new tokens per rollout (EOS masked before it).",
    "PPOConfig.top_k": "Top-k filtering of the rollouts' sampling (0: off).",
    "is_encoder_decoder": "Filled by the trainer; leave unset.",
    "is_peft_model": "Filled by the trainer; leave unset.",
    "backward_batch_size": "Filled by the trainer (mini_batch_size * "
    "gradient_accumulation_steps); leave unset.",
    "global_backward_batch_size": "Filled by the trainer; leave unset.",
    "global_batch_size": "Filled by the trainer; leave unset.",
    # TRL v0.7.2 DDPOConfig
    "DDPOConfig.exp_name": "The experiment's name (tracking only).",
    "DDPOConfig.seed": "Seed of the trainer's random numbers.",
    "DDPOConfig.log_with": "'wandb' or None (metrics.jsonl is always written).",
    "DDPOConfig.tracker_kwargs": "Keyword arguments of the tracker ({'wandb': {...}}).",
    "DDPOConfig.tracker_project_name": "The wandb project.",
    "logdir": "Top-level logging directory of TRL's checkpoints (see output_dir).",
    "num_epochs": "Training epochs (each samples, then trains).",
    "save_freq": "Epochs between checkpoints.",
    "num_checkpoint_limit": "Checkpoints kept (the oldest are deleted).",
    "resume_from": "A checkpoint to resume from.",
    "sample_num_steps": "Denoising steps when sampling.",
    "sample_eta": "DDIM eta when sampling.",
    "sample_guidance_scale": "Classifier-free guidance scale when sampling.",
    "sample_batch_size": "Images per sampling batch (per device).",
    "sample_num_batches_per_epoch": "Sampling batches per epoch.",
    "train_batch_size": "Samples per training batch (per device).",
    "train_learning_rate": "AdamW's learning rate.",
    "train_adam_beta1": "AdamW's beta1.",
    "train_adam_beta2": "AdamW's beta2.",
    "train_adam_weight_decay": "AdamW's weight decay.",
    "train_adam_epsilon": "AdamW's epsilon.",
    "train_gradient_accumulation_steps": "Batches accumulated per optimiser update.",
    "train_max_grad_norm": "Clip gradients to this global norm.",
    "train_num_inner_epochs": "Training passes over each epoch's samples.",
    "train_cfg": "Train with classifier-free guidance.",
    "train_adv_clip_max": "Clip advantages to [-train_adv_clip_max, train_adv_clip_max].",
    "train_clip_range": "Clip range of the PPO ratio.",
    "train_timestep_fraction": "Fraction of the denoising timesteps trained on.",
    "per_prompt_stat_tracking": "Normalise rewards per prompt (running mean and std).",
    "per_prompt_stat_tracking_buffer_size": "Rewards kept per prompt for its statistics.",
    "per_prompt_stat_tracking_min_count": "Rewards a prompt needs before its own statistics "
    "are used.",
    "async_reward_computation": "Compute rewards in a thread pool while sampling.",
    "max_workers": "Threads of async_reward_computation.",
    "negative_prompts": "Comma-separated negative prompts for classifier-free guidance.",
    "pretrained_model": "The Stable Diffusion pipeline's directory (empty: the package's tiny "
    "one).",
    "use_lora": "Train LoRA adapters on the UNet (else the full UNet).",
    "lora_rank": "Rank of the UNet's LoRA adapters.",
    "DDPOConfig.dtype": "Compute dtype of the frozen weights (float32 or bfloat16).",
}


def _first_sentence(text: str, limit: int = 140) -> str:
    text = " ".join(text.split())
    for end in (". ", ".\n"):
        if end in text:
            text = text[: text.index(end) + 1]
            break
    if len(text) > limit:
        text = text[: text.rfind(" ", 0, limit - 1)] + " ..."
    return text


def help_table() -> dict[str, dict[str, str]]:
    """{class name: {field: one-line description}} for every class whose fields are flags:
    `OWN_HELP`, else `MAPPED`'s note, else the first sentence of TRL's / HF's help text. Refused
    fields get their reason when `--help` prints them."""
    import transformers
    import trl

    refs = [transformers.TrainingArguments, trl.ModelConfig, trl.ScriptArguments]
    refs += [getattr(trl, n) for n in dir(trl) if n.endswith("Config") and n[0].isupper()]
    trl_help: dict[str, dict[str, str]] = {}
    for ref in refs:
        if dataclasses.is_dataclass(ref):
            for f in dataclasses.fields(ref):
                if f.metadata.get("help"):
                    trl_help.setdefault(ref.__name__, {})[f.name] = f.metadata["help"]
    generic = {n: h for fields in trl_help.values() for n, h in fields.items()}
    hf_help = trl_help["TrainingArguments"]
    classes: dict[str, type] = {"TrainingConfig": TrainingConfig}
    for algo in ALGORITHMS:
        classes.update((c.__name__, c) for c in flag_classes(algo))
    table: dict[str, dict[str, str]] = {}
    shared = _field_names(TrainingConfig)
    for name, cls in classes.items():
        own = trl_help.get(name, {})
        rows = {}
        for field_name in sorted(_field_names(cls)):
            key = f"{name}.{field_name}"
            inherited = own.get(field_name) == hf_help.get(field_name)
            if cls is not TrainingConfig and field_name in shared and inherited:
                if key not in OWN_HELP:
                    continue  # TrainingConfig's description
            text = OWN_HELP.get(key) or OWN_HELP.get(field_name) or MAPPED.get(field_name)
            text = text or own.get(field_name) or generic.get(field_name, "")
            rows[field_name] = _first_sentence(text) if text else ""
        table[name] = rows
    return table


def write_help_table() -> None:
    HELP_FILE.write_text(json.dumps(help_table(), indent=1, sort_keys=True) + "\n")


if __name__ == "__main__":
    if sys.argv[1:] == ["--help-table"]:
        write_help_table()
    else:
        print(render(), end="")
