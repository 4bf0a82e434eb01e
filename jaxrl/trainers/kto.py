"""KTOTrainer: Kahneman-Tversky optimisation with TRL 1.16 `KTOTrainer` semantics.

Unpaired preference data (`prompt`, `completion`, boolean `label`; paired `chosen`/`rejected`
data is unpaired as TRL does, `jaxrl.data.kto`) trains the policy on the offline step: one jitted
step runs the policy forward over the rows, the policy's KL rows without gradient, and the
reference forward over both (a frozen copy of the initial policy held in the train state, an
explicit `ref_model`, the LoRA base with the adapter off, or log-probs precomputed once). The
traced math is `jaxrl.algos.kto`; this file is the host shell around it: data, collation, where
the reference lives, precomputation and the predictions. Metrics use TRL's names.
"""

from __future__ import annotations

import logging
from typing import Any

import datasets
import jax
import numpy as np
from flax import nnx

from jaxrl.algos import kto as kto_algo
from jaxrl.callbacks.sync_ref import SyncRefModelCallback
from jaxrl.data.kto import collate_unpaired, prepare_unpaired_dataset, weight_advice
from jaxrl.trainers.base import Trainer
from jaxrl.trainers.kto_config import KTOConfig
from jaxrl.trainers.reference_model import ReferenceModelMixin

logger = logging.getLogger("jaxrl")


class KTOTrainer(ReferenceModelMixin, Trainer):
    """Kahneman-Tversky optimisation (TRL `KTOTrainer` API; `args` is a `KTOConfig`)."""

    config_class = KTOConfig
    _name = "KTO"
    _tag_names = ("trl", "kto")
    _paper = {
        "title": "KTO: Model Alignment as Prospect Theoretic Optimization",
        "id": "2402.01306",
    }

    def __init__(self, model: Any, ref_model: Any = None, args: KTOConfig | None = None, *a, **kw):
        args = args if args is not None else KTOConfig(output_dir="trainer_output")
        if not isinstance(args, KTOConfig):
            raise TypeError(f"args must be a KTOConfig, got {type(args).__name__}.")
        if ref_model is not None and ref_model is model:
            raise ValueError(
                "`model` and `ref_model` cannot be the same object; omit `ref_model` and the "
                "trainer uses a frozen copy of the initial model as the reference."
            )
        self._ref_model_arg = ref_model
        super().__init__(model, args, *a, **kw)
        if self.is_peft and args.sync_ref_model:
            raise ValueError(
                "sync_ref_model=True is not supported with LoRA (peft_config), as in TRL: the "
                "reference is the base model without the adapter, there is no separate reference "
                "to synchronise. Use sync_ref_model=False, or full fine-tuning."
            )
        self._explicit_ref = None
        self._ref_graphdef = None
        if ref_model is not None and not args.precompute_ref_log_probs:
            self._explicit_ref = self._load_model(ref_model, task="causal_lm")
        advice = weight_advice(
            self.train_dataset["label"] if self.train_dataset is not None else [],
            args.desirable_weight,
            args.undesirable_weight,
        )
        if advice:
            logger.warning(advice)
        if args.precompute_ref_log_probs:
            self._precompute_all()
        if args.sync_ref_model:
            self.callback_handler.add_callback(SyncRefModelCallback())

    @property
    def with_kl(self) -> bool:
        """Whether the loss estimates the KL term (TRL's `calculate_KL`): KL rows exist."""
        return kto_algo.estimates_kl(self.args.loss_type)

    @property
    def _ref_is_base(self) -> bool:
        """LoRA without an explicit reference: the reference is the base without the adapter."""
        return self.is_peft and self._ref_model_arg is None

    @property
    def uses_ref_params(self) -> bool:
        return not self.args.precompute_ref_log_probs

    def _models_prepared_at_init(self) -> bool:
        # TRL prepares its reference model, which it has unless PEFT or precomputed log-probs
        # stand in for it.
        return self.uses_ref_params and not self._ref_is_base

    # ----------------------------------------------------------------- data
    def _prepare_dataset(self, dataset: Any, split: str) -> datasets.Dataset:
        a = self.args
        dataset = self._load_data(dataset, split)
        if not isinstance(dataset, datasets.Dataset):
            raise TypeError(
                f"The KTO {split} dataset must be a datasets.Dataset (or a path / hub id of one); "
                f"got {type(dataset).__name__}."
            )
        return prepare_unpaired_dataset(
            dataset,
            self.processing_class,
            max_length=a.max_length,
            # TRL rotates the completions within blocks of the training batch size, for the
            # eval set too.
            kl_batch_size=a.per_device_train_batch_size if self.with_kl else None,
            num_proc=a.dataset_num_proc,
        )

    def _example_lengths(self, dataset: datasets.Dataset) -> list[int]:
        p = [len(x) for x in dataset["prompt_ids"]]
        widths = [len(x) for x in dataset["completion_ids"]]
        if self.with_kl:
            kl = (len(x) for x in dataset["KL_completion_ids"])
            widths = [max(w, k) for w, k in zip(widths, kl, strict=True)]
        cap = self.args.max_length
        lengths = [pi + w for pi, w in zip(p, widths, strict=True)]
        return lengths if cap is None else [min(n, cap) for n in lengths]

    def _collate(self, examples: list[dict], seq_len: int | None = None) -> dict[str, np.ndarray]:
        return collate_unpaired(
            examples,
            seq_len or self.seq_len,
            self.tokenizer.pad_token_id,
            max_length=self.args.max_length,
            with_kl=self.with_kl,
        )

    # ----------------------------------------------------------------- reference model
    @property
    def _ref_logps(self):
        """`(state, mb) -> (main, KL)`: the reference's log-probs of a micro-batch."""
        return kto_algo.make_reference_logps(
            self.args, self._bind_reference, lora_base=self._ref_is_base, with_kl=self.with_kl
        )

    # ----------------------------------------------------------------- loss
    def _loss_fn(self):
        return kto_algo.make_loss(
            self.args,
            self.apply_model,
            ref_logps=self._ref_logps,
            router_aux_coef=self.router_aux_loss_coef,
        )

    def _loss_units(self):
        return kto_algo.loss_units

    _nan_allowed_metrics = kto_algo.LABEL_METRICS

    def _train_iteration(self, item) -> dict:
        # Device-side: the loop reads the metrics one step late.
        return kto_algo.with_absent_as_nan(super()._train_iteration(item))

    def _prediction_fn(self):
        return kto_algo.predict

    # ----------------------------------------------------------------- precompute
    def _precompute_all(self) -> None:
        """One pass of the reference over the train and eval sets before training (TRL's
        `precompute_ref_log_probs`): columns `ref_logps` (and `ref_KL_logps`)."""
        ref = self._ref_model_arg
        ref_model = self._load_model(ref, task="causal_lm") if ref is not None else self.model
        graphdef, params = nnx.split(ref_model)
        with_kl = self.with_kl
        # LoRA without a ref_model: the reference is the base with the adapter disabled.
        ref_logps = jax.jit(
            kto_algo.make_precompute_logps(
                graphdef, self.args, with_kl=with_kl, lora_base=self._ref_is_base
            )
        )
        a = self.args
        for name, per_device in (
            ("train_dataset", a.per_device_train_batch_size),
            ("eval_dataset", a.per_device_eval_batch_size),
        ):
            ds = getattr(self, name)
            if ds is None:
                continue
            bs = (a.precompute_ref_batch_size or per_device) * self.dp
            out = self._run_precompute(ds, bs, params, ref_logps)
            ds = ds.add_column("ref_logps", out[:, 0].tolist())
            if with_kl:
                ds = ds.add_column("ref_KL_logps", out[:, 1].tolist())
            setattr(self, name, ds)
