"""TRL's `AutoModelForCausalLMWithValueHead` loader: an LM plus a value head
(`jaxrl.models.heads.CausalLMWithValueHead`) in TRL's checkpoint layout, with TRL v0.7.2's PEFT
options (`peft_config`, `load_in_8bit`, `load_in_4bit`).

It sits above both `jaxrl.models` (loading and saving) and the LoRA modules it applies, so that
neither imports the other. No training and no file format of its own here.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from flax import nnx

from jaxrl.lora.apply import apply_lora, quantize_base
from jaxrl.lora.config import LoraConfig
from jaxrl.models.heads import CausalLMWithValueHead
from jaxrl.models.hf import from_config, from_pretrained, save_pretrained


class AutoModelForCausalLMWithValueHead:
    """TRL's loader name: `from_pretrained(path, summary_dropout_prob=..., v_head_init_strategy=...,
    v_head_initializer_range=..., **load_kwargs)` gives a `CausalLMWithValueHead`; a checkpoint
    written by TRL (LM keys + `v_head.summary.*`) keeps its value head. `save_pretrained(model,
    path)` writes the same layout, so TRL's class reads the value head back."""

    @staticmethod
    def from_pretrained(
        path_or_hub_id: str | Path,
        *,
        summary_dropout_prob: float | None = None,
        v_head_init_strategy: str | None = None,
        v_head_initializer_range: float = 0.2,
        seed: int = 0,
        peft_config: Any = None,
        load_in_8bit: bool = False,
        load_in_4bit: bool = False,
        **load_kwargs: Any,
    ) -> CausalLMWithValueHead:
        """TRL v0.7.2's PEFT options: `peft_config` puts LoRA adapters on the LM (the value
        head stays a full layer); `load_in_8bit` / `load_in_4bit` store its frozen base as int8
        / NF4 (QLoRA; only together with `peft_config`)."""
        head = dict(
            summary_dropout_prob=summary_dropout_prob,
            v_head_init_strategy=v_head_init_strategy,
            v_head_initializer_range=v_head_initializer_range,
        )
        if load_in_8bit and load_in_4bit:
            raise ValueError("Set at most one of load_in_8bit and load_in_4bit.")
        if (load_in_8bit or load_in_4bit) and peft_config is None:
            raise ValueError(
                "load_in_8bit / load_in_4bit need peft_config: a quantized base cannot be trained "
                "in full, only LoRA adapters on top of it (QLoRA)."
            )
        model = from_pretrained(
            path_or_hub_id,
            task="causal_lm_with_value_head",
            value_head_kwargs={**head, "seed": seed},
            **load_kwargs,
        )
        if peft_config is not None:
            if not isinstance(peft_config, LoraConfig):
                peft_config = LoraConfig.from_peft(peft_config)
            apply_lora(model.pretrained_model, peft_config, nnx.Rngs(seed))
            if load_in_8bit or load_in_4bit:
                quantize_base(model.pretrained_model, "int8" if load_in_8bit else "nf4")
        return model

    @staticmethod
    def from_config(
        hf_config: Any,
        *,
        summary_dropout_prob: float | None = None,
        v_head_init_strategy: str | None = None,
        v_head_initializer_range: float = 0.2,
        **kwargs: Any,
    ) -> CausalLMWithValueHead:
        head = dict(
            summary_dropout_prob=summary_dropout_prob,
            v_head_init_strategy=v_head_init_strategy,
            v_head_initializer_range=v_head_initializer_range,
        )
        return from_config(
            hf_config, task="causal_lm_with_value_head", value_head_kwargs=head, **kwargs
        )

    save_pretrained = staticmethod(save_pretrained)
