"""`SFTConfig`: TRL's `SFTConfig` fields and defaults for `SFTTrainer`.

The fields every trainer shares live in `jaxrl.config.TrainingConfig`; this file adds SFT's
dataset, packing, truncation and loss fields, with TRL's validation and deprecation warnings.
Like every config it only describes and validates a run: it never touches arrays or devices.
"""

import json
import typing
import warnings
from dataclasses import dataclass

from jaxrl import config_fields
from jaxrl.config import ConfigError, with_foreign
from jaxrl.config_checks import (
    PACKING_STRATEGIES,
    SFT_LOSS_TYPES,
    TRUNCATION_MODES,
    check,
    check_choice,
    resolve_length_buckets,
)
from jaxrl.config_fields import Foreign


@dataclass
class SFTConfig(with_foreign("_SFTForeign", config_fields.SFT)):
    """TRL `SFTConfig` fields we implement."""

    FOREIGN_FIELDS: typing.ClassVar[tuple[Foreign, ...]] = config_fields.SFT
    # HF TrainingArguments fields that the other trainers reject and SFT implements.
    IMPLEMENTED_FIELDS: typing.ClassVar[tuple[str, ...]] = ("label_smoothing_factor",)

    # TRL: keep the activations saved for the backward pass in host memory between the forward
    # and the backward (with `gradient_checkpointing`, each layer's saved input); the same
    # numbers, less device memory, host transfers instead (`models.layers.remat_wrap`).
    activation_offloading: bool = False
    learning_rate: float = 2e-5
    dataset_text_field: str = "text"
    max_length: int | None = 1024
    # Deprecated alias of max_length (older TRL); warns and maps.
    max_seq_length: int | None = None
    packing: bool = False
    packing_strategy: str = "bfd"
    # TRL: each device's share of a micro-batch runs as one row, its examples back to back
    # (positions restarting at 0, attention kept within each example), padded only to a
    # `length_buckets` bucket of such rows. Needs `max_length=None` unless packing (TRL); best-fit
    # packing (`"bfd"`, `"bfd_split"`) is padding-free already.
    padding_free: bool = False
    # TRL: {"skip_prepare_dataset": True} uses already-tokenized rows as given (`rows_as_given`);
    # TRL reads no other key. A JSON string is parsed (CLI).
    dataset_kwargs: dict | str | None = None
    # TRL: whether the eval (and predict) datasets are packed; None follows `packing`.
    eval_packing: bool | None = None
    # TRL: shuffle each prepared dataset with `seed` (also before packing, so that different
    # documents share rows). Training batches are a seeded permutation either way.
    shuffle_dataset: bool = False
    completion_only_loss: bool | None = None
    assistant_only_loss: bool = False
    dataset_num_proc: int | None = None
    eos_token: str | None = None
    pad_token: str | None = None
    # TRL: a .jinja / .j2 file whose template replaces the tokenizer's, or a tokenizer (directory
    # or hub id) whose template, added tokens and EOS are cloned (`models.resize.clone_chat_template`).
    chat_template_path: str | None = None
    # TRL 1.16: "keep_start" keeps a long sequence's first `max_length` tokens, "keep_end"
    # (deprecated there) its last ones. Unpacked rows only: packing cuts into rows instead.
    truncation_mode: str = "keep_start"
    # "nll", or "dft" (Dynamic Fine-Tuning, https://huggingface.co/papers/2508.05629: each
    # token's NLL scaled by its probability, without gradient). "chunked_nll" is TRL's
    # deprecated alias of "nll".
    loss_type: str = "nll"
    # HF's label smoothing (`LabelSmoother`), which TRL 1.16's SFTTrainer applies with the NLL
    # loss (deprecated there): (1 - eps) x NLL + eps x the mean over tokens of
    # -(1/V) sum_v log p_v. jaxrl computes it in the fused LM head (no full logits).
    label_smoothing_factor: float = 0.0
    # TRL: weight of the MoE load-balancing loss (transformers' `aux_loss`) added to the loss;
    # None takes the model config's own `router_aux_loss_coef`, 0.0 turns it off; nonzero on a
    # model without MoE layers is an error (`jaxrl.algos.router_aux`).
    router_aux_loss_coef: float | None = None
    # jaxrl: the row lengths a step's batch may be padded to (its train micro-batches, all
    # processes; each eval batch alike): the smallest one >= the batch's longest row. The run's
    # static length (the longest example, capped at `max_length`, rounded up to
    # `pad_to_multiple_of`) is always the last; longer entries are unused. "auto": powers of two
    # from 256 below it (rounded up to `pad_to_multiple_of`); None: every batch at the static
    # length (one compiled shape). TRL pads each batch to its own longest row; a few buckets
    # keep most of that saving while jit compiles one program per bucket. Packed rows
    # (`packing`, `eval_packing`) fill the static length by construction and always use it.
    # With `padding_free`, the lengths are those of the flattened rows (one per device); "auto"
    # then also has the midpoints 1.5 x 2^k between the powers of two.
    length_buckets: list[int] | str | None = "auto"

    @property
    def skip_prepare_dataset(self) -> bool:
        """TRL's `dataset_kwargs["skip_prepare_dataset"]`."""
        return bool((self.dataset_kwargs or {}).get("skip_prepare_dataset", False))

    def __post_init__(self) -> None:
        super().__post_init__()
        resolve_length_buckets(self)
        check(
            0.0 <= self.label_smoothing_factor < 1.0,
            f"`label_smoothing_factor` must be in [0, 1); got {self.label_smoothing_factor}.",
        )
        check_choice("truncation_mode", self.truncation_mode, TRUNCATION_MODES)
        if isinstance(self.dataset_kwargs, str):
            try:
                self.dataset_kwargs = json.loads(self.dataset_kwargs)
            except json.JSONDecodeError as e:
                raise ConfigError(
                    f"`dataset_kwargs` must be a dict or a JSON object string; got "
                    f"{self.dataset_kwargs!r} ({e})."
                ) from None
        if self.dataset_kwargs is not None:
            check(
                isinstance(self.dataset_kwargs, dict),
                f"`dataset_kwargs` must be a dict; got {self.dataset_kwargs!r}.",
            )
            unknown = sorted(set(self.dataset_kwargs) - {"skip_prepare_dataset"})
            check(
                not unknown,
                f"`dataset_kwargs` keys {unknown} are not read by TRL's SFTTrainer (nor by jaxrl); "
                "the only key is 'skip_prepare_dataset'.",
            )
            check(
                not (self.skip_prepare_dataset and (self.packing or self.eval_packing)),
                "`dataset_kwargs={'skip_prepare_dataset': True}` uses the rows as given, and "
                "packing happens in the preparation it skips; pack the data yourself, or set "
                "`packing=False` (and `eval_packing`).",
            )
        if self.truncation_mode == "keep_end":
            warnings.warn(
                "truncation_mode='keep_end' is deprecated in TRL 1.16 (to be removed in TRL 2.0); "
                "the default 'keep_start' keeps each sequence's first tokens.",
                FutureWarning,
                stacklevel=3,
            )
        if self.loss_type == "chunked_nll":
            warnings.warn(
                "loss_type='chunked_nll' is TRL's deprecated alias of 'nll'; use 'nll'.",
                FutureWarning,
                stacklevel=3,
            )
            self.loss_type = "nll"
        check_choice("loss_type", self.loss_type, SFT_LOSS_TYPES)
        check(
            not (self.label_smoothing_factor and self.loss_type == "dft"),
            "`label_smoothing_factor` smooths the NLL loss; TRL ignores it with `loss_type='dft'`. "
            "Set one of them back to its default.",
        )
        if self.max_seq_length is not None:
            warnings.warn(
                "`max_seq_length` is deprecated; use `max_length` instead.",
                FutureWarning,
                stacklevel=3,
            )
            self.max_length = self.max_seq_length
            self.max_seq_length = None
        check(
            self.max_length is None or self.max_length >= 1,
            f"`max_length` must be None or >= 1; got {self.max_length}.",
        )
        check(
            not (self.packing and self.max_length is None),
            "`packing=True` needs `max_length` (the packed sequence length).",
        )
        if self.packing_strategy == "bfd-requeue":  # TRL 1.16's deprecated name
            warnings.warn(
                "The `bfd-requeue` packing strategy has been renamed to `bfd_split`. Please update "
                "your configuration accordingly.",
                FutureWarning,
                stacklevel=3,
            )
            self.packing_strategy = "bfd_split"
        check_choice("packing_strategy", self.packing_strategy, PACKING_STRATEGIES)
        check(
            self.dataset_num_proc is None or self.dataset_num_proc >= 1,
            f"`dataset_num_proc` must be None or >= 1; got {self.dataset_num_proc}.",
        )

