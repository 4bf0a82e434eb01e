"""`python -m jaxrl.train`: a user's model or data gets the config class defaults (TRL's), the
embedded recipe applies only to the embedded job or when named with `--config`, and recipes ship
inside the package."""

import zipfile
from pathlib import Path

import pytest

from jaxrl import DDPOConfig, DPOConfig, SFTConfig
from jaxrl.config import ConfigError
from jaxrl.config_cli import parse_config
from jaxrl.data import task
from jaxrl.train import CONFIG_DIR, build_trainer, main, recipe_path
from jaxrl.trainers.ddpo_config import parse_ddpo_cli
from jaxrl.trainers.registry import ALGORITHMS

MODEL = str(task.asset_path("sft_model"))


def _data(tmp_path: Path) -> str:
    out = tmp_path / "pairs"
    out.mkdir()
    rows = task.asset_path("dpo_train.jsonl").read_text().splitlines()[:16]
    (out / "train.jsonl").write_text("\n".join(rows) + "\n")  # no test split
    return str(out)


def test_user_run_gets_trl_defaults_not_the_recipe(tmp_path):
    trainer = build_trainer(
        ["--algo", "dpo", "--model_name_or_path", MODEL, "--dataset_name", _data(tmp_path),
         "--output_dir", str(tmp_path / "out")]
    )  # fmt: skip
    want = DPOConfig(output_dir=str(tmp_path / "out"))
    assert trainer.args == want
    a = trainer.args
    assert (a.learning_rate, a.lr_scheduler_type, a.warmup_steps, a.weight_decay) == (
        1e-6, "linear", 0, 0.0
    )  # fmt: skip
    assert (a.max_length, a.loss_type, a.prefix_sharing, a.eval_strategy) == (
        1024, ["sigmoid"], False, "no"
    )  # fmt: skip
    assert trainer.eval_dataset is None  # no test split and no eval: trains like TRL's script


def test_embedded_job_uses_its_recipe_and_config_names_a_recipe(tmp_path):
    embedded = build_trainer(["--algo", "sft", "--max_steps", "1"])
    assert embedded.args.max_length == 64 and embedded.args.learning_rate == 1e-3
    named = build_trainer(
        ["--algo", "dpo", "--config", "dpo", "--model_name_or_path", MODEL,
         "--dataset_name", _data(tmp_path), "--eval_strategy", "no", "--eval_on_start", "false"]
    )  # fmt: skip
    assert named.args.max_length == 64 and named.args.prefix_sharing is True
    assert recipe_path("sft.yaml") == CONFIG_DIR / "sft.yaml"


@pytest.mark.parametrize("algo", list(ALGORITHMS))
def test_every_embedded_job_writes_outputs_algo_and_shows_progress(algo):
    """One layout and one progress display for every `--algo`'s embedded job (DDPO's defaults are
    its recipe): output_dir `outputs/<algo>`, progress on (HF's `disable_tqdm=False`)."""
    spec = ALGORITHMS[algo]
    if spec.recipe is None:
        config, _ = parse_ddpo_cli([])
    else:
        recipe = CONFIG_DIR / f"{spec.recipe}.yaml"
        config, _ = parse_config(spec.config_class, recipe, script_class=spec.script_class)
    assert config.output_dir == f"outputs/{algo}"
    assert config.disable_tqdm is False


def test_ddpo_library_default_shows_progress_and_keeps_trls_logdir():
    config = DDPOConfig(mixed_precision="no")
    assert config.disable_tqdm is False and config.output_dir == config.logdir == "logs"
    assert parse_ddpo_cli(["--logdir", "runs/x"])[0].output_dir == "runs/x"


def test_eval_without_a_test_split_is_rejected_naming_both_fields(tmp_path, capsys):
    argv = ["--algo", "dpo", "--model_name_or_path", MODEL, "--dataset_name", _data(tmp_path),
            "--output_dir", str(tmp_path / "o"), "--eval_strategy", "steps"]  # fmt: skip
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "eval_strategy='steps'" in err and "eval_dataset" in err
    assert "--dataset_test_split" in err


def test_unknown_recipe_and_bad_yaml_exit_2(tmp_path, capsys):
    assert main(["--algo", "sft", "--config", "nope"]) == 2
    assert "shipped recipe" in capsys.readouterr().err
    bad = tmp_path / "bad.yaml"
    bad.write_text("learning_rate: 1e-3\nmax_length: [64\n")
    assert main(["--algo", "sft", "--config", str(bad)]) == 2
    err = capsys.readouterr().err
    assert str(bad) in err and "line 3" in err and "not valid YAML" in err


@pytest.mark.parametrize("value", ["inf", "nan", "-inf"])
def test_non_finite_learning_rate_is_rejected(value):
    with pytest.raises(ConfigError, match="`learning_rate` must be a finite number"):
        SFTConfig(learning_rate=float(value))
    # Finite values on the check's boundary and TRL's default are kept as given.
    assert SFTConfig(learning_rate=0.0).learning_rate == 0.0
    assert SFTConfig().learning_rate == 2e-5  # TRL's SFTConfig default


def test_wheel_ships_the_recipes(tmp_path):
    """A built wheel holds jaxrl/recipes/*.yaml, so an installed jaxrl runs the embedded job."""
    import shutil
    import subprocess
    import sys

    # Built from a copy: setuptools writes build/ into the source tree, which must not change
    # under a test running beside this one (test_tpu_scripts tars the checkout).
    root = Path(__file__).resolve().parents[1]
    src = tmp_path / "src"
    skip = shutil.ignore_patterns("__pycache__", "*.egg-info")
    shutil.copytree(root / "jaxrl", src / "jaxrl", ignore=skip)
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(root / name, src / name)
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-w",
         str(tmp_path), str(src)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    (wheel,) = tmp_path.glob("jaxrl-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for algo in ("sft", "reward", "dpo"):
        assert f"jaxrl/recipes/{algo}.yaml" in names
    assert "jaxrl/assets/arith/sft_model/model.safetensors" in names


def _prompts(tmp_path: Path) -> str:
    out = tmp_path / "prompts"
    out.mkdir()
    rows = task.asset_path("sft_train.jsonl").read_text().splitlines()[:8]
    (out / "train.jsonl").write_text("\n".join(rows) + "\n")
    return str(out)


def test_online_script_reward_flags_as_trls_grpo_script(tmp_path, capsys):
    """`--reward_funcs` / `--reward_model_name_or_path` (TRL's GRPOScriptArguments): registry
    names and dotted paths in order; a user dataset without a reward is an error (the embedded
    task's `arith_correct` is only the embedded job's default); other algos refuse the flags."""
    from jaxrl import rewards

    base = ["--model_name_or_path", MODEL, "--dataset_name", _prompts(tmp_path)]
    base += ["--output_dir", str(tmp_path / "o"), "--num_generations", "2"]
    # Prompt + completion within the tiny model's 64 positions (TRL's 512 is refused there).
    base += ["--max_completion_length", "16"]
    trainer = build_trainer(
        ["--algo", "rloo", *base, "--reward_funcs", "think_format_reward",
         "get_soft_overlong_punishment", "jaxrl.rewards.arith_correct"]
    )  # fmt: skip
    assert trainer.reward_func_names == [
        "think_format_reward", "soft_overlong_punishment_reward", "arith_correct",
    ]  # fmt: skip
    overlong = trainer.reward_funcs[1]
    assert (overlong.max_completion_len, overlong.soft_punish_cache) == (1280, 256)
    assert trainer.reward_funcs[2] is rewards.arith_correct
    # One name is a one-element list, as HfArgumentParser reads it.
    one = build_trainer(["--algo", "grpo", *base, "--reward_funcs", "arith_correct"])
    assert one.reward_func_names == ["arith_correct"]
    assert build_trainer(["--algo", "grpo"]).reward_func_names == ["arith_correct"]

    for argv, message in (
        (["--algo", "grpo", *base], "needs a reward"),
        (["--algo", "grpo", *base, "--reward_funcs", "nope"], "not one of"),
        (["--algo", "grpo", *base, "--reward_funcs", "jaxrl.rewards.nope"], "cannot import"),
        (["--algo", "grpo", *base, "--reward_funcs", "jaxrl.rewards.SCRIPT_REWARD_FUNCS"],
         "not a function"),
        (["--algo", "dpo", "--reward_funcs", "arith_correct"], "Unknown key 'reward_funcs'"),
    ):  # fmt: skip
        assert main(argv) == 2, argv
        assert message in capsys.readouterr().err, argv
