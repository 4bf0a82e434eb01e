"""HF `TrainingArguments` / TRL config fields that jaxrl accepts in a config but cannot honour.

A TRL script or YAML recipe may name any field of TRL's configs. Each field here exists on the
jaxrl config class with TRL's default, so such a script parses and runs; setting it to anything
but that default raises a `ConfigError` that says why it has no meaning on JAX and what to use
instead. Nothing here is silently ignored. `docs/config_fields.md` is generated from this table
and the config classes (see `fields_table`), and a test keeps both in sync with the installed
`transformers` and `trl`. This module describes fields; it never reads or changes a run.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

_TORCH = "a PyTorch-only switch; jaxrl always jit-compiles the whole step with XLA"
_LOADER = "jaxrl builds fixed-shape batches on the host itself (no torch DataLoader)"
_DDP = "jaxrl shards data over the `mesh_data`/`mesh_fsdp` axes of a JAX mesh (no torch DDP)"
_EVAL = (
    "jaxrl's jitted eval step hands each batch's metric values to the host, which averages them "
    "as HF does and gathers predictions batch by batch for compute_metrics"
)


@dataclass(frozen=True)
class Foreign:
    """A TRL/HF field accepted with its TRL default and rejected when set to anything else."""

    name: str
    type: Any
    default: Any
    reason: str

    def dataclass_field(self) -> tuple[str, Any, Any]:
        if isinstance(self.default, list | dict):
            value = self.default
            return self.name, self.type, field(default_factory=lambda: type(value)(value))
        return self.name, self.type, field(default=self.default)


# HF TrainingArguments (transformers 5.x) fields with no JAX meaning.
TRAINING_ARGUMENTS = (
    Foreign(
        "optim_args",
        str | None,
        None,
        "optax optimizers take their hyperparameters from "
        "the `adam_*`/`weight_decay` fields; pass a custom optax chain via `optimizers=`",
    ),
    Foreign(
        "optim_target_modules",
        str | list[str] | None,
        None,
        "GaLore/APOLLO-style optimizers are not implemented",
    ),
    Foreign(
        "label_smoothing_factor",
        float,
        0.0,
        "SFT applies it (HF's label smoothing); the reward, DPO and on-policy trainers compute "
        "their own losses, as TRL's do (DPO: use `label_smoothing`)",
    ),
    Foreign("bf16_full_eval", bool, False, "eval runs in the training compute dtype (`bf16`)"),
    Foreign("fp16_full_eval", bool, False, "eval runs in the training compute dtype (`fp16`)"),
    Foreign(
        "tf32",
        bool | None,
        None,
        "a CUDA matmul mode; on JAX set `jax.config.update('jax_default_matmul_precision', ...)`",
    ),
    Foreign("torch_compile", bool, False, _TORCH),
    Foreign("torch_compile_backend", str | None, None, _TORCH),
    Foreign("torch_compile_mode", str | None, None, _TORCH),
    Foreign(
        "use_liger_kernel",
        bool,
        False,
        "Liger kernels are Triton/torch; jaxrl computes "
        "log-probs in chunks (`logprob_chunk_size`) and never materialises full logits",
    ),
    Foreign("liger_kernel_config", dict | None, None, "see `use_liger_kernel`"),
    Foreign("use_cache", bool, False, "training never uses a KV cache in jaxrl"),
    Foreign(
        "torch_empty_cache_steps",
        int | None,
        None,
        "XLA manages device memory; there is no cache to empty",
    ),
    Foreign(
        "auto_find_batch_size",
        bool,
        False,
        "jaxrl compiles one static batch shape; pick "
        "`per_device_train_batch_size` (and `gradient_accumulation_steps`) yourself",
    ),
    Foreign("log_on_each_node", bool, True, "jaxrl logs from process 0 only"),
    Foreign(
        "logging_nan_inf_filter",
        bool,
        True,
        "jaxrl stops the run with a clear error on the "
        "first NaN/Inf metric instead of filtering it",
    ),
    Foreign("log_level", str, "passive", "configure Python's `logging` for the 'jaxrl' logger"),
    Foreign("log_level_replica", str, "warning", "jaxrl logs from process 0 only"),
    Foreign(
        "project",
        str,
        "huggingface",
        "a trackio setting; trackio is not integrated (use `report_to` wandb or tensorboard)",
    ),
    Foreign("trackio_space_id", str | None, None, "trackio is not integrated"),
    Foreign("trackio_bucket_id", str | None, None, "trackio is not integrated"),
    Foreign("trackio_static_space_id", str | bool | None, None, "trackio is not integrated"),
    Foreign("eval_use_gather_object", bool, False, _EVAL),
    Foreign("save_on_each_node", bool, False, "orbax writes one checkpoint shared by all hosts"),
    Foreign(
        "enable_jit_checkpoint",
        bool,
        False,
        "jaxrl always saves a checkpoint on SIGTERM "
        "(exit status 143) and resumes with `resume_from_checkpoint`",
    ),
    Foreign(
        "hub_always_push", bool, False, "uploads run synchronously in jaxrl, so none is skipped"
    ),
    Foreign("ignore_data_skip", bool, False, "resuming always restores the exact data position"),
    Foreign(
        "full_determinism",
        bool,
        False,
        "XLA on one device is deterministic for a given `seed`; there is no torch flag to set",
    ),
    Foreign("accelerator_config", dict | str | None, None, "there is no accelerate Accelerator"),
    Foreign(
        "parallelism_config",
        dict | None,
        None,
        "use `mesh_data`, `mesh_fsdp`, `mesh_tensor` and `logical_axis_rules`",
    ),
    Foreign("dataloader_drop_last", bool, False, _LOADER),
    Foreign("dataloader_num_workers", int, 0, _LOADER),
    Foreign("dataloader_pin_memory", bool, True, _LOADER),
    Foreign("dataloader_persistent_workers", bool, False, _LOADER),
    Foreign("dataloader_prefetch_factor", int | None, None, _LOADER),
    Foreign("dataloader_multiprocessing_context", str | None, None, _LOADER),
    Foreign("dataloader_in_order", bool, True, _LOADER),
    Foreign("label_names", list[str] | None, None, "each trainer knows its label columns"),
    Foreign("ddp_find_unused_parameters", bool | None, None, _DDP),
    Foreign("ddp_bucket_cap_mb", int | None, None, _DDP),
    Foreign("ddp_broadcast_buffers", bool | None, None, _DDP),
    Foreign("ddp_static_graph", bool | None, None, _DDP),
    Foreign("ddp_backend", str | None, None, _DDP + "; multi-host runs use jax.distributed"),
    Foreign("ddp_timeout", int, 1800, _DDP),
    Foreign("fsdp", str | None, None, "use `mesh_fsdp` (parameters sharded over that mesh axis)"),
    Foreign("fsdp_config", dict | str | None, None, "use `mesh_fsdp` and `logical_axis_rules`"),
    Foreign(
        "deepspeed",
        dict | str | None,
        None,
        "use `mesh_fsdp` (ZeRO-3-like sharding of "
        "params, grads and optimizer state) and `mesh_data`",
    ),
    Foreign(
        "debug",
        str | list[str],
        "",
        "torch debug options; use JAX's debug flags (e.g. `jax_debug_nans`)",
    ),
    Foreign("skip_memory_metrics", bool, True, "memory metrics are reported by `jaxrl.bench`"),
    Foreign(
        "local_rank",
        int,
        -1,
        "set by torch launchers; multi-host JAX uses jax.distributed.initialize()",
    ),
)

_PADDING_FREE = Foreign(
    "padding_free",
    bool,
    False,
    "TRL 1.16's DPOTrainer does not run it either (it warns and sets it back to False); a "
    "step's rows are padded to one length, a `length_buckets` bucket",
)
# TRL's SFT and reward configs add no field without a JAX meaning; DPO's `padding_free` has none.
SFT: tuple[Foreign, ...] = ()
REWARD: tuple[Foreign, ...] = ()
DPO = (_PADDING_FREE,)


def dataclass_fields(fields: tuple[Foreign, ...]) -> list[tuple[str, Any, Any]]:
    """`dataclasses.make_dataclass` field specs for `fields`."""
    return [f.dataclass_field() for f in fields]


def unset_violations(config: Any, fields: tuple[Foreign, ...]) -> list[str]:
    """One message per field of `fields` that `config` sets away from its TRL default."""
    messages = []
    for f in fields:
        value = getattr(config, f.name)
        if value != f.default and not (isinstance(value, str) and str(f.default) == value):
            messages.append(
                f"`{f.name}={value!r}` is not supported on jaxrl: {f.reason}. Remove it (TRL "
                f"default: {f.default!r})."
            )
    return messages
