"""Image-text DPO data, as TRL 1.16's `DataCollatorForVisionPreference` makes it.

TRL's vision-preference datasets hold `images` (a list of images; or `image`, one) next to
`prompt`, `chosen` and `rejected`, conversational (message lists) or standard (strings whose
prompt carries the processor's image marker once per image). As in TRL, the processor runs in the
collator, example by example; the prompt and its images are processed once and shared by the
pair's two rows:

- `input_ids`, `targets`, `attention_mask`, `positions`, `loss_mask` `[B, 2, T]`: row 0 is
  `prompt + chosen`, row 1 `prompt + rejected` (`collate.collate_preference`'s layout per pair),
  `loss_mask` on the completion targets;
- `token_type_ids` `[B, 2, T]` (1 on image tokens: Gemma 3's bidirectional image attention);
- `pixel_values` `[B, I, C, H, W]`: the pair's images once, I the most images any example has
  (rows with fewer carry zeros the model never reads).

Each row `prompt + completion` is cut to `max_length` from its end (TRL's keep_start); a cut
through the prompt's image tokens is an error, as in TRL. The static row length comes from
`token_counts`, which renders each example's text without processing its images. Nothing here
runs a model.
"""

from __future__ import annotations

from itertools import takewhile
from typing import Any

import numpy as np

from jaxrl.data.collate import _rows_to_batch
from jaxrl.data.formats import is_conversational
from jaxrl.data.vision import (
    check_image_tokens,
    check_processor,
    example_images,
    multimodal_messages,
)


def _common_prefix(a: str, b: str) -> str:
    return "".join(x for x, _ in takewhile(lambda x: x[0] == x[1], zip(a, b, strict=False)))


class VisionPreferenceCollator:
    """Preference examples with images -> DPO pair batches (see the module docstring).

    `max_images`: the static I of `pixel_values`; `image_tokens`: each image's number of image
    tokens (the model's `mm_tokens_per_image`) and `image_token_id` its token, for the truncation
    check."""

    def __init__(
        self,
        processor: Any,
        *,
        max_length: int | None,
        max_images: int,
        image_token_id: int,
        image_tokens: int,
    ):
        check_processor(processor)
        self.processor = processor
        self.tokenizer = processor.tokenizer
        self.max_length = max_length
        self.max_images = max_images
        self.image_token_id = image_token_id
        self.image_tokens = image_tokens

    # ------------------------------------------------------------- text
    def render(self, example: dict, images: list) -> tuple[str, str, str]:
        """The prompt, chosen and rejected texts: as given (standard), or TRL's
        `apply_chat_template` of a conversational pair (the prompt with a generation prompt, or
        continuing a final assistant message, cut to its common prefix with each rendered
        `prompt + completion`; a completion is the rest of its rendering)."""
        if not is_conversational(example):
            return example["prompt"], example["chosen"], example["rejected"]
        prompt_messages = multimodal_messages(example["prompt"], images)
        last = prompt_messages[-1]["role"]
        if last not in ("user", "tool", "assistant"):
            raise ValueError(f"Invalid role in the last message: {last}")
        kwargs = dict(example.get("chat_template_kwargs") or {})
        render = self.processor.apply_chat_template
        prompt = render(
            prompt_messages, tokenize=False, add_generation_prompt=last != "assistant",
            continue_final_message=last == "assistant", **kwargs,
        )  # fmt: skip
        full = {
            side: render(
                prompt_messages + multimodal_messages(example[side], []), tokenize=False, **kwargs
            )
            for side in ("chosen", "rejected")
        }
        for text in full.values():
            prompt = _common_prefix(prompt, text)
        return prompt, full["chosen"][len(prompt) :], full["rejected"][len(prompt) :]

    def token_counts(self, example: dict, num_images: int) -> tuple[int, int, int]:
        """Untruncated prompt, chosen and rejected token counts of `example` without processing
        its images: the rendered text with each image marker expanded to the processor's image
        sequence."""
        prompt, chosen, rejected = self.render(example, [None] * num_images)
        expanded = prompt.replace(self.processor.image_token, self.processor.full_image_sequence)

        def count(text: str) -> int:
            return len(self.tokenizer(text, add_special_tokens=False)["input_ids"])

        return count(expanded), count(chosen), count(rejected)

    # ------------------------------------------------------------- processing
    def _process(self, text: str, images: list) -> dict[str, np.ndarray]:
        out = self.processor(
            images=[images] if images else None,
            text=[text],
            add_special_tokens=False,
            return_tensors="np",
        )
        return {k: np.asarray(v) for k, v in out.items()}

    def process(self, example: dict) -> dict[str, Any]:
        """One example -> its two rows' `input_ids`, `trained`, `token_type_ids` (lists, cut to
        `max_length`) and the prompt's `pixel_values` [k, C, H, W] (None without images)."""
        images = example_images(example)
        prompt, chosen, rejected = self.render(example, images)
        p = self._process(prompt, images)
        p_ids, p_types = p["input_ids"][0], p["token_type_ids"][0]
        rows = {"input_ids": [], "trained": [], "token_type_ids": []}
        for completion in (chosen, rejected):
            c = self._process(completion, [])
            keep = slice(None, self.max_length)
            ids = np.concatenate([p_ids, c["input_ids"][0]])[keep]
            rows["input_ids"].append(ids.tolist())
            rows["trained"].append(([0] * len(p_ids) + [1] * c["input_ids"].shape[1])[keep])
            rows["token_type_ids"].append(
                np.concatenate([p_types, c["token_type_ids"][0]])[keep].tolist()
            )
            check_image_tokens(
                ids, len(images), self.image_tokens, self.image_token_id, self.max_length
            )
        return {**rows, "pixel_values": p.get("pixel_values")}

    def __call__(self, examples: list[dict], seq_len: int, pad_token_id: int) -> dict:
        processed = [self.process(ex) for ex in examples]
        # Chosen rows then rejected rows ([2B, T], as `collate_preference`), then [B, 2, T].
        order = [(r, side) for side in (0, 1) for r in processed]
        rows = _rows_to_batch(
            [r["input_ids"][side] for r, side in order],
            [r["trained"][side] for r, side in order],
            seq_len,
            pad_token_id,
        )
        types = np.zeros((len(order), seq_len), np.int32)
        for i, (r, side) in enumerate(order):
            types[i, : len(r["token_type_ids"][side])] = r["token_type_ids"][side]
        rows["token_type_ids"] = types
        b = len(examples)
        batch = {k: np.stack([v[:b], v[b:]], axis=1) for k, v in rows.items()}
        if self.max_images:
            have = [r["pixel_values"] for r in processed if r["pixel_values"] is not None]
            shape = have[0].shape[1:] if have else self._pixel_shape()
            pixels = np.zeros((b, self.max_images, *shape), np.float32)
            for i, r in enumerate(processed):
                if r["pixel_values"] is not None:
                    pixels[i, : len(r["pixel_values"])] = r["pixel_values"]
            batch["pixel_values"] = pixels
        return batch

    def _pixel_shape(self) -> tuple[int, int, int]:
        """`[C, H, W]` of the processor's images, for a batch whose examples have none."""
        size = self.processor.image_processor.size
        return (3, int(size["height"]), int(size["width"]))
