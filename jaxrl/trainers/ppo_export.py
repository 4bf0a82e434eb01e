"""What leaves `PPOTrainer`, in TRL v0.7.2's layout: the value-head policy (LM + `v_head.summary.*`
in one HF directory; with LoRA the PEFT adapter plus a `model.safetensors` holding only the value
head, or merged) and TRL v0.7.2's model card.

`PPOTrainer.save_model` is `jaxrl.trainers.export.SaveModelMixin`'s, with these as its weights
and metadata hooks: the files differ from TRL's current trainers' (generation config,
jaxrl_config.json, `jaxrl.model_card`'s card) on purpose, PPO keeps v0.7.2's. Only process 0
writes. No training or checkpoint code here.
"""

from __future__ import annotations

import os
from pathlib import Path

import jax
import numpy as np
from flax import nnx

from jaxrl import lora
from jaxrl.models import hf_keys
from jaxrl.models.heads import CausalLMWithValueHead
from jaxrl.models.hf import save_pretrained
from jaxrl.models.weights_io import write_safetensors

MODEL_CARD_TEMPLATE = """---
license: apache-2.0
tags:
- trl
- jaxrl
- reinforcement-learning
---

# {model_name}

This is a language model fine-tuned with reinforcement learning (PPO) using jaxrl, a JAX port of
[TRL](https://github.com/huggingface/trl), to guide the model outputs according to a value,
function, or human feedback. The model can be used for text generation.

## Usage

```python
from transformers import pipeline

generator = pipeline("text-generation", model="{model_id}")
outputs = generator("Hello, my llama is cute")
```

To get the value-head outputs as well, load it with
`trl.AutoModelForCausalLMWithValueHead.from_pretrained("{model_id}")` or
`jaxrl.AutoModelForCausalLMWithValueHead.from_pretrained("{model_id}")`.
"""


def save_policy(
    policy: CausalLMWithValueHead,
    save_directory: str | Path,
    *,
    is_peft: bool,
    model_path: str | None,
    merged: bool,
) -> None:
    """Full weights: LM + value head (TRL's layout). With LoRA, as TRL's PEFT value-head model:
    `adapter_config.json` + `adapter_model.safetensors` (PEFT's format) and `model.safetensors`
    holding only `v_head.summary.*`; `merged=True`: the full value-head model with the adapter
    folded in (PEFT's `merge_and_unload`)."""
    if merged:
        policy.pretrained_model = lora.merge_lora(policy.pretrained_model)
        save_pretrained(policy, save_directory)
    elif is_peft:
        lora.save_peft_adapter(policy.pretrained_model, save_directory, model_path)
        save_value_head(policy, Path(save_directory))
    else:
        save_pretrained(policy, save_directory)


def save_value_head(policy: CausalLMWithValueHead, path: Path) -> None:
    """`model.safetensors` with only TRL's `v_head.summary.*` keys (TRL saves a PEFT value-head
    model's head beside the adapter and reads it back from there)."""
    state = nnx.state(policy, nnx.PathContains("v_head"))
    tensors = {}
    for entry in hf_keys.entries(state, policy.config):
        value = jax.device_get(entry.variable.get_value())
        (key,) = entry.keys()
        tensors[key] = hf_keys.ours_to_hf(
            np.asarray(value), entry.path, entry.hf_shape, policy.config
        )
    if jax.process_index() != 0:
        return
    specs = {k: (tuple(v.shape), v.dtype) for k, v in tensors.items()}
    write_safetensors(path / "model.safetensors", specs, tensors.__getitem__, {"format": "pt"})


def write_model_card(path: str, model_name: str | None = "TRL Model") -> None:
    """Write `README.md` (TRL v0.7.2's card). The model id is `<hub user>/<path>` when the Hub
    user is known, else `path` (TRL skips the card offline; we still write it)."""
    try:
        from huggingface_hub import whoami

        model_id = f"{whoami()['name']}/{path}"
    except Exception:  # offline or not logged in
        model_id = path
    os.makedirs(path, exist_ok=True)
    card = MODEL_CARD_TEMPLATE.format(model_name=model_name, model_id=model_id)
    with open(os.path.join(path, "README.md"), "w", encoding="utf-8") as f:
        f.write(card)
