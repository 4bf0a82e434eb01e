"""What leaves a trainer: `save_model` (an HF directory with the tokenizer, the generation config,
jaxrl_config.json and a model card; with LoRA the PEFT adapter alone, or merged), TRL's
`create_model_card`, and the Hub (`push_to_hub`, HF's `hub_strategy` at each save, the
`accelerator` TRL's scripts print with).

`SaveModelMixin` is `save_model` alone, shared with `PPOTrainer` (which writes TRL v0.7.2's
value-head files and card through its hooks); `ExportMixin` adds the card and the Hub and is one
of the pieces `jaxrl.trainers.base.Trainer` is composed of. The file formats
are `jaxrl.models`' and `jaxrl.lora`'s, the card `jaxrl.model_card`'s and the uploads
`jaxrl.hub`'s. Only process 0 writes. No training or checkpoint code here.
"""

from __future__ import annotations

import json
import os
from typing import Any

import jax

from jaxrl import hub, lora, models
from jaxrl.model_card import card_fields, model_card


class SaveModelMixin:
    """`save_model`, written once for every language-model trainer: the weights
    (`_save_weights`), the tokenizer, then the files beside them (`_save_metadata`). PPO keeps
    TRL v0.7.2's value-head files and card by overriding the two hooks."""

    def save_model(self, output_dir: str | None = None, merged: bool = False):
        """Write an HF directory (config, safetensors, tokenizer), from process 0 only, into
        `output_dir` (default `args.output_dir`, as HF's `Trainer.save_model`, so
        `from_pretrained(args.output_dir)` loads it; the CLI passes `OUTPUT_DIR/final`). With
        LoRA, as TRL with PEFT: the adapter alone (`adapter_config.json` +
        `adapter_model.safetensors`, `base_model_name_or_path` = the model path), or with
        `merged=True` the full model with the adapters folded in (PEFT's `merge_and_unload`)."""
        out = output_dir or self.args.output_dir
        if merged and not self.is_peft:
            raise ValueError("save_model(merged=True) merges LoRA adapters; this model has none.")
        self._save_weights(out, merged)
        if self.is_world_process_zero():
            self.processing_class.save_pretrained(out)
            self._save_metadata(out, merged)
        return out

    def _save_weights(self, out: str, merged: bool) -> None:
        if self.is_peft and not merged:
            lora.save_peft_adapter(self.current_model(), out, self.model_path)
        elif self.is_peft:
            models.save_pretrained(lora.merge_lora(self.current_model()), out)
        else:
            models.save_pretrained(self.current_model(), out)

    def _save_metadata(self, out: str, merged: bool) -> None:
        """`jaxrl_config.json`, the generation config and the model card (process 0)."""
        with open(os.path.join(out, "jaxrl_config.json"), "w") as f:
            json.dump(self.args.to_dict(), f, indent=2, default=str)
        adapter_only = self.is_peft and not merged
        if self.model_task == "causal_lm" and not adapter_only:
            # As transformers' save_pretrained for a model that can generate. Our own edits
            # (pad/EOS ids) must not make transformers validate a source config strictly: it
            # refuses to save a modified config that only warns (e.g. top_k without
            # do_sample), and saves an unmodified one back as it was published.
            generation_config = self._export_generation_config(out)
            generation_config._original_object_hash = hash(generation_config)
            generation_config.save_pretrained(out)
        self._write_model_card(out, library_name="peft" if adapter_only else "transformers")


class ExportMixin(SaveModelMixin):
    """`Trainer`'s export and Hub surface (subclass hooks: `_export_generation_config`; the model
    card's `_name`, `_tag_names`, `_paper`)."""

    def _export_generation_config(self, out: str) -> Any:
        """The source model's `generation_config.json` if it has one (local or cached), else
        derived from the exported config.json as transformers does when it loads a model; its
        `pad_token_id` is the tokenizer's (TRL mirrors it)."""
        from transformers import AutoConfig, GenerationConfig

        config = None
        if self.model_path is not None:
            try:
                config = GenerationConfig.from_pretrained(self.model_path, local_files_only=True)
            except OSError:
                pass  # the source has none: derive it below
        if config is None:
            config = GenerationConfig.from_model_config(AutoConfig.from_pretrained(out))
        config.pad_token_id = self.tokenizer.pad_token_id  # TRL mirrors the tokenizer's
        return config

    # What the model card says about the trainer (TRL's class attributes of the same names).
    _name = "Trainer"
    _tag_names: tuple[str, ...] = ("trl",)
    _paper: dict[str, str] = {}

    def create_model_card(
        self,
        model_name: str | None = None,
        dataset_name: str | None = None,
        tags: str | list[str] | None = None,
    ) -> None:
        """TRL's `create_model_card`: write `README.md` into `output_dir` (process 0)."""
        if jax.process_index() == 0:
            self._write_model_card(
                self.args.output_dir, model_name=model_name, dataset_name=dataset_name, tags=tags
            )

    def _write_model_card(
        self,
        folder: str,
        library_name: str = "transformers",
        model_name: str | None = None,
        dataset_name: str | None = None,
        tags: str | list[str] | None = None,
    ) -> None:
        fields = card_fields(self)
        fields["model_name"] = model_name or fields["model_name"]
        fields["tags"] += [tags] if isinstance(tags, str) else list(tags or [])
        pipeline = "text-generation" if self.model_task == "causal_lm" else "text-classification"
        card = model_card(
            **fields, dataset_name=dataset_name, library_name=library_name, pipeline_tag=pipeline
        )
        os.makedirs(folder, exist_ok=True)
        with open(os.path.join(folder, "README.md"), "w") as f:
            f.write(card)

    @property
    def accelerator(self) -> Any:
        """The bits of accelerate's `Accelerator` TRL scripts use (`print` on process 0)."""
        return hub.ScriptAccelerator(self.is_world_process_zero())

    @property
    def hub_model_id(self) -> str | None:
        return self.args.hub_model_id

    def push_to_hub(self, commit_message: str | None = "End of training", **kwargs) -> str | None:
        """Save the final model to `output_dir` and upload it to `args.hub_model_id` (process 0).

        TRL's model-card keywords (`dataset_name`, `tags`, ...) go into the README's metadata."""
        self.save_model(self.args.output_dir)
        card_keys = ("model_name", "dataset_name", "tags")
        self.create_model_card(**{k: kwargs[k] for k in card_keys if k in kwargs})
        if not self.is_world_process_zero():
            return None
        return hub.push_folder(self.args, self.args.output_dir, commit_message)

    def _push_from_checkpoint(self, step: int) -> None:
        """HF's `hub_strategy` at a save: "every_save" uploads the model (saved to `output_dir`),
        "checkpoint" also the checkpoint as `last-checkpoint/`, "all_checkpoints" each one as
        `checkpoint-STEP/`; "end" uploads nothing until `push_to_hub()`. Synchronous (HF pushes
        in the background), after the checkpoint's async write has finished."""
        a = self.args
        if not hub.pushes_on_save(a.hub_strategy):
            return
        self.save_model(a.output_dir)  # a collective on multi-host: every process joins
        target = hub.checkpoint_path_in_repo(a.hub_strategy, step)
        if target is not None:
            self._checkpointer().wait_until_finished()
        if not self.is_world_process_zero():
            return
        message = f"Training in progress, step {step}"
        hub.push_folder(a, a.output_dir, message)
        if target is not None:
            folder = str(self._checkpointer().step_dir(step))
            hub.push_folder(a, folder, message, path_in_repo=target)
