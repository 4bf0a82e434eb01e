"""`python -m jaxrl.train --algo grpo --config arith_tools`: the shipped tool-use recipe resolves
its package-relative assets from any directory, and runs end to end through the CLI entry with
tiny settings, logging TRL's `tools/*` metrics."""

import json
from pathlib import Path

import pytest

from jaxrl.config_cli import OnlineScriptArguments, parse_config
from jaxrl.data import tool_task
from jaxrl.train import CONFIG_DIR, _resolve_recipe_paths, import_path, main, recipe_path
from jaxrl.trainers.grpo_config import GRPOConfig

RECIPE = CONFIG_DIR / "arith_tools.yaml"


def _parse(cli_args=()):
    args, script = parse_config(
        GRPOConfig, yaml_path=recipe_path("arith_tools"), cli_args=list(cli_args),
        script_class=OnlineScriptArguments,
    )  # fmt: skip
    _resolve_recipe_paths(script)
    return args, script


def test_recipe_names_the_shipped_assets_from_any_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    args, script = _parse()
    assert Path(script.model_name_or_path) == tool_task.TOOLS_MODEL_DIR
    assert Path(script.tokenizer_name_or_path) == tool_task.TOOLS_TOKENIZER_DIR
    assert Path(script.dataset_name) == tool_task.TOOLS_DATA_DIR
    assert (tool_task.TOOLS_MODEL_DIR / "model.safetensors").stat().st_size < 1_000_000
    assert script.reward_funcs == ["arith_correct"]
    assert import_path("--tools", script.tools[0], "function") is tool_task.calculator
    assert args.max_tool_calling_iterations == 2 and args.max_completion_length == 96
    # A path given on the command line is the user's, left as given.
    _, script = _parse(["--model_name_or_path", "my/model", "--dataset_name", "data"])
    assert (script.model_name_or_path, script.dataset_name) == ("my/model", "data")
    assert Path(script.tokenizer_name_or_path) == tool_task.TOOLS_TOKENIZER_DIR


def test_a_user_recipe_keeps_its_relative_paths(tmp_path):
    user = tmp_path / "mine.yaml"
    user.write_text(RECIPE.read_text())
    _, script = parse_config(GRPOConfig, yaml_path=user, script_class=OnlineScriptArguments)
    _resolve_recipe_paths(script)
    assert script.model_name_or_path == "assets/arith/tools_model"


@pytest.mark.slow  # ~60-100 s on 2 shared CPU cores: compiles the sampler and the GRPO step
def test_recipe_runs_end_to_end_through_the_cli(tmp_path):
    out = tmp_path / "run"
    status = main([
        "--algo", "grpo", "--config", "arith_tools", "--output_dir", str(out),
        "--max_steps", "2", "--per_device_train_batch_size", "16", "--num_generations", "4",
        "--logging_steps", "1", "--eval_strategy", "no", "--eval_on_start", "false",
        "--disable_tqdm", "true",
    ])  # fmt: skip
    assert status == 0
    rows = [json.loads(line) for line in (out / "metrics.jsonl").open()]
    steps = [r for r in rows if "tools/call_frequency" in r]
    assert [r["step"] for r in steps] == [1, 2]
    for r in steps:
        # Calls per rollout: at most max_tool_calling_iterations (2) per rollout here.
        assert 0.0 <= r["tools/call_frequency"] <= 2.0
        assert 0.0 <= r["tools/failure_frequency"] <= 1.0
        assert 0.0 <= r["rewards/arith_correct/mean"] <= 1.0
        assert r["completions/max_length"] <= 96
    assert (out / "final" / "model.safetensors").exists()
