"""`python -m jaxrl.train --algo grpo|rloo --tools module:function [...] --environment_factory
module:Class`: the import paths resolved before any data or model is loaded, `--tools` repeatable,
and a wrong path exits 2 with one paragraph naming the flag, the path and the fix (nothing
written to the output dir)."""

import pytest

from jaxrl.config_cli import OnlineScriptArguments, parse_config
from jaxrl.rewards import arith_correct
from jaxrl.train import import_path, main
from jaxrl.trainers.grpo_config import GRPOConfig

BASE = ["--max_steps", "1", "--disable_tqdm", "true", "--save_strategy", "no"]


@pytest.mark.parametrize(
    "flags, words",
    [
        (["--tools", "no_such_module_xyz:fn"], "cannot import module 'no_such_module_xyz'"),
        (["--tools", "jaxrl.rewards:no_such_fn"], "has no function 'no_such_fn'"),
        (["--tools", "calculator"], "is not an import path `module:function`"),
        (["--tools", "jaxrl.rewards:SCRIPT_REWARD_FUNCS"], "is a dict, not a function"),
        (["--tools", "jaxrl.rewards:arith_correct", "--tools", "nope_xyz:f"], "'nope_xyz:f'"),
        (["--environment_factory", "no_such_module_xyz:Game"], "cannot import module"),
        (["--environment_factory", "jaxrl.rewards:Nope"], "has no class 'Nope'"),
    ],
)
@pytest.mark.parametrize("algo", ["grpo", "rloo"])
def test_a_wrong_import_path_exits_2(tmp_path, capsys, algo, flags, words):
    out = tmp_path / "run"
    status = main(["--algo", algo, *BASE, "--output_dir", str(out), *flags])
    err = capsys.readouterr().err
    assert status == 2
    assert err.startswith(f"jaxrl.train: error: {flags[-2]} ") and words in err
    assert "PYTHONPATH" in err and err.count("\n") == 1  # one paragraph, with the fix
    assert not out.exists()


def test_tools_flag_is_repeatable_and_resolves():
    _, script = parse_config(
        GRPOConfig,
        cli_args=["--tools", "a:f", "--tools", "b:g", "c:h", "--environment_factory", "m:Env"],
        script_class=OnlineScriptArguments,
    )
    assert script.tools == ["a:f", "b:g", "c:h"]
    assert script.environment_factory == "m:Env"
    _, script = parse_config(
        GRPOConfig, cli_args=["--tools=a:f"], script_class=OnlineScriptArguments
    )
    assert script.tools == ["a:f"]
    assert import_path("--tools", "jaxrl.rewards:arith_correct", "function") is arith_correct
