"""Image-text prompts for the online trainers (GRPO, RLOO), as TRL 1.16's GRPOTrainer makes them.

TRL's prompt datasets with images hold a conversational `prompt` next to `images` (a list per
row; zero, one or several) or `image` (one per row, or None). As TRL's
`_generate_and_score_completions` and `_tokenize_prompts`:

- each prompt becomes multimodal messages (`prepare_multimodal_messages`: string contents become
  text parts, and the first user message given as a string gets one image part per image before
  its text; the count must match the image parts), then the processor's chat template with the
  generation prompt renders it and each image marker expands to the image's tokens (special
  tokens added unless the text starts with BOS, as the processor's `apply_chat_template`);
- a dataset with images whose prompts are plain text is TRL's error (multimodal training needs
  conversational prompts);
- the processor turns each row's images into `pixel_values` (TRL's `processing_class(images=...,
  text=...)`), and Gemma 3's `token_type_ids` are 1 exactly on the prompt's image tokens.

Prompt ids are computed when the dataset is prepared, without decoding any image (the rendered
text with each marker expanded to the processor's image sequence); pixel values when a batch is
sampled (`PromptImages.pixel_values`), the processor's own call, whose ids are checked against
the prepared ones. Rows are padded to `[B, I, C, H, W]`, I the most images a row of the run has
(rows with fewer carry zeros the model never reads). Gemma 3's processor only (as image-text SFT
and DPO, `vision.check_processor`).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from jaxrl.data import vision
from jaxrl.data.formats import is_conversational

NOT_CONVERSATIONAL = (
    "Multimodal training requires conversational prompts. It looks like the dataset contains "
    "non-conversational inputs, likely because a chat template was applied before passing the "
    "dataset to the trainer. Please provide the raw conversational prompts and let the trainer "
    "apply the chat template internally."
)


def prompt_messages(prompt: list[dict], images: list) -> list[dict]:
    """TRL's `prepare_multimodal_messages(prompt, images=images)` (the reward functions'
    `prompts` and the chat template's input)."""
    return vision.multimodal_messages(prompt, images)


def strip_images(messages: Any) -> Any:
    """TRL's `strip_images_from_messages`: image parts keep their type, lose their image (what
    the completion logs hold)."""
    if not isinstance(messages, list):
        return messages
    out = []
    for m in messages:
        content = m.get("content") if isinstance(m, dict) else None
        if isinstance(content, list):
            content = [{"type": "image"} if p.get("type") == "image" else p for p in content]
            m = {**m, "content": content}
        out.append(m)
    return out


class PromptImages:
    """Prompt ids and pixel values of image-text prompts with `processor` (a Gemma 3 processor).

    `image_shape`: the model's `(C, H, W)`; `chat_template_kwargs`: TRL's, passed to the chat
    template."""

    def __init__(
        self,
        processor: Any,
        *,
        image_shape: tuple[int, int, int],
        chat_template_kwargs: dict | None = None,
    ):
        vision.check_processor(processor)
        self.processor = processor
        self.image_shape = tuple(image_shape)
        self.tokenizer = processor.tokenizer
        self.kwargs = dict(chat_template_kwargs or {})

    def render(self, prompt: Any, images: list) -> str:
        """The prompt's text as TRL renders it (generation prompt added), one image marker per
        image."""
        if not is_conversational({"prompt": prompt}):
            raise ValueError(NOT_CONVERSATIONAL)
        return self.processor.apply_chat_template(
            prompt_messages(prompt, images), tokenize=False, add_generation_prompt=True,
            **self.kwargs,
        )  # fmt: skip

    def prompt_ids(self, prompt: Any, num_images: int) -> list[int]:
        """The prompt's token ids (each image marker expanded to its image tokens) without
        processing the images (`num_images` placeholders stand in for them)."""
        text = self.render(prompt, [None] * num_images)
        p = self.processor
        special = self._add_special_tokens(text)
        text = text.replace(p.image_token, p.full_image_sequence)
        return self.tokenizer(text, add_special_tokens=special)["input_ids"]

    def _add_special_tokens(self, text: str) -> bool:
        """transformers' processor `apply_chat_template(tokenize=True)` (TRL's call): special
        tokens are added unless the rendered text starts with BOS."""
        bos = self.tokenizer.bos_token
        return not (bos is not None and text.startswith(bos))

    def pixel_values(
        self, examples: list[dict], prompt_ids: list[list[int]], max_images: int
    ) -> np.ndarray:
        """`[B, max_images, C, H, W]` float32: each example's images as the processor makes
        them (zeros past a row's count), the processor's ids checked against `prompt_ids`."""
        rows = []
        for ex, ids in zip(examples, prompt_ids, strict=True):
            images = vision.example_images(ex)
            if not images:
                rows.append(None)
                continue
            text = self.render(ex["prompt"], images)
            out = self.processor(
                images=[images], text=[text], return_tensors="np",
                add_special_tokens=self._add_special_tokens(text),
            )  # fmt: skip
            if list(out["input_ids"][0]) != list(ids):
                raise ValueError(
                    "The processor tokenized an image prompt differently from its prepared ids; "
                    "this processor's chat template or image sequence is not supported."
                )
            if out["pixel_values"].shape[1:] != self.image_shape:
                raise ValueError(
                    f"The processor makes {out['pixel_values'].shape[1:]} images but the model's "
                    f"vision tower takes {self.image_shape}; use the model's own processor."
                )
            rows.append(np.asarray(out["pixel_values"], np.float32))
        pixels = np.zeros((len(rows), max_images, *self.image_shape), np.float32)
        for b, r in enumerate(rows):
            if r is not None:
                pixels[b, : len(r)] = r
        return pixels
