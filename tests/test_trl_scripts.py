"""TRL's own example scripts run on jaxrl with only their imports changed from `trl` to `jaxrl`.

The scripts are read from the installed trl (`trl/scripts/sft.py`, `dpo.py`, `reward.py`,
`kto.py`, `distillation.py`), their `from trl import ...` lines rewritten to `from jaxrl import ...`,
and each trains a tiny model for two steps and exports an HF directory that transformers loads.
TRL flags with no JAX meaning are
mapped (`--dtype`, `--attn_implementation`) or rejected with exit status 2 and a message.
"""

import json
import re
import runpy
import sys
from pathlib import Path

import pytest

from jaxrl.data import task

MODEL = task.asset_path("sft_model")


def _port(tmp_path: Path, name: str) -> Path:
    import trl

    source = (Path(trl.__file__).parent / "scripts" / f"{name}.py").read_text()
    ported, count = re.subn(r"^(\s*)from trl import", r"\1from jaxrl import", source, flags=re.M)
    assert count == 2  # the trainer imports in main() and the parser imports in make_parser()
    assert not re.search(r"^\s*(from|import) trl\b", ported, flags=re.M)
    path = tmp_path / f"{name}.py"
    path.write_text(ported)
    return path


def _data(tmp_path: Path, name: str) -> Path:
    out = tmp_path / "data"
    out.mkdir()
    for split in ("train", "test"):
        rows = task.asset_path(f"{name}_{split}.jsonl").read_text().splitlines()[:8]
        (out / f"{split}.jsonl").write_text("\n".join(rows) + "\n")
    return out


def _run_here(script: Path, flags: list[str], monkeypatch) -> None:
    """Runs `python script.py FLAGS` in this process: the script as __main__ with that argv (as
    the rejection test below does). An exception (any failure) fails the test with its traceback.
    """
    monkeypatch.setattr(sys, "argv", [str(script), *flags])
    runpy.run_path(str(script), run_name="__main__")


NAMES = ["sft", "dpo", "reward", "kto", "distillation"]
# What a script needs besides the shared flags: distillation trains the shipped student against
# the shipped SFT model (its teacher) on the SFT rows' prompts.
EXTRA_FLAGS = {
    "distillation": [
        "--model_name_or_path", str(task.asset_path("student_model")),
        "--teacher_model_name_or_path", str(MODEL),
        "--max_completion_length", "4",
        "--per_device_eval_batch_size", "4",
    ],
}  # fmt: skip


@pytest.mark.slow
def test_trl_script_trains_and_exports(tmp_path, monkeypatch, capsys):
    """The scripts, one after another in this process (it has imported jaxrl and
    transformers already; one test, as they once shared one subprocess)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    for name in NAMES:
        (tmp_path / name).mkdir()
        flags = [
            "--model_name_or_path", str(MODEL),
            "--dataset_name",
            str(_data(tmp_path / name, "sft" if name in ("sft", "distillation") else "dpo")),
            "--output_dir", str(tmp_path / name / "out"),
            "--max_steps", "2",
            "--per_device_train_batch_size", "4",
            "--eval_strategy", "steps",
            "--eval_steps", "2",
            "--dtype", "bfloat16",
            "--attn_implementation", "sdpa",
            "--disable_tqdm",
            "--no_gradient_checkpointing",
            # The export is the scripts' save_model; a checkpoint of the 2 steps would only cost.
            "--save_strategy", "no",
            # One device of this process's 8, as `python script.py` with one CPU device trains
            # (jaxrl's default mesh, fsdp over every device, would spread the batch of 4 over 8).
            "--mesh_fsdp", "1",
            *EXTRA_FLAGS.get(name, []),
        ]  # fmt: skip
        capsys.readouterr()
        _run_here(_port(tmp_path / name, name), flags, monkeypatch)
        stdout = capsys.readouterr().out
        out = tmp_path / name / "out"
        assert "Training completed" in stdout and "Model saved" in stdout, name
        saved = json.loads((out / "jaxrl_config.json").read_text())
        # --dtype reached the trainer via model_init_kwargs
        assert saved["param_dtype"] == "bfloat16", name
        assert saved["gradient_checkpointing"] is False, name  # --no_X spells a false boolean
        metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        assert any("eval_loss" in m for m in metrics), name  # the script passed the test split
        auto = AutoModelForSequenceClassification if name == "reward" else AutoModelForCausalLM
        model = auto.from_pretrained(out, dtype=torch.float32)
        assert sum(p.numel() for p in model.parameters()) > 0, name


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--use_peft", "--use_dora"], "DoRA"),
        (["--torch_compile", "true"], "`torch_compile=True` is not supported"),
        (["--deepspeed", "ds.json"], "use `mesh_fsdp`"),
        (["--attn_implementation", "flex_attention"], "has no JAX counterpart"),
        (["--learning_rat", "1e-3"], "Unknown arguments ['--learning_rat', '1e-3']"),
    ],
)
def test_trl_script_rejects_what_has_no_jax_meaning(tmp_path, monkeypatch, capsys, flags, message):
    # In process (the script as __main__, as `python script.py` runs it): the parser rejects the
    # flags before any model loads, so a subprocess would only add its start-up.
    script = _port(tmp_path, "sft")
    argv = [
        str(script),
        "--model_name_or_path", str(MODEL),
        "--dataset_name", str(_data(tmp_path, "sft")),
        "--output_dir", str(tmp_path / "out"),
        *flags,
    ]  # fmt: skip
    monkeypatch.setattr(sys, "argv", argv)
    with pytest.raises(SystemExit) as exit_info:  # any other exception would be a traceback
        runpy.run_path(str(script), run_name="__main__")
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err
