"""Image-text SFT data, as TRL 1.16's `DataCollatorForVisionLanguageModeling` makes it.

TRL's vision datasets hold `images` (a list of images; or `image`, one) next to conversational
`messages`, standard text (`dataset_text_field`) or `prompt`/`completion`. As in TRL the
processor runs in the collator (pixel processing up front would be too costly), example by
example, and the rows are padded to the run's static shapes:

- `input_ids`, `targets`, `attention_mask`, `positions`, `loss_mask` as `collate.collate_sft`
  lays them out; the trained tokens are TRL's labels: every real token of a language-modelling
  row (image tokens included), the completion of a prompt-completion row with
  `completion_only_loss`;
- `token_type_ids` [B, T] (1 on image tokens: Gemma 3's bidirectional image attention);
- `pixel_values` [B, I, C, H, W]: row b's images in order, I the most images any example has
  (rows with fewer carry zeros the model never reads).

Text is truncated to `max_length` as TRL does (by the processor for language modelling, after
concatenation for prompt-completion); a cut through an image's tokens is an error, as in TRL.
The static row length comes from `token_count`, which renders each example's text without
processing its images.
"""

from __future__ import annotations

from itertools import takewhile
from typing import Any

import datasets
import numpy as np

from jaxrl.data.collate import _rows_to_batch
from jaxrl.data.formats import is_conversational

IMAGE_COLUMNS = ("image", "images")


def image_column(column_names: Any) -> str | None:
    """The dataset's image column (`images`, else `image`), None when it has none."""
    names = set(column_names or ())
    return next((c for c in ("images", "image") if c in names), None)


def example_images(example: dict[str, Any]) -> list:
    """An example's images: its `images` list, or its one `image` (TRL's collator)."""
    if "images" in example:
        return list(example["images"] or [])
    image = example.get("image")
    return [] if image is None else [image]


def multimodal_messages(messages: list[dict], images: list) -> list[dict]:
    """TRL's `prepare_multimodal_messages`: string contents become `[{"type": "text", ...}]`; a
    first user message given as a string gets one `{"type": "image"}` part per image before its
    text; then the image parts without an image are filled with `images` in order (their count
    must match)."""
    out, placed = [], False
    for message in messages:
        content, role = message.get("content"), message["role"]
        if role not in ("system", "user", "assistant", "tool"):
            raise ValueError(
                f"Invalid role in message: {role}. Expected 'system', 'user', 'assistant', or "
                "'tool'."
            )
        if isinstance(content, str):
            parts = [{"type": "text", "text": content}]
            if role == "user" and not placed:
                parts = [{"type": "image"} for _ in images] + parts
                placed = True
            message = {**message, "content": parts}
        out.append(message)
    slots = [
        part
        for message in out
        if message.get("content") and message["role"] != "tool"
        for part in message["content"]
        if part["type"] == "image" and "image" not in part
    ]
    if len(slots) != len(images):
        raise ValueError(
            f"Number of images provided ({len(images)}) does not match number of image "
            f"placeholders ({len(slots)})."
        )
    fill = iter(images)
    return [
        {
            **m,
            "content": [
                {**p, "image": next(fill)} if p in slots and "image" not in p else p
                for p in m["content"]
            ]
            if m.get("content")
            else m.get("content"),
        }
        for m in out
    ]


def check_processor(processor: Any) -> None:
    """The processors jaxrl's image-text collator runs: Gemma 3's (fixed-size images, each
    expanded to `image_seq_length` tokens), without pan-and-scan crops."""
    if not hasattr(processor, "full_image_sequence") or not hasattr(processor, "image_token"):
        raise ValueError(
            f"{type(processor).__name__} is not supported for image-text SFT: jaxrl runs Gemma 3 "
            "(Gemma3Processor) only."
        )
    if getattr(processor.image_processor, "do_pan_and_scan", False):
        raise ValueError(
            "The image processor has do_pan_and_scan=True (extra crops per image), which jaxrl's "
            "image-text SFT does not support; set it to False in preprocessor_config.json."
        )


def check_image_tokens(
    ids: np.ndarray, n_images: int, image_tokens: int, image_token_id: int, max_length: Any
) -> None:
    """TRL's error (transformers' "Image features and image tokens do not match") when a row cut
    to `max_length` lost image tokens: each of its `n_images` images needs `image_tokens`."""
    found = int(np.sum(np.asarray(ids) == image_token_id))
    if found != n_images * image_tokens:
        raise ValueError(
            f"The current `max_length` ({max_length}) is too short and causes image "
            f"placeholder tokens in `input_ids` to be truncated ({found} of "
            f"{n_images * image_tokens} left), while the corresponding image "
            "features remain intact. Please increase `max_length` or set it to `None` to "
            "disable truncation."
        )


class VisionCollator:
    """Examples -> image-text SFT batches (see the module docstring) with `processor`.

    `kind`: "messages", "text" or "prompt_completion"; `max_images`: the static I of
    `pixel_values`; `image_tokens`: each image's number of image tokens (the model's
    `mm_tokens_per_image`) and `image_token_id` its token, for the truncation check."""

    def __init__(
        self,
        processor: Any,
        *,
        kind: str,
        max_length: int | None,
        completion_only_loss: bool,
        dataset_text_field: str,
        max_images: int,
        image_token_id: int,
        image_tokens: int,
        assistant_only_loss: bool = False,
        chat_template: str | None = None,
    ):
        check_processor(processor)
        self.processor = processor
        self.tokenizer = processor.tokenizer
        self.kind = kind
        self.max_length = max_length
        self.completion_only_loss = completion_only_loss
        self.text_field = dataset_text_field
        self.max_images = max_images
        self.image_token_id = image_token_id
        self.image_tokens = image_tokens
        self.assistant_only_loss = assistant_only_loss
        self.chat_template = chat_template

    # ------------------------------------------------------------- text
    def _render_prompt_completion(self, example: dict, images: list) -> tuple[str, str]:
        """TRL's `apply_chat_template` of a conversational prompt-completion example: the
        prompt with a generation prompt (or continuing a final assistant message), the
        completion as the rest of the rendered prompt + completion."""
        prompt_messages = multimodal_messages(example["prompt"], images)
        completion_messages = multimodal_messages(example["completion"], [])
        last = prompt_messages[-1]["role"]
        if last not in ("user", "tool", "assistant"):
            raise ValueError(f"Invalid role in the last message: {last}")
        kwargs = dict(example.get("chat_template_kwargs") or {})
        prompt = self.processor.apply_chat_template(
            prompt_messages, tokenize=False, add_generation_prompt=last != "assistant",
            continue_final_message=last == "assistant", tools=example.get("tools"), **kwargs,
        )  # fmt: skip
        full = self.processor.apply_chat_template(
            prompt_messages + completion_messages, tokenize=False, tools=example.get("tools"),
            **kwargs,
        )  # fmt: skip
        prompt = "".join(
            a for a, _ in takewhile(lambda x: x[0] == x[1], zip(prompt, full, strict=False))
        )
        return prompt, full[len(prompt) :]

    def _messages_text(self, example: dict, images: list) -> str:
        messages = multimodal_messages(example["messages"], images)
        return self.processor.apply_chat_template(
            messages, chat_template=self.chat_template, tokenize=False,
            tools=example.get("tools"), **dict(example.get("chat_template_kwargs") or {}),
        )  # fmt: skip

    def _process_messages(self, example: dict, images: list) -> dict[str, np.ndarray]:
        """TRL's call: the processor's chat template, tokenized, truncated to `max_length`, with
        the assistant-token mask when asked for."""
        messages = multimodal_messages(example["messages"], images)
        out = self.processor.apply_chat_template(
            [messages],
            chat_template=self.chat_template,
            tokenize=True,
            return_dict=True,
            return_tensors="np",
            return_assistant_tokens_mask=self.assistant_only_loss,
            tools=example.get("tools"),
            processor_kwargs={
                "truncation": self.max_length is not None,
                "max_length": self.max_length,
                "add_special_tokens": False,
            },
            **dict(example.get("chat_template_kwargs") or {}),
        )
        return {k: np.asarray(v) for k, v in out.items()}

    def token_count(self, example: dict, num_images: int) -> int:
        """The row length of `example` (after truncation) without processing its images: the
        rendered text with each image marker expanded to the processor's image sequence."""
        placeholders = [None] * num_images

        def count(text: str) -> int:
            expanded = text.replace(self.processor.image_token, self.processor.full_image_sequence)
            return len(self.tokenizer(expanded, add_special_tokens=False)["input_ids"])

        if self.kind == "prompt_completion":
            if is_conversational(example):
                prompt, completion = self._render_prompt_completion(example, placeholders)
            else:
                prompt, completion = example["prompt"], example["completion"]
            n = count(prompt) + count(completion)
        elif self.kind == "messages":
            n = count(self._messages_text(example, placeholders))
        else:
            n = count(example[self.text_field])
        return n if self.max_length is None else min(n, self.max_length)

    # ------------------------------------------------------------- processing
    def _process(self, text: str, images: list, truncate: bool) -> dict[str, np.ndarray]:
        kwargs: dict[str, Any] = {"add_special_tokens": False, "return_tensors": "np"}
        if truncate and self.max_length is not None:
            kwargs.update(truncation=True, max_length=self.max_length)
        out = self.processor(images=[images] if images else None, text=[text], **kwargs)
        return {k: np.asarray(v) for k, v in out.items()}

    def process(self, example: dict) -> dict[str, Any]:
        """One example -> `input_ids`, `trained`, `token_type_ids` (lists) and `pixel_values`
        [k, C, H, W] (None without images)."""
        images = example_images(example)
        if self.kind == "prompt_completion":
            if is_conversational(example):
                prompt, completion = self._render_prompt_completion(example, images)
            else:
                prompt, completion = example["prompt"], example["completion"]
            p = self._process(prompt, images, truncate=False)
            c = self._process(completion, [], truncate=False)
            ids = np.concatenate([p["input_ids"][0], c["input_ids"][0]])
            types = np.concatenate([p["token_type_ids"][0], c["token_type_ids"][0]])
            completion_mask = np.r_[
                np.zeros(p["input_ids"].shape[1]), np.ones(c["input_ids"].shape[1])
            ]
            keep = slice(None, self.max_length)
            ids, types, completion_mask = ids[keep], types[keep], completion_mask[keep]
            trained = completion_mask if self.completion_only_loss else np.ones_like(ids)
            pixels = p.get("pixel_values")
        else:
            if self.kind == "messages":
                out = self._process_messages(example, images)
            else:
                out = self._process(example[self.text_field], images, truncate=True)
            ids, types = out["input_ids"][0], out["token_type_ids"][0]
            trained = np.ones_like(ids)
            if self.assistant_only_loss:
                trained = out["assistant_masks"][0]
            pixels = out.get("pixel_values")
        check_image_tokens(
            ids, len(images), self.image_tokens, self.image_token_id, self.max_length
        )
        return {
            "input_ids": ids.tolist(),
            "trained": np.asarray(trained, bool).tolist(),
            "token_type_ids": types.tolist(),
            "pixel_values": pixels,
        }

    def __call__(self, examples: list[dict], seq_len: int, pad_token_id: int) -> dict:
        rows = [self.process(ex) for ex in examples]
        batch = _rows_to_batch(
            [r["input_ids"] for r in rows], [r["trained"] for r in rows], seq_len, pad_token_id
        )
        types = np.zeros((len(rows), seq_len), np.int32)
        for b, r in enumerate(rows):
            types[b, : len(r["token_type_ids"])] = r["token_type_ids"]
        batch["token_type_ids"] = types
        if self.max_images:
            shape = next(r["pixel_values"].shape[1:] for r in rows if r["pixel_values"] is not None)
            pixels = np.zeros((len(rows), self.max_images, *shape), np.float32)
            for b, r in enumerate(rows):
                if r["pixel_values"] is not None:
                    pixels[b, : len(r["pixel_values"])] = r["pixel_values"]
            batch["pixel_values"] = pixels
        return batch


def image_counts(dataset: datasets.Dataset) -> list[int]:
    """Images per example, read without decoding them where the column holds `Image`
    features."""
    column = image_column(dataset.column_names)
    if column is None:
        return [0] * len(dataset)
    feature = dataset.features[column]
    inner = getattr(feature, "feature", None) if column == "images" else feature
    if isinstance(inner, datasets.Image):
        undecoded = datasets.Image(decode=False)
        kind = datasets.Sequence(undecoded) if column == "images" else undecoded
        if isinstance(feature, datasets.List):
            kind = datasets.List(undecoded)
        dataset = dataset.select_columns([column]).cast_column(column, kind)
    values = dataset[column]
    if column == "image":
        return [0 if v is None else 1 for v in values]
    return [len(v or []) for v in values]
