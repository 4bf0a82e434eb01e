"""How a trainer gets its model: the device mesh, the compute and param dtypes, the model loaded
(a path or hub id, a transformers config for a random init, a transformers or `peft.PeftModel`
object read in memory, or a user-built nnx model) with its params placed on the mesh by the
sharding rules, and LoRA / QLoRA set up on it (TRL's
`peft_config`, `quantization_config`).

`ModelSetupMixin` is one of the pieces `jaxrl.trainers.base.Trainer` is composed of: its methods
read `self.args` (and the mesh, rules and dtypes the constructor keeps) and return what they
build; `_setup_peft` sets `self.lora_config` and `self.is_peft` (the LoRA / QLoRA setup itself is
`setup_peft`, which `PPOTrainer` shares). No data, no training step, no export here.
"""

from __future__ import annotations

import dataclasses
import logging
from types import SimpleNamespace
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from jaxrl import lora, models, parallel
from jaxrl.models import hf_objects
from jaxrl.models.hf import adapter_base_model

logger = logging.getLogger("jaxrl")

_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


class ModelSetupMixin:
    """`Trainer`'s mesh, dtypes, model loading and LoRA / QLoRA setup (subclass hooks:
    `_model_load_kwargs`, `_check_model`, `_default_peft_task`)."""

    def _make_mesh(self):
        a = self.args
        devices = jax.devices("cpu") if a.use_cpu else jax.devices()  # HF `use_cpu`
        return parallel.config_mesh(a.mesh_data, a.mesh_fsdp, a.mesh_tensor, devices=devices)

    def _compute_dtype(self):
        a = self.args
        if a.fp16:
            return jnp.float16
        if a.bf16:
            return jnp.bfloat16
        return jnp.float32

    def _param_dtype(self):
        return _DTYPES[self.args.param_dtype]

    def _load_model(self, model: Any, task: str):
        a = self.args
        kw = dict(
            dtype=self.compute_dtype,
            param_dtype=self._param_dtype(),
            residual_dtype=a.residual_dtype,
            mesh=self.mesh,
            rules=self.rules,
            scan_layers=self.scan_layers,
            remat_policy=a.remat_policy or ("full" if a.gradient_checkpointing else "none"),
            activation_offloading=getattr(a, "activation_offloading", False),
        )
        kw.update(self._model_load_kwargs())
        if isinstance(model, str):
            base = adapter_base_model(model)
            if base is not None:  # a PEFT adapter: its base, then the adapter (AutoPeftModel)
                logger.info("%s is a PEFT adapter: loading its base model %s.", model, base)
                return lora.load_peft_adapter(models.from_pretrained(base, task=task, **kw), model)
            return models.from_pretrained(model, task=task, **kw)
        # TRL's `model=AutoModelForCausalLM.from_pretrained(...)` (or a PeftModel over one): its
        # config and weights are read in memory as from its directory; training is in JAX.
        if lora.is_peft_model(model):
            return lora.from_peft_model(model, task=task, **kw)
        if hf_objects.is_transformers_model(model):
            return models.from_transformers(model, task=task, **kw)
        from transformers import PretrainedConfig

        if isinstance(model, PretrainedConfig):  # random init from a config (from scratch)
            return models.from_config(model, seed=a.seed, task=task, **kw)
        if isinstance(model, nnx.Module):
            self._check_model(model)
            offload = kw["activation_offloading"]
            if offload != getattr(getattr(model, "config", None), "activation_offloading", offload):
                raise ValueError(
                    f"activation_offloading={offload} but the given model was built with "
                    f"activation_offloading={not offload}; build it with the same setting "
                    "(`from_pretrained(..., activation_offloading=...)`) or pass its path."
                )
            # Place a user-built model's params on this trainer's mesh by the sharding rules.
            params = nnx.state(model)
            shardings = parallel.param_shardings(params, self.mesh, self.rules)
            nnx.update(model, jax.device_put(params, shardings))
            return model
        raise TypeError(
            "model must be a path/hub id, a transformers model or config (random init), a "
            f"peft.PeftModel or a jaxrl nnx model, got {type(model).__name__}."
        )

    def _model_load_kwargs(self) -> dict[str, Any]:
        """Extra `from_pretrained` / `from_config` arguments (SFT on images: `vision=True`)."""
        return {}

    def _check_model(self, model: Any) -> None:
        """Checks a user-built model must pass (none here)."""

    # ----------------------------------------------------------------- LoRA / QLoRA
    def _default_peft_task(self) -> str:
        return "CAUSAL_LM"

    def _setup_peft(self, peft_config: Any, quantization_config: Any) -> None:
        """Wrap the policy in LoRA adapters (TRL's `peft_config`), optionally over a quantized
        base (TRL's `quantization_config`); sets `self.lora_config` and `self.is_peft`."""
        self.lora_config = setup_peft(
            self.model,
            peft_config,
            quantization_config,
            seed=self.args.seed,
            task=self._default_peft_task(),
            trainer_name=type(self).__name__,
        )
        self.is_peft = self.lora_config is not None


def source_path(model: Any) -> str | None:
    """Where the tokenizer, generation config and model card's base model are found: the path
    or Hub id given, or the one a transformers / PEFT model object was loaded from (TRL reads
    `model.config._name_or_path`); None for a model built in memory."""
    if isinstance(model, str):
        return model
    if lora.is_peft_model(model):
        model = model.get_base_model()
    return hf_objects.source_path(model) if hf_objects.is_transformers_model(model) else None


def setup_peft(
    model: Any,
    peft_config: Any,
    quantization_config: Any,
    *,
    seed: int,
    task: str,
    trainer_name: str,
) -> lora.LoraConfig | None:
    """LoRA adapters on `model` (TRL's `peft_config`), optionally over a quantized base (TRL's
    `quantization_config`: a `BitsAndBytesConfig`, or "int8" / "nf4"). A model that already
    carries adapters (`lora.load_peft_adapter`) trains them as is. Returns the model's LoRA
    config (None: no adapters). `PPOTrainer` calls it on its value-head policy's LM."""
    scheme = _quantization_scheme(quantization_config)
    if peft_config is not None:
        if getattr(model, "lora_config", None) is not None:
            raise ValueError(
                "The model already has LoRA adapters and peft_config was given too; merge the "
                "adapters first (lora.merge_lora) or drop peft_config."
            )
        config = peft_config
        if not isinstance(config, lora.LoraConfig):
            config = lora.LoraConfig.from_peft(peft_config)
        if config.task_type is None:
            config = dataclasses.replace(config, task_type=task)
        if config.task_type != task:
            raise ValueError(
                f"peft_config.task_type={config.task_type!r} does not fit "
                f"{trainer_name}; use {task!r}."
            )
        lora.apply_lora(model, config, nnx.Rngs(seed))
    lora_config = getattr(model, "lora_config", None)
    if scheme is not None:
        if lora_config is None:
            raise ValueError(
                "quantization_config needs peft_config: a quantized base cannot be trained in "
                "full, only LoRA adapters on top of it (QLoRA)."
            )
        lora.quantize_base(model, scheme)
    if lora_config is not None:
        trainable, total = lora.trainable_parameters(model)
        logger.info(
            "LoRA: trainable params %d || all params %d || trainable%% %.4f",
            trainable,
            total,
            100 * trainable / total,
        )
    return lora_config


def _quantization_scheme(quantization_config: Any) -> str | None:
    """`lora.quantize_base`'s scheme for TRL's `quantization_config`: None, "int8", "nf4", or a
    transformers `BitsAndBytesConfig` (`load_in_8bit`, or `load_in_4bit` with NF4)."""
    if quantization_config is None or quantization_config in ("int8", "nf4"):
        return quantization_config
    if isinstance(quantization_config, str):
        raise ValueError(
            f"quantization_config={quantization_config!r}: use 'int8', 'nf4' or a "
            "transformers BitsAndBytesConfig."
        )
    q = quantization_config
    return lora.base_quantization(
        SimpleNamespace(
            load_in_8bit=getattr(q, "load_in_8bit", False),
            load_in_4bit=getattr(q, "load_in_4bit", False),
            bnb_4bit_quant_type=getattr(q, "bnb_4bit_quant_type", "nf4"),
            use_bnb_nested_quant=getattr(q, "bnb_4bit_use_double_quant", False),
        )
    )
