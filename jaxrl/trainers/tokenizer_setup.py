"""How a trainer sets up its processing class (a tokenizer, or an image-text processor): loaded
from the model directory when none is given, then TRL's `eos_token`, `chat_template_path` (a
.jinja file, or a tokenizer whose template is cloned with its tokens, resizing the model's token
tables) and `pad_token`, in TRL's order; the model config then mirrors the pad and EOS ids.

`TokenizerSetupMixin` is one of the pieces `jaxrl.trainers.base.Trainer` is composed of. No
dataset tokenization here (`jaxrl.data`), no model loading (`jaxrl.trainers.model_setup`).
"""

from __future__ import annotations

import logging
import os
from typing import Any

from jaxrl.data.formats import is_template_file_path, read_chat_template
from jaxrl.models.hf import adapter_base_model
from jaxrl.models.resize import clone_chat_template

logger = logging.getLogger("jaxrl")


class TokenizerSetupMixin:
    """`Trainer`'s processing class and its special tokens (subclass hooks:
    `_default_processing_class`, `_load_tokenizer`, `_apply_eos_token`, `_clone_chat_template`)."""

    def _default_processing_class(self) -> Any:
        """The processing class loaded from the model directory when none is given (a PEFT
        adapter directory saved without its tokenizer: its base model's)."""
        from transformers import AutoTokenizer

        path = self.model_path
        base = adapter_base_model(path)
        if base is not None and not os.path.isfile(os.path.join(path, "tokenizer_config.json")):
            path = base
        return AutoTokenizer.from_pretrained(path)

    @property
    def tokenizer(self) -> Any:
        """The tokenizer of `processing_class` (itself, or a processor's `tokenizer`)."""
        return _tokenizer_of(self.processing_class)

    def _load_tokenizer(self, processing_class):
        if processing_class is None:
            if self.model_path is None:
                raise ValueError(
                    "processing_class is required when model is an object; pass the tokenizer."
                )
            processing_class = self._default_processing_class()
        tokenizer = _tokenizer_of(processing_class)  # a processor's options apply to its tokenizer
        # TRL's order: `eos_token` first (so a tokenizer without a pad token pads with the new
        # EOS), then `chat_template_path`, then the pad token.
        if getattr(self.args, "eos_token", None) is not None:
            self._apply_eos_token(tokenizer)
        template_path = getattr(self.args, "chat_template_path", None)
        if template_path is not None and is_template_file_path(template_path):
            processing_class.chat_template = read_chat_template(template_path)
        elif template_path is not None:
            self._clone_chat_template(processing_class, template_path)
        pad = getattr(self.args, "pad_token", None)
        if pad is not None:  # TRL: the config's pad_token overrides the tokenizer's
            if pad not in tokenizer.get_vocab():
                raise ValueError(
                    f"pad_token={pad!r} is not in the tokenizer vocabulary; use an existing token."
                )
            tokenizer.pad_token = pad
        if tokenizer.pad_token is None:
            tokenizer.pad_token = tokenizer.eos_token
        return processing_class

    def _apply_eos_token(self, tokenizer: Any) -> None:
        """TRL's `eos_token` (SFT and reward configs): it becomes the tokenizer's EOS (chat
        templates render it, the EOS appended to standard examples is it, the saved tokenizer
        carries it) and the model config's `eos_token_id`."""
        eos = self.args.eos_token
        if eos not in tokenizer.get_vocab():
            raise ValueError(
                f"eos_token={eos!r} is not in the tokenizer vocabulary; use an existing token "
                f"(the tokenizer's is {tokenizer.eos_token!r})."
            )
        tokenizer.eos_token = eos
        hf_config = getattr(getattr(self.model, "config", None), "hf_config", None)
        if hf_config is not None:
            hf_config.get_text_config().eos_token_id = int(tokenizer.eos_token_id)

    def _clone_chat_template(self, processing_class: Any, path: str) -> None:
        """TRL's `chat_template_path` naming a tokenizer: `clone_chat_template` (its template,
        its added tokens, its EOS; the model's token tables resized to the new vocabulary,
        rounded up to a multiple of 64)."""
        from transformers import ProcessorMixin

        if isinstance(processing_class, ProcessorMixin):
            raise ValueError(
                f"chat_template_path={path!r} names a tokenizer to clone the template of, but the "
                "processing class is a processor (image-text training); give the template as a "
                ".jinja file instead."
            )
        if self.is_peft:
            raise ValueError(
                f"chat_template_path={path!r} clones a tokenizer's template and adds its tokens; "
                "with a LoRA adapter TRL trains the new tokens' embedding rows through PEFT's "
                "`trainable_token_indices`, which jaxrl does not implement. Train in full, or "
                "save that tokenizer's `chat_template` to a .jinja file and pass its path."
            )
        if getattr(getattr(self.model, "config", None), "hf_config", None) is None:
            raise ValueError(
                f"chat_template_path={path!r}: cloning a template resizes the model's "
                "embeddings and sets its config's EOS, which needs a model loaded from a "
                "checkpoint or a transformers config."
            )
        _, _, added = clone_chat_template(self.model, processing_class, path, seed=self.args.seed)
        logger.info(
            "Cloned the chat template of %s: %d tokens added, vocabulary %d.",
            path,
            len(added),
            self.model.config.vocab_size,
        )

    def _mirror_pad_token(self) -> None:
        """TRL: the model agrees with the tokenizer on the pad token from construction, so the
        model config's `pad_token_id` becomes the tokenizer's (saved in config.json; a reward
        model's score position reads it) and, for a model that generates, so does its
        generation config's (`generation_config()`, the exported generation_config.json)."""
        hf_config = getattr(getattr(self.model, "config", None), "hf_config", None)
        if hf_config is not None:
            hf_config.get_text_config().pad_token_id = self.tokenizer.pad_token_id


def _tokenizer_of(processing_class: Any) -> Any:
    """A processor's (`transformers.ProcessorMixin`) tokenizer, or the tokenizer itself."""
    from transformers import ProcessorMixin

    if isinstance(processing_class, ProcessorMixin):
        return processing_class.tokenizer
    return processing_class
