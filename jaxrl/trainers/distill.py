"""DistillationTrainer: on-policy distillation with TRL 1.16 `DistillationTrainer` semantics.

On the one online shell (`jaxrl.trainers.online.OnlineLoop`): each optimizer step samples one
completion per prompt of a generation batch (`per_device_train_batch_size x data-parallel
devices x gradient_accumulation_steps` prompts, TRL's effective batch) from the student with
jaxrl's sampler (the student's own params, never a copy), runs the frozen teacher over
`prompt + completion` once (the scoring pass: its final hidden states at the completion
positions), shuffles the rows (TRL's `shuffle_sequence_dict`) and splits them into the
`gradient_accumulation_steps` micro-batches of one jitted `make_train_step` call, whose loss is
`jaxrl.algos.distill` (TRL's generalised JSD over the vocabulary, chunked: never a full f32
`[B, C, V]` of either model). Completions end at the first EOS (kept in the loss), as TRL; the
prompt tokens are never in the loss.

The teacher lives in the train state (`state.frozen["teacher"]`, sharded on the student's mesh
by the same rules; optionally int8, `teacher_model_quantization`): any family jaxrl loads, any
width or depth, with the student's vocabulary size (TRL's requirement; a teacher with another
vocabulary is refused, as TRL, which points to GOLD for cross-tokenizer distillation).

Logged (TRL's names): `loss`, `entropy` (the student's, over the completion tokens), `num_tokens`,
`completions/{mean,min,max}_length`, `completions/clipped_ratio`,
`completions/{mean,min,max}_terminated_length`, `grad_norm`, `learning_rate`; `evaluate()` the
same with `eval_`, plus (jaxrl's) `eval_greedy/exact_match` when the eval rows have a
`completion` column: the share of greedy completions equal to it (the embedded task's held-out
accuracy).
"""

from __future__ import annotations

import dataclasses
import math
import os
import time
from collections import defaultdict, deque
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxrl import parallel
from jaxrl.algos import distill
from jaxrl.algos.rollout import make_buffer_step
from jaxrl.callbacks.base import TrainerCallback
from jaxrl.callbacks.completions import write_completions_log
from jaxrl.core import quant
from jaxrl.core.step import make_eval_step, make_train_step, reduce_aux
from jaxrl.generation import GenerationConfig, Sampler
from jaxrl.trainers.base import Trainer
from jaxrl.trainers.distill_config import DistillationConfig
from jaxrl.trainers.evaluation import hf_eval_loss, speed_metrics
from jaxrl.trainers.online import OnlineLoop
from jaxrl.trainers.onpolicy_batches import OnPolicyBatchesMixin, StepPlan
from jaxrl.trainers.onpolicy_logging import CompletionLogsMixin
from jaxrl.trainers.onpolicy_prompts import PROMPT_IDS, OnPolicyPromptsMixin
from jaxrl.trainers.unsupported import refuse as refuse_unsupported

_completion_metrics = CompletionLogsMixin._completion_metrics


class DistillationTrainer(OnPolicyPromptsMixin, OnPolicyBatchesMixin, OnlineLoop, Trainer):
    """TRL `DistillationTrainer` API: `DistillationTrainer(model, teacher_model,
    args=DistillationConfig(...), train_dataset=..., eval_dataset=..., processing_class=...)`.
    The dataset needs a `prompt` column (standard or conversational); other columns are
    ignored."""

    config_class = DistillationConfig
    _metric_prefix_eval = "eval"
    _paper = {
        "title": "On-Policy Distillation of Language Models: Learning from Self-Generated Mistakes",
        "id": "2306.13649",
    }

    def __init__(
        self,
        model: Any,
        teacher_model: Any = None,
        args: DistillationConfig | None = None,
        train_dataset: Any = None,
        eval_dataset: Any = None,
        processing_class: Any = None,
        callbacks: list[TrainerCallback] | None = None,
        optimizers: tuple[optax.GradientTransformation | None, Callable | None] = (None, None),
        quantization_config: Any = None,
        peft_config: Any = None,
        tools: list[Callable] | None = None,
        **unsupported: Any,
    ):
        refuse_unsupported(type(self).__name__, unsupported)
        args = args if args is not None else DistillationConfig(output_dir="trainer_output")
        if not isinstance(args, DistillationConfig):
            raise TypeError(f"args must be a DistillationConfig, got {type(args)}.")
        if tools:
            raise ValueError(
                "tools are not supported by jaxrl's DistillationTrainer (no tool-calling loop in "
                "its sampler); drop `tools`."
            )
        teacher_model = (
            teacher_model if teacher_model is not None else args.teacher_model_name_or_path
        )
        if teacher_model is None:
            raise ValueError(
                "A teacher model is required for distillation: pass `teacher_model` (a path, "
                "hub id or jaxrl model) or set `teacher_model_name_or_path`."
            )
        # OnPolicyPromptsMixin's image-prompt hooks: text prompts only here.
        self.vision = False
        self._prompt_images = None
        self.max_images = 0
        super().__init__(
            model,
            args,
            train_dataset=train_dataset,
            eval_dataset=eval_dataset,
            processing_class=processing_class,
            callbacks=callbacks,
            optimizers=optimizers,
            peft_config=peft_config,
            quantization_config=quantization_config,
        )
        a = self.args
        self._teacher = self._load_teacher(teacher_model)
        self._teacher_graphdef = nnx.graphdef(self._teacher)
        # TRL's generation batch: the whole effective batch, generated once per optimizer step.
        self.generation_batch_size = (
            a.per_device_train_batch_size * self.dp * a.gradient_accumulation_steps
        )
        self.steps_per_generation = a.gradient_accumulation_steps
        self.generate_every = a.gradient_accumulation_steps
        self.eos_token_ids = self._eos_token_ids()
        self.rollout_generation_config = self._rollout_generation_config()
        self.rollout_sampler: Sampler | None = None
        self.rollout: dict[str, jax.Array] | None = None
        self._buffer_generation = -1
        self._buffer_metrics: dict[str, float] = {}
        self._buffer_tokens = 0.0
        # TRL's `_logs`: the prompts and completions of the latest generation batch.
        self.completion_logs = {
            "prompt": deque(maxlen=self.generation_batch_size),
            "completion": deque(maxlen=self.generation_batch_size),
        }
        # The loop reads a step's metrics (and logs) one step late, after the next step has
        # generated: each step keeps a copy of the completions its log must show.
        self._completion_logs_at: dict[int, dict[str, list]] = {}
        if a.log_completions and self.is_world_process_zero():
            os.makedirs(os.path.join(a.output_dir, "completions"), exist_ok=True)

    # ----------------------------------------------------------------- teacher
    def _load_teacher(self, teacher: Any) -> Any:
        """The teacher on the student's mesh, checked to be a causal LM over the student's
        vocabulary (TRL compares `vocab_size`)."""
        try:
            model = self._load_model(teacher, task="causal_lm")
        except (ValueError, KeyError, OSError) as e:
            raise ValueError(
                f"Could not load the teacher model {teacher!r} as a causal language model ({e}). "
                "The teacher must be a causal LM checkpoint of a family jaxrl supports "
                "(AutoModelForCausalLM-style), or a jaxrl causal LM."
            ) from e
        if not callable(getattr(model, "unembed_weight", None)) or not hasattr(
            model, "hidden_states"
        ):
            raise ValueError(
                f"The teacher model ({type(model).__name__}) is not a causal language model: "
                "distillation needs its next-token distribution (an LM head). Pass a causal LM "
                "as teacher_model."
            )
        dtype = self.args.teacher_model_init_kwargs or {}
        dtype = dtype.get("dtype", dtype.get("torch_dtype"))
        if dtype not in (None, "auto"):
            params = nnx.state(model)
            nnx.update(
                model,
                jax.tree.map(
                    lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x,
                    params,
                ),
            )
        student_vocab = self.model.config.vocab_size
        teacher_vocab = model.config.vocab_size
        if student_vocab != teacher_vocab:
            raise ValueError(
                f"The student model has vocab_size {student_vocab} but the teacher model has "
                f"vocab_size {teacher_vocab}. Distillation compares the teacher's full next-token "
                "distribution, which requires a shared vocabulary. Use a teacher with the same "
                "vocab_size (and tokenizer), or GOLD for cross-tokenizer distillation."
            )
        return model

    def _bind_teacher(self, teacher_params: Any) -> Any:
        # int8 leaves stay quantized: the model dequantizes each weight where it is used.
        return nnx.merge(self._teacher_graphdef, teacher_params)

    def _frozen_params(self, params: Any) -> dict[str, Any]:
        teacher = nnx.state(self._teacher)
        if self.args.teacher_model_quantization == "int8":
            teacher = quant.quantize_params(teacher)
        self._teacher = None  # the state holds the weights from here on
        return {**super()._frozen_params(params), distill.TEACHER: teacher}

    # ----------------------------------------------------------------- data and sizes
    def _prepare_dataset(self, dataset: Any, split: str):
        dataset = self._load_data(dataset, split)
        columns = getattr(dataset, "column_names", None)
        if columns is not None and "prompt" not in columns:
            raise ValueError(
                f"The {split} dataset has columns {columns} but distillation needs a 'prompt' "
                "column (a string, or a list of chat messages); the completions are generated."
            )
        return super()._prepare_dataset(dataset, split)

    @property
    def prompts_per_generation(self) -> int:
        return self.generation_batch_size  # one completion per prompt (TRL: n = 1)

    # ----------------------------------------------------------------- compiled pieces
    def _loss_fn(self):
        return distill.make_loss(self.args, self.apply_model, self._bind_teacher)

    def _compile(self, state) -> None:
        state_sh = self._state_shardings(state)
        repl = NamedSharding(self.mesh, P())
        step = make_train_step(
            self._with_model_dropout(self._with_lora_dropout(self._loss_fn())),
            self.tx,
            self.schedule,
            self._state_updates(),
        )
        self._jit_train_step = jax.jit(
            make_buffer_step(step, self.steps_per_generation),
            in_shardings=(state_sh, None, None),
            out_shardings=(state_sh, repl),
            donate_argnums=0,
        )
        teacher_hidden = distill.make_teacher_hidden(self._bind_teacher)
        self._jit_teacher_hidden = jax.jit(
            lambda state, batch: teacher_hidden(state.frozen[distill.TEACHER], batch)
        )
        self._jit_eval_step = jax.jit(make_eval_step(self._loss_fn()), out_shardings=repl)
        self.rollout_sampler = Sampler(
            self.graphdef, mesh=self.mesh, rules=self.rules, prompt_buckets=self._prompt_buckets(),
            engine=self.args.generation_engine, num_slots=self.args.generation_num_slots,
        )  # fmt: skip

    def sampler(self) -> Sampler:
        if self.rollout_sampler is not None:
            return self.rollout_sampler
        return super().sampler()

    # ----------------------------------------------------------------- rollout
    def _sample_rows(self, examples: list[dict], config: GenerationConfig, seed: Any) -> dict:
        """One completion per prompt from the student, scored by the teacher: the rollout rows
        (`input_ids`, `attention_mask`, `completion_mask`, the teacher's hidden states) and the
        host-side lengths, truncation flags and texts."""
        g = self._generate([ex[PROMPT_IDS] for ex in examples], config, seed)
        out = g.out
        stop = {*config.stop_ids, self.tokenizer.pad_token_id}
        truncated_N = np.array([not ids or ids[-1] not in stop for ids in g.ids], dtype=bool)
        rows = {
            "input_ids": jnp.concatenate([out.prompt_ids_BP, out.completion_ids_BN], axis=1),
            "attention_mask": jnp.concatenate([out.prompt_mask_BP, out.completion_mask_BN], axis=1),
            "completion_mask": out.completion_mask_BN,
        }
        rows[distill.TEACHER_HIDDEN] = self._jit_teacher_hidden(self.train_state, rows)
        tokens = float(np.asarray(out.prompt_mask_BP).sum() + g.lengths.sum())
        return dict(
            rows=rows,
            lengths_N=g.lengths,
            truncated_N=truncated_N,
            texts=g.texts,
            tokens=tokens,
            prompts=[ex["prompt"] for ex in examples],
        )

    def _sampling_params(self) -> Any:
        return self.current_params()

    def _needs_rollout(self, plan: StepPlan) -> bool:
        return plan.starts_cycle or self._buffer_generation != plan.generation

    def _rollout(self, plan: StepPlan) -> None:
        a = self.args
        seed = jax.random.fold_in(jax.random.key(a.seed), plan.generation)
        s = self._sample_rows(plan.examples, self.rollout_generation_config, seed)
        self.completion_logs["prompt"].extend(s["prompts"])
        self.completion_logs["completion"].extend(s["texts"])
        rows = s["rows"]
        order = np.random.default_rng([a.seed, plan.generation]).permutation(len(s["lengths_N"]))
        (batch_axes,) = parallel.logical_to_spec(("batch",), self.rules)
        sharding = NamedSharding(self.mesh, P(batch_axes))
        self.rollout = {
            k: jax.device_put(jnp.take(v, jnp.asarray(order), axis=0), sharding)
            for k, v in rows.items()
        }
        self._buffer_generation = plan.generation
        self._buffer_metrics = _completion_metrics(s["lengths_N"], s["truncated_N"])
        self._buffer_tokens = s["tokens"]

    def _update(self, plan: StepPlan, generated: bool) -> dict:
        if self.args.log_completions:  # this step logs the completions as they are now
            self._completion_logs_at[self.state.global_step + 1] = self._completion_logs_copy()
        slices_A = jnp.asarray(plan.slices, jnp.int32)
        self.train_state, metrics = self._jit_train_step(self.train_state, self.rollout, slices_A)
        # The step's prompt + completion tokens; the loop keeps TRL's running `num_tokens` (and
        # saves it with each checkpoint).
        return {
            **metrics,
            **self._buffer_metrics,
            "num_tokens": self._buffer_tokens if generated else 0.0,
        }

    # ----------------------------------------------------------------- eval
    def evaluate(self, eval_dataset: Any = None, metric_key_prefix: str = "eval") -> dict:
        """TRL's distillation eval: each batch of `per_device_eval_batch_size x devices` prompts
        sampled once, scored by the teacher and run through the loss (forward only, over the
        batch's own tokens); `<prefix>_loss` is HF's mean of the batch losses; `entropy` and
        the completion metrics are means over the batches. Besides (jaxrl's):
        `<prefix>_greedy/exact_match` when the rows have a `completion` column."""
        self._prepare_for_evaluation()
        a = self.args
        ds = (
            self.eval_dataset
            if eval_dataset is None
            else self._prepare_dataset(eval_dataset, "eval")
        )
        if ds is None:
            raise ValueError("evaluate() needs an eval_dataset.")
        batch_size = a.per_device_eval_batch_size * self.dp
        start_time = time.time()
        sampling = self.rollout_generation_config
        greedy = dataclasses.replace(sampling, do_sample=False)
        rows = [ds[i] for i in range(len(ds))]
        losses: list[float] = []
        values: dict[str, list[float]] = defaultdict(list)
        matches: list[bool] = []
        for b, start in enumerate(range(0, len(rows), batch_size)):
            examples = rows[start : start + batch_size]
            seed = jax.random.fold_in(jax.random.key(a.seed + 1), b)
            s = self._sample_rows(examples, sampling, seed)
            # TRL's evaluation generates through the same path, so its log shows these.
            self.completion_logs["prompt"].extend(s["prompts"])
            self.completion_logs["completion"].extend(s["texts"])
            batch_A = jax.tree.map(lambda x: x[None], s["rows"])
            aux = jax.device_get(self._jit_eval_step(self.train_state, batch_A))
            reduced = {k: float(v) for k, v in jax.device_get(reduce_aux(aux)).items()}
            losses.append(reduced.pop("loss"))
            reduced.update(_completion_metrics(s["lengths_N"], s["truncated_N"]))
            for k, v in reduced.items():
                values[k].append(v)
            if "completion" in examples[0]:
                g = self._generate([ex[PROMPT_IDS] for ex in examples], greedy, seed)
                matches += [
                    t.strip() == str(ex["completion"]).strip()
                    for t, ex in zip(g.texts, examples, strict=True)
                ]
        metrics = {"loss": hf_eval_loss(losses, len(rows), batch_size)}
        for k, v in values.items():
            v = [x for x in v if not math.isnan(x)]
            metrics[k] = float(np.mean(v)) if v else math.nan
        metrics["num_tokens"] = float(getattr(self, "_tokens_seen", 0))  # training's so far
        if matches:
            metrics["greedy/exact_match"] = float(np.mean(matches))
        metrics = {f"{metric_key_prefix}_{k}": v for k, v in metrics.items()}
        prep = getattr(self, "model_preparation_time", None)
        metrics.update(speed_metrics(metric_key_prefix, start_time, len(rows), batch_size, prep))
        self.log(metrics)
        self._event("on_evaluate", metrics=metrics)
        return metrics

    # ----------------------------------------------------------------- logging
    def _completion_logs_copy(self) -> dict[str, list]:
        return {k: list(v) for k, v in self.completion_logs.items()}

    def log(self, logs: dict[str, float], step: int | None = None):
        """HF's `log`, then TRL's `log_completions` on process 0: the completions behind this
        log (the latest generation batch; an evaluation's log: the evaluation's last
        `generation_batch_size`) printed as a rich table of Prompt and Completion
        (`num_completions_to_print` random rows; all when None), written to
        `output_dir/completions/completions_<step>.parquet` (step, prompt, completion) and, when a
        wandb run is active, logged as the wandb Table `completions` (the first row of each
        prompt only with `log_unique_prompts`)."""
        super().log(logs, step)
        a = self.args
        if not (a.log_completions and self.is_world_process_zero()):
            return
        step = self.state.global_step if step is None else step
        at = self._completion_logs_at
        is_eval = any(k.startswith("eval_") for k in logs)
        snapshot = None if is_eval else at.pop(step, None)
        for old in [k for k in at if k <= step and not is_eval]:
            del at[old]
        if snapshot is None:
            snapshot = self._completion_logs_copy()
        if not snapshot["prompt"]:
            return
        write_completions_log(
            {**snapshot, "rewards": {}, "advantages": None, "extra": {}},
            step,
            out_dir=os.path.join(a.output_dir, "completions"),
            num_to_print=a.num_completions_to_print,
            unique_prompts=a.log_unique_prompts,
            to_wandb="wandb" in a.report_to,
        )
