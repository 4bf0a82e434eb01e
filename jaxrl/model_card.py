"""The model card (`README.md`) written next to an exported model, with the facts TRL's
`create_model_card` records: model name, base model, dataset, trainer and its paper, tags and
the framework versions. Offline: nothing here touches the network or any array.
"""

from __future__ import annotations

import os
from importlib.metadata import PackageNotFoundError, version
from typing import Any

# The libraries a jaxrl model is trained with (TRL lists TRL, Transformers, PyTorch, Datasets,
# Tokenizers; jaxrl trains with JAX instead of PyTorch).
_FRAMEWORKS = {
    "jaxrl": "jaxrl",
    "JAX": "jax",
    "Flax": "flax",
    "Optax": "optax",
    "Transformers": "transformers",
    "Datasets": "datasets",
    "Tokenizers": "tokenizers",
}


def framework_versions() -> dict[str, str]:
    """Installed version of each framework a jaxrl model is trained with."""
    out = {}
    for name, dist in _FRAMEWORKS.items():
        try:
            out[name] = version(dist)
        except PackageNotFoundError:
            out[name] = "not installed"
    return out


def base_model_id(model_name_or_path: str | None) -> str | None:
    """TRL's rule: the card names a base model only when it is a hub id, not a local path."""
    if model_name_or_path is None or os.path.exists(model_name_or_path):
        return None
    return model_name_or_path


def model_card(
    *,
    model_name: str,
    trainer_name: str,
    base_model: str | None = None,
    dataset_name: str | None = None,
    hub_model_id: str | None = None,
    tags: list[str] | None = None,
    paper: dict[str, str] | None = None,
    library_name: str = "transformers",
    pipeline_tag: str = "text-generation",
) -> str:
    """README.md text: YAML metadata (the hub's model-card fields) and a short description."""
    from huggingface_hub import ModelCardData

    tags = ["generated_from_trainer", "jaxrl", *dict.fromkeys(tags or [])]
    data = ModelCardData(
        base_model=base_model,
        datasets=[dataset_name] if dataset_name else None,
        library_name=library_name,
        model_name=model_name,
        pipeline_tag=pipeline_tag,
        tags=tags,
    )
    origin = f"[{base_model}](https://huggingface.co/{base_model})" if base_model else "a model"
    on_data = (
        f" on the [{dataset_name}](https://huggingface.co/datasets/{dataset_name}) dataset"
        if dataset_name
        else ""
    )
    method = f"This model was trained with {trainer_name}"
    if paper:
        method += (
            f", a method introduced in [{paper['title']}](https://huggingface.co/papers/"
            f"{paper['id']})"
        )
    lines = [
        "---",
        data.to_yaml(),
        "---",
        "",
        f"# Model Card for {model_name}",
        "",
        f"This model is a fine-tuned version of {origin}{on_data}.",
        "It has been trained using jaxrl (TRL's trainers in JAX).",
        "",
        "## Training procedure",
        "",
        f"{method}.",
        "",
        "### Framework versions",
        "",
        *[f"- {name}: {v}" for name, v in framework_versions().items()],
    ]
    if hub_model_id:
        lines += ["", f"Hub repository: `{hub_model_id}`."]
    return "\n".join(lines) + "\n"


def card_fields(trainer: Any) -> dict[str, Any]:
    """The card's fields a trainer knows: name from `hub_model_id` or `output_dir` (TRL)."""
    args = trainer.args
    hub_id = getattr(args, "hub_model_id", None)
    name = hub_id.split("/")[-1] if hub_id else os.path.basename(os.path.normpath(args.output_dir))
    return {
        "model_name": name,
        "trainer_name": trainer._name,
        "base_model": base_model_id(trainer.model_path),
        "hub_model_id": hub_id,
        "tags": list(trainer._tag_names),
        "paper": trainer._paper or None,
    }
