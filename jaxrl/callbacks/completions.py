"""Callbacks that generate: TRL's `LogCompletionsCallback` and `WeaveCallback`.

Both take the prompts of the trainer's eval dataset (a `prompt` column, conversational prompts
through the chat template), generate completions with the trainer's KV-cache sampler
(`trainer.generate_completions`, the current params, no copy) and log them:

- `LogCompletionsCallback` every `freq` steps (default: `eval_steps`), as a wandb Table
  (`completions`, columns step / prompt / completion) when wandb is active, and always as JSON
  lines in `output_dir/completions.jsonl` so completions are kept without wandb.
- `WeaveCallback` at each evaluation, through Weave's `EvaluationLogger`: tracing mode (no
  scorers: predictions only) or evaluation mode (`scorers={"name": fn(prompt, completion)}`:
  per-prediction scores and an `avg_<name>` summary). `weave` is an optional extra
  (`pip install jaxrl[weave]`); without it the callback raises at construction.

`write_completions_log` is GRPO/RLOO's `log_completions` (rich table, parquet files, wandb
Table). Only process 0 writes. Generation is host-driven and happens between steps, never inside one.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import random
from typing import Any

from jaxrl.callbacks.base import TrainerCallback

logger = logging.getLogger(__name__)


def eval_prompts(trainer: Any, num_prompts: int | None, who: str) -> list[Any]:
    """The `prompt` column of the trainer's eval dataset (TRL: ValueError when absent)."""
    dataset = getattr(trainer, "raw_eval_dataset", None)
    if dataset is None:
        dataset = getattr(trainer, "eval_dataset", None)
    if dataset is None:
        raise ValueError(f"Trainer must have an evaluation dataset to use the {who}.")
    if "prompt" not in dataset.column_names:
        raise ValueError(
            f"The {who} generates from the eval dataset's `prompt` column, but it has only "
            f"{dataset.column_names}; use a dataset with prompts (prompt/chosen/rejected, "
            "prompt/completion, ...)."
        )
    if num_prompts is not None:
        dataset = dataset.select(range(min(num_prompts, len(dataset))))
    return list(dataset["prompt"])


def _config_dict(config: Any) -> dict | None:
    """A generation config (transformers' or jaxrl's dataclass) as a plain dict."""
    if config is None:
        return None
    if dataclasses.is_dataclass(config):
        return dataclasses.asdict(config)
    return config.to_dict()


def format_prompts(prompts: list[Any], tokenizer: Any) -> list[str]:
    """Conversational prompts through the chat template (generation prompt added), as TRL's
    `maybe_apply_chat_template`; plain strings pass through."""
    out = []
    for prompt in prompts:
        if isinstance(prompt, list):
            prompt = tokenizer.apply_chat_template(
                prompt, tokenize=False, add_generation_prompt=True
            )
        out.append(prompt)
    return out


def _cell(entry: Any) -> Any:
    """A prompt or completion as a rich cell: messages as `ROLE` headers over their content
    (and reasoning, tool calls), anything else as its text."""
    from rich.text import Text

    text = Text()
    if not (isinstance(entry, list) and all(isinstance(m, dict) for m in entry)):
        text.append(str(entry))
        return text
    for j, message in enumerate(entry):
        text.append(f"{str(message.get('role', '')).upper()}\n", style="bold red")
        reasoning = message.get("reasoning_content") or message.get("thinking")
        if reasoning:
            text.append(f"{reasoning}\n", style="italic dim white")
        content = message.get("content")
        if isinstance(content, list):  # typed blocks
            for block in content:
                text.append(block.get("text", "") if block.get("type") == "text" else "[IMAGE]")
        elif content is not None:
            text.append(str(content))
        for k, call in enumerate(message.get("tool_calls") or []):
            fn = call.get("function", {})
            args = fn.get("arguments", {})
            args = json.loads(args) if isinstance(args, str) else args
            shown = ", ".join(f"{name}={value!r}" for name, value in args.items())
            text.append(("\n" if k else "") + f"{fn.get('name', '?')}({shown})")
        if j < len(entry) - 1:
            text.append("\n\n")
    return text


def print_completions(logs: dict[str, Any], step: int, num_samples: int | None) -> None:
    """TRL's console table of completions (`print_prompt_completions_sample`): columns Prompt,
    Completion, one per reward function, Advantage (none when `advantages` is None, as
    distillation), then the `log_extra` columns; `num_samples` random rows (all when None or not
    fewer than the rows, none when <= 0)."""
    from rich.console import Console
    from rich.panel import Panel
    from rich.table import Table

    n = len(logs["prompt"])
    if num_samples is not None and num_samples <= 0:
        return
    rows = range(n)
    if num_samples is not None and num_samples < n:
        rows = sorted(random.sample(range(n), num_samples))
    table = Table(show_header=True, header_style="bold white", expand=True)
    table.add_column("Prompt", style="bright_yellow")
    table.add_column("Completion", style="bright_green")
    for name in logs["rewards"]:
        table.add_column(name, style="bold cyan", justify="right")
    advantages = logs.get("advantages")
    if advantages is not None:
        table.add_column("Advantage", style="bold magenta", justify="right")
    for name in logs["extra"]:
        table.add_column(name, style="bright_white")
    for i in rows:
        table.add_row(
            _cell(logs["prompt"][i]),
            _cell(logs["completion"][i]),
            *(f"{values[i]:.2f}" for values in logs["rewards"].values()),
            *([] if advantages is None else [f"{advantages[i]:.2f}"]),
            *(str(values[i]) for values in logs["extra"].values()),
        )
        table.add_section()
    Console().print(Panel(table, expand=False, title=f"Step {step}", border_style="bold white"))


def write_completions_log(
    logs: dict[str, Any],
    step: int,
    *,
    out_dir: str,
    num_to_print: int | None,
    unique_prompts: bool,
    to_wandb: bool,
) -> None:
    """GRPO/RLOO's `log_completions` (TRL's): print the completions, write them to
    `out_dir/completions_<step:05d>.parquet` (columns step, prompt, completion, one per reward
    function, the `log_extra` columns, advantage) and, when a wandb run is active and
    `to_wandb`, log them as the wandb Table `completions` (first row per prompt only with
    `unique_prompts`). `logs`: `prompt`, `completion`, `advantages` lists and `rewards` /
    `extra` dicts of lists, row-aligned; `advantages` None drops that column (distillation)."""
    import pandas as pd

    print_completions(logs, step, num_to_print)
    n = len(logs["prompt"])
    frame = pd.DataFrame(
        {
            "step": [step] * n,
            "prompt": logs["prompt"],
            "completion": logs["completion"],
            **logs["rewards"],
            **logs["extra"],
            **({} if logs.get("advantages") is None else {"advantage": logs["advantages"]}),
        }
    )
    os.makedirs(out_dir, exist_ok=True)
    frame.to_parquet(os.path.join(out_dir, f"completions_{step:05d}.parquet"))
    if to_wandb:
        import wandb

        if wandb.run is not None:
            if unique_prompts:
                frame = frame[~frame["prompt"].astype(str).duplicated()]
            wandb.log({"completions": wandb.Table(dataframe=frame)})


class LogCompletionsCallback(TrainerCallback):
    """Arguments and defaults as TRL's `LogCompletionsCallback`."""

    def __init__(
        self,
        trainer: Any,
        generation_config: Any = None,
        num_prompts: int | None = None,
        freq: int | None = None,
    ):
        self.trainer = trainer
        self.generation_config = generation_config
        self.freq = freq
        self.prompts = eval_prompts(trainer, num_prompts, "LogCompletionsCallback")
        self.table: list[list[str]] = []
        self._last_logged_step = -1

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self._last_logged_step:
            return control
        freq = self.freq or state.eval_steps
        if state.global_step % freq != 0:
            return control
        tokenizer = self.trainer.processing_class
        prompts = format_prompts(self.prompts, tokenizer)
        completions = self.trainer.generate_completions(
            prompts, generation_config=self.generation_config
        )
        self._last_logged_step = state.global_step
        if not state.is_world_process_zero:
            return control
        rows = [[str(state.global_step), p, c] for p, c in zip(prompts, completions, strict=True)]
        self.table.extend(rows)
        path = os.path.join(args.output_dir, "completions.jsonl")
        os.makedirs(args.output_dir, exist_ok=True)
        with open(path, "a", encoding="utf-8") as f:
            for step, prompt, completion in rows:
                record = {"step": int(step), "prompt": prompt, "completion": completion}
                f.write(json.dumps(record) + "\n")
        report = args.report_to if isinstance(args.report_to, list) else [args.report_to]
        if "wandb" in report or "all" in report:
            import wandb

            if wandb.run is not None:
                table = wandb.Table(columns=["step", "prompt", "completion"], data=self.table)
                wandb.log({"completions": table})
        return control


class WeaveCallback(TrainerCallback):
    """Arguments and defaults as TRL's `WeaveCallback` (tracing or evaluation mode)."""

    def __init__(
        self,
        trainer: Any,
        project_name: str | None = None,
        scorers: dict[str, Any] | None = None,
        generation_config: Any = None,
        num_prompts: int | None = None,
        dataset_name: str = "eval_dataset",
        model_name: str | None = None,
    ):
        try:
            import weave
        except ImportError as error:
            raise ImportError(
                "WeaveCallback needs the `weave` package: `pip install 'jaxrl[weave]'` (or "
                "`pip install weave`), or drop the callback."
            ) from error
        self._weave = weave
        self.trainer = trainer
        self.project_name = project_name
        self.scorers = scorers or {}
        self.generation_config = generation_config
        self.dataset_name = dataset_name
        self.model_name = model_name
        self.prompts = eval_prompts(trainer, num_prompts, "WeaveCallback")
        self._client = None
        self._last_logged_step = -1

    @property
    def is_evaluation_mode(self) -> bool:
        """True when scorers are given (evaluation mode), False for tracing mode."""
        return bool(self.scorers)

    def _initialize(self):
        if self._client is not None:
            return
        from weave.trace.context import weave_client_context

        client = weave_client_context.get_weave_client()
        if client is None:
            if self.project_name is None:
                import wandb

                if wandb.run is not None:
                    self.project_name = f"{wandb.run.entity}/{wandb.run.project}"
            if self.project_name is None:
                raise ValueError(
                    "No Weave client and no project_name: call weave.init('project'), pass "
                    "project_name=... to WeaveCallback, or start a wandb run first."
                )
            client = self._weave.init(self.project_name)
        self._client = client
        if self.model_name is None:
            self.model_name = getattr(self.trainer, "model_path", None) or "unknown_model"

    def on_train_begin(self, args, state, control, **kwargs):
        self._initialize()
        return control

    def on_evaluate(self, args, state, control, **kwargs):
        if state.global_step == self._last_logged_step:
            return control
        self._initialize()
        prompts = format_prompts(self.prompts, self.trainer.processing_class)
        completions = self.trainer.generate_completions(
            prompts, generation_config=self.generation_config
        )
        self._last_logged_step = state.global_step
        if not state.is_world_process_zero:
            return control
        gen = self.generation_config
        eval_logger = self._weave.EvaluationLogger(
            model=self.model_name,
            dataset=self.dataset_name,
            eval_attributes={
                "training_step": state.global_step,
                "model_name": self.model_name,
                "generation_config": _config_dict(gen),
            },
        )
        scores: dict[str, list[float]] = {}
        for prompt, completion in zip(prompts, completions, strict=True):
            pred = eval_logger.log_prediction(inputs={"prompt": prompt}, output=completion)
            for name, scorer in self.scorers.items():
                try:
                    score = scorer(prompt, completion)
                except Exception as error:  # a broken scorer must not stop training (TRL)
                    logger.warning("Weave scorer %r failed: %s", name, error)
                    continue
                pred.log_score(scorer=name, score=score)
                scores.setdefault(name, []).append(score)
            pred.finish()
        if self.is_evaluation_mode:
            summary = {"total_predictions": len(prompts), "successful_predictions": len(prompts)}
            summary.update({f"avg_{k}": sum(v) / len(v) for k, v in scores.items() if v})
            eval_logger.log_summary(summary)
        else:
            eval_logger.finish()
        return control
