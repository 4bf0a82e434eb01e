"""`KTOConfig`: TRL 1.16's `KTOConfig` fields and defaults for `KTOTrainer`.

The fields every trainer shares live in `jaxrl.config.TrainingConfig`; this file adds KTO's loss,
reference-model and length fields with TRL's validation. Like every config it only describes and
validates a run: it never touches arrays or devices.
"""

from dataclasses import dataclass

from jaxrl.algos.kto import LOSS_TYPES, estimates_kl
from jaxrl.config import TrainingConfig
from jaxrl.config_checks import check, check_choice, resolve_length_buckets


@dataclass
class KTOConfig(TrainingConfig):
    """TRL `KTOConfig` fields (all of them implemented)."""

    learning_rate: float = 1e-6
    # TRL: the loss types that estimate the KL term need the fixed order in which each row's KL
    # completion was assigned from its neighbours (`jaxrl.data.kto`).
    train_sampling_strategy: str = "sequential"
    # TRL default True. False: the policy's training forwards apply the model config's dropout.
    disable_dropout: bool = True
    # TRL: weight of the MoE load-balancing loss added to the loss; None takes the model config's
    # own `router_aux_loss_coef`, 0.0 turns it off (`jaxrl.algos.router_aux`).
    router_aux_loss_coef: float | None = None
    dataset_num_proc: int | None = None
    # TRL: each `prompt + completion` (and KL) sequence is cut to its first max_length tokens;
    # rows whose prompt alone has max_length tokens or more are dropped.
    max_length: int | None = 1024
    precompute_ref_log_probs: bool = False
    precompute_ref_batch_size: int | None = None
    loss_type: str = "kto"
    beta: float = 0.1
    desirable_weight: float = 1.0
    undesirable_weight: float = 1.0
    # TRL: keep the activations saved for the backward pass in host memory (same numbers, less
    # device memory; `models.layers.remat_wrap`).
    activation_offloading: bool = False
    # TR-DPO (https://huggingface.co/papers/2404.09656): ref <- alpha*policy + (1-alpha)*ref
    sync_ref_model: bool = False
    ref_model_mixup_alpha: float = 0.6
    ref_model_sync_steps: int = 512
    # jaxrl: the row lengths a step's batch may be padded to (as DPOConfig's `length_buckets`);
    # a row here is the longer of a `prompt + completion` and its KL row.
    length_buckets: list[int] | str | None = "auto"

    def __post_init__(self) -> None:
        super().__post_init__()
        resolve_length_buckets(self)
        check_choice("loss_type", self.loss_type, LOSS_TYPES)
        check(self.beta > 0, f"`beta` must be > 0; got {self.beta}.")
        for name in ("desirable_weight", "undesirable_weight"):
            value = getattr(self, name)
            check(value >= 0, f"`{name}` must be >= 0; got {value}.")
        if estimates_kl(self.loss_type):
            check(
                self.train_sampling_strategy == "sequential",
                f"`loss_type={self.loss_type!r}` estimates the KL term from each row's KL "
                "completion, assigned from its neighbours in a fixed-order batch, so it needs "
                "`train_sampling_strategy='sequential'` (TRL's default for KTO); got "
                f"{self.train_sampling_strategy!r}. Use 'sequential', or "
                "loss_type='apo_zero_unpaired'.",
            )
            check(
                self.per_device_train_batch_size > 1,
                "`per_device_train_batch_size` must be > 1 for KTO's KL estimate (with one row "
                "per batch the KL row would be the row itself, and the KL term its implied "
                "reward); raise it, or use loss_type='apo_zero_unpaired'.",
            )
        check(
            self.max_length is None or self.max_length >= 1,
            f"`max_length` must be None or >= 1; got {self.max_length}.",
        )
        check(
            not (self.sync_ref_model and self.precompute_ref_log_probs),
            "`sync_ref_model=True` cannot be combined with `precompute_ref_log_probs=True`: the "
            "precomputed log-probs would go stale when the reference syncs. Disable one of them.",
        )
        check(
            0.0 <= self.ref_model_mixup_alpha <= 1.0,
            f"`ref_model_mixup_alpha` must be in [0, 1]; got {self.ref_model_mixup_alpha}.",
        )
        check(
            self.ref_model_sync_steps >= 1,
            f"`ref_model_sync_steps` must be >= 1; got {self.ref_model_sync_steps}.",
        )
        for name in ("precompute_ref_batch_size", "dataset_num_proc"):
            value = getattr(self, name)
            check(value is None or value >= 1, f"`{name}` must be None or >= 1; got {value}.")
