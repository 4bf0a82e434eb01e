"""`RewardConfig`: TRL's `RewardConfig` fields and defaults for `RewardTrainer`.

The fields every trainer shares live in `jaxrl.config.TrainingConfig`; this file adds the reward
model's length, centring and tokenizer fields. Like every config it only describes and validates
a run: it never touches arrays or devices.
"""

import typing
from dataclasses import dataclass

from jaxrl import config_fields
from jaxrl.config import with_foreign
from jaxrl.config_checks import check, resolve_length_buckets
from jaxrl.config_fields import Foreign


@dataclass
class RewardConfig(with_foreign("_RewardForeign", config_fields.REWARD)):
    """TRL `RewardConfig` fields we implement."""

    FOREIGN_FIELDS: typing.ClassVar[tuple[Foreign, ...]] = config_fields.REWARD

    # TRL: keep the activations saved for the backward pass in host memory between the forward
    # and the backward (with `gradient_checkpointing`, each layer's saved input); the same
    # numbers, less device memory, host transfers instead (`models.layers.remat_wrap`).
    activation_offloading: bool = False
    learning_rate: float = 1e-4
    # TRL: pairs whose chosen or rejected sequence exceeds max_length are filtered out.
    max_length: int | None = 1024
    # TRL default True. False: the policy's training forwards apply the model config's dropout
    # (GPT-2's and Phi-3's, any family's attention_dropout; `jaxrl.algos.model_dropout`).
    disable_dropout: bool = True
    dataset_num_proc: int | None = None
    # Eq. 2 of https://huggingface.co/papers/2312.09244: coef * mean((r_chosen + r_rejected)^2).
    center_rewards_coefficient: float | None = None
    pad_token: str | None = None
    # TRL: the tokenizer's EOS (appended to standard chosen/rejected texts, rendered by chat
    # templates) and the model config's `eos_token_id`.
    eos_token: str | None = None
    # TRL: a .jinja / .j2 file whose template replaces the tokenizer's, or a tokenizer (directory
    # or hub id) whose template, added tokens and EOS are cloned (`models.resize.clone_chat_template`).
    chat_template_path: str | None = None
    # jaxrl: the row lengths a step's batch may be padded to (its train micro-batches, all
    # processes; each eval batch alike): the smallest one >= the batch's longest row. The run's
    # static length (the longest example, capped at `max_length`, rounded up to
    # `pad_to_multiple_of`) is always the last; longer entries are unused. "auto": powers of two
    # from 256 below it (rounded up to `pad_to_multiple_of`); None: every batch at the static
    # length (one compiled shape). TRL pads each batch to its own longest row; a few buckets
    # keep most of that saving while jit compiles one program per bucket.
    length_buckets: list[int] | str | None = "auto"

    def __post_init__(self) -> None:
        super().__post_init__()
        resolve_length_buckets(self)
        check(
            self.max_length is None or self.max_length >= 1,
            f"`max_length` must be None or >= 1; got {self.max_length}.",
        )
        check(
            self.dataset_num_proc is None or self.dataset_num_proc >= 1,
            f"`dataset_num_proc` must be None or >= 1; got {self.dataset_num_proc}.",
        )
        check(
            self.center_rewards_coefficient is None or self.center_rewards_coefficient >= 0,
            f"`center_rewards_coefficient` must be None or >= 0; got "
            f"{self.center_rewards_coefficient}.",
        )

