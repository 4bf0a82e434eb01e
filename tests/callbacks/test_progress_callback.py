"""RichProgressCallback: live panel on a terminal, plain lines without one."""

import io

from rich.console import Console

from jaxrl.callbacks import RichProgressCallback, TrainerControl, TrainerState
from jaxrl.callbacks.progress import group_metrics
from jaxrl.config import TrainingConfig

LOGS = {"loss": 0.5, "rewards/chosen": 1.25, "rewards/margins": 0.75, "eval_loss": 0.625}


def _run(console: Console, args: TrainingConfig, state: TrainerState) -> str:
    callback = RichProgressCallback(console=console)
    callback.on_train_begin(args, state, TrainerControl())
    state.global_step = 10
    callback.on_step_end(args, state, TrainerControl())
    callback.on_log(args, state, TrainerControl(), logs={**LOGS, "step": 10})
    callback.on_train_end(args, state, TrainerControl())
    return console.file.getvalue()


def test_group_metrics_by_prefix():
    assert group_metrics(LOGS) == {
        "train": {"loss": 0.5},
        "rewards": {"chosen": 1.25, "margins": 0.75},
        "eval": {"loss": 0.625},
    }


def test_plain_lines_without_tty():
    console = Console(file=io.StringIO(), force_terminal=False, width=200)
    out = _run(console, TrainingConfig(), TrainerState(max_steps=100))
    assert out == (
        "step 10/100 loss=0.5 rewards/chosen=1.25 rewards/margins=0.75 eval_loss=0.625\n"
    )


def test_live_panel_on_terminal():
    console = Console(file=io.StringIO(), force_terminal=True, width=160)
    out = _run(console, TrainingConfig(), TrainerState(max_steps=100))
    for text in ("Training", "Step 10/100", "rewards", "margins", "0.75", "eval"):
        assert text in out
    assert "step 10/100 loss=" not in out  # no plain fallback lines


def test_disable_tqdm_falls_back_and_other_processes_are_silent():
    console = Console(file=io.StringIO(), force_terminal=True, width=200)
    out = _run(console, TrainingConfig(disable_tqdm=True), TrainerState(max_steps=100))
    assert out.startswith("step 10/100 loss=0.5")
    quiet = Console(file=io.StringIO(), force_terminal=True, width=200)
    assert _run(quiet, TrainingConfig(), TrainerState(is_world_process_zero=False)) == ""


def test_the_bar_says_compiling_until_the_first_step_ends():
    console = Console(file=io.StringIO(), force_terminal=True, width=160)
    callback = RichProgressCallback(console=console)
    args, state = TrainingConfig(), TrainerState(max_steps=100)
    callback.on_train_begin(args, state, TrainerControl())
    (task,) = callback._bar.tasks
    assert "Compiling the first step" in task.description
    state.global_step = 1
    callback.on_step_end(args, state, TrainerControl())
    assert "Training" in task.description and "Compiling" not in task.description
    callback.on_train_end(args, state, TrainerControl())
