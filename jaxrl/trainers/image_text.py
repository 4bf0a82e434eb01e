"""What a trainer needs to run TRL's vision datasets (an `image` / `images` column): the model
loaded with its vision tower, the model's processor as the processing class, and clear errors
for a text-only model or a bare tokenizer. Mixed into `SFTTrainer`, `DPOTrainer` and the online
trainers (`GRPOTrainer`, `RLOOTrainer`) ahead of `Trainer`; the trainer sets `self.vision` before
`Trainer.__init__` runs. No data processing here (`jaxrl.data.vision`,
`jaxrl.data.vision_preference`, `jaxrl.data.vision_prompts`)."""

from __future__ import annotations

from typing import Any

from jaxrl.data import vision


class ImageTextMixin:
    """`Trainer` hooks for image-text runs, active where `self.vision` is set (SFT, DPO, GRPO,
    RLOO)."""

    vision: bool = False
    supports_images = True

    @staticmethod
    def _has_images(dataset: Any) -> bool:
        return vision.image_column(getattr(dataset, "column_names", None)) is not None

    def _load_model(self, model: Any, task: str):
        try:
            return super()._load_model(model, task)
        except ValueError as err:
            if self.vision and "vision=True needs an image-text checkpoint" in str(err):
                raise ValueError(
                    "The dataset has images (an 'image' or 'images' column) but the model is not "
                    f"an image-text model ({err}). Use an image-text Gemma 3 checkpoint "
                    "(Gemma3ForConditionalGeneration), or drop the image column."
                ) from err
            raise

    def _model_load_kwargs(self) -> dict[str, Any]:
        return {"vision": True} if self.vision else {}

    def _check_model(self, model: Any) -> None:
        if self.vision and getattr(getattr(model, "config", None), "vision", None) is None:
            raise ValueError(
                "The dataset has images (an 'image' or 'images' column) but the model does not "
                "take images: jaxrl trains image-text Gemma 3 checkpoints "
                "(Gemma3ForConditionalGeneration) on images. Use such a model, or drop the "
                "image column to train on text."
            )

    def _default_processing_class(self) -> Any:
        if not self.vision:
            return super()._default_processing_class()
        from transformers import AutoProcessor

        return AutoProcessor.from_pretrained(self.model_path)

    def _load_tokenizer(self, processing_class):
        processing_class = super()._load_tokenizer(processing_class)
        if self.vision:
            from transformers import ProcessorMixin

            if not isinstance(processing_class, ProcessorMixin):
                raise ValueError(
                    "The dataset has images but processing_class is a tokenizer; training on "
                    "images needs the model's processor (transformers.AutoProcessor), which turns "
                    "images into pixel values and image tokens."
                )
        return processing_class
