"""GRPO/RLOO `log_completions` as TRL 1.16: at each log, the latest `generation_batch_size`
completions are printed as a rich table, written to `output_dir/completions/
completions_<step>.parquet` and logged as the wandb Table `completions`.

jaxrl reads a step's metrics one step late, after the next step has generated; the file of step
k must still hold step k's completions, which the step's own logged `reward` pins down.
"""

from __future__ import annotations

import sys

import numpy as np
import pandas as pd
import pytest
from onpolicy_utils import RecordingReward, prompt_rows
from trainer_utils import base_args

from jaxrl.callbacks.completions import write_completions_log
from jaxrl.trainers.grpo import GRPOTrainer
from jaxrl.trainers.grpo_config import GRPOConfig
from jaxrl.trainers.rloo import RLOOTrainer
from jaxrl.trainers.rloo_config import RLOOConfig


def _trainer(cls, hf_model_dir, tokenizer, out, **kw):
    config_cls = GRPOConfig if cls is GRPOTrainer else RLOOConfig
    settings = dict(
        per_device_train_batch_size=8,
        num_generations=4,
        max_completion_length=6,
        max_steps=3,
        learning_rate=1e-2,
        log_completions=True,
        per_device_eval_batch_size=4,
    )
    args = config_cls(**base_args(out, **{**settings, **kw}))
    return cls(
        hf_model_dir,
        reward_funcs=RecordingReward(),
        args=args,
        train_dataset=prompt_rows(16),
        eval_dataset=prompt_rows(3, "test"),
        processing_class=tokenizer,
    )


@pytest.mark.parametrize("cls", [GRPOTrainer, RLOOTrainer], ids=["grpo", "rloo"])
def test_each_step_logs_its_own_completions(cls, hf_model_dir, tokenizer, tmp_path, capsys):
    """GRPO's trainer is first evaluated, untrained, and its evaluation's completion logs checked
    (was test_evaluation_logs_the_eval_completions, which built a GRPO trainer of these settings
    only to evaluate it); num_generations_eval only shapes evaluation, and each training step's
    generation batch (8 completions, TRL's window) replaces what evaluation logged, so the
    training checks below hold as on a fresh trainer (their reward calls are those after the
    evaluation's). That log-completions are off by default is checked on test_grpo_trainer.py's
    default run (was test_off_by_default, a 3-step run of its own)."""
    trainer = _trainer(
        cls, hf_model_dir, tokenizer, tmp_path, num_completions_to_print=3, num_generations_eval=2
    )
    if cls is GRPOTrainer:
        check_evaluation_logs_the_eval_completions(trainer, tmp_path)
    calls = trainer.reward_funcs[0].calls
    n_eval_calls = len(calls)
    trainer.train()
    logs = {h["step"]: h for h in trainer.state.log_history if "reward" in h}
    calls = calls[n_eval_calls:]
    assert len(calls) == 3  # one generation batch of 8 completions per step
    for step in (1, 2, 3):
        frame = pd.read_parquet(tmp_path / "completions" / f"completions_{step:05d}.parquet")
        assert list(frame.columns) == ["step", "prompt", "completion", "ones", "advantage"]
        assert len(frame) == 8 and (frame["step"] == step).all()
        # The completions and prompts this step was trained on, in generation order ...
        assert frame["completion"].tolist() == calls[step - 1]["completions"]
        assert frame["prompt"].tolist() == calls[step - 1]["prompts"]
        # ... and the rewards behind the step's own logged reward.
        assert np.nanmean(frame["ones"]) == pytest.approx(logs[step]["reward"], abs=1e-6)
        # Advantages are centred per group of num_generations.
        assert np.allclose(frame["advantage"].to_numpy().reshape(2, 4).sum(1), 0, atol=1e-5)
    printed = capsys.readouterr().out
    for step in (1, 2, 3):
        assert f"Step {step}" in printed
    assert "Advantage" in printed and "ones" in printed


def check_evaluation_logs_the_eval_completions(trainer, out):
    trainer.evaluate()
    frame = pd.read_parquet(out / "completions" / "completions_00000.parquet")
    eval_prompts = prompt_rows(3, "test")["prompt"]
    assert frame["prompt"].tolist() == [p for p in eval_prompts for _ in range(2)]


def _logs(n_prompts: int, group: int) -> dict:
    prompts = [f"p{i}" for i in range(n_prompts) for _ in range(group)]
    n = len(prompts)
    return {
        "prompt": prompts,
        "completion": [f"c{i}" for i in range(n)],
        "rewards": {"r": [float(i) for i in range(n)]},
        "advantages": [0.5] * n,
        "extra": {"source": ["x"] * n},
    }


def test_printed_sample_size_and_wandb_table(tmp_path, capsys, monkeypatch):
    """`num_completions_to_print` rows are printed (TRL samples them at random); the wandb
    Table keeps one row per prompt with `log_unique_prompts`."""
    import wandb

    logged = []
    monkeypatch.setattr(wandb, "run", object())
    monkeypatch.setattr(wandb, "log", lambda data: logged.append(data))
    logs = _logs(3, 4)
    write_completions_log(
        logs, 7, out_dir=str(tmp_path), num_to_print=5, unique_prompts=True, to_wandb=True
    )
    printed = capsys.readouterr().out
    assert "Step 7" in printed and "source" in printed
    assert sum(f" c{i} " in printed for i in range(12)) == 5
    table = logged[0]["completions"]
    assert len(table.data) == 3  # one row per prompt
    assert table.columns == ["step", "prompt", "completion", "r", "source", "advantage"]
    frame = pd.read_parquet(tmp_path / "completions_00007.parquet")
    assert len(frame) == 12  # the file keeps every row
    write_completions_log(
        logs, 8, out_dir=str(tmp_path), num_to_print=0, unique_prompts=False, to_wandb=True
    )
    assert "Step 8" not in capsys.readouterr().out  # <= 0 prints nothing
    assert len(logged[1]["completions"].data) == 12


def test_conversational_cells_show_roles():
    from rich.console import Console

    from jaxrl.callbacks.completions import _cell

    console = Console(file=sys.stdout, width=80)
    with console.capture() as cap:
        console.print(
            _cell([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}])
        )
    assert cap.get().split() == ["USER", "hi", "ASSISTANT", "yo"]
