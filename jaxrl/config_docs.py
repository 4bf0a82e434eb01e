"""Writes docs/config_fields.md: every field of TRL's configs and how jaxrl treats it.

`python -m jaxrl.config_docs > docs/config_fields.md` regenerates it from the installed
`transformers` and `trl` and from jaxrl's config classes; tests/test_config_fields.py fails when
the file, the classes and the installed TRL disagree. Development tool only: it imports trl.
"""

from __future__ import annotations

import dataclasses

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
    "pad_to_multiple_of": "rounds padded row lengths up (SFT/reward/DPO: the static length and "
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
    "loss_type": "SFT: only nll; DPO and GRPO: every TRL loss type",
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
TRL_ALGOS = ("sft", "reward", "dpo", "grpo", "rloo", "distill")

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


if __name__ == "__main__":
    print(render(), end="")
