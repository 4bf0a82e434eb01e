"""`python -m jaxrl.train` on bad input: exit status 2 and one paragraph naming the file, line,
row, column or field and the fix; never a traceback. One table row per case: add a case by
adding a line to CASES (a setup that writes the bad input and returns the flags, the expected
status, and words the message must contain).

Also here: what the output-dir guard does when a run is resumed or overwritten, a stale lock, and
a kill before the first checkpoint followed by a resume.
"""

import json
import os
import re
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import jax
import pytest

from jaxrl.data import task
from jaxrl.train import main
from jaxrl.trainers.registry import ALGORITHMS

# A tiny SFT run on the embedded task: fast, and every field not set here has TRL's default.
BASE = ["--algo", "sft", "--max_steps", "1", "--disable_tqdm", "true", "--mesh_fsdp", "1"]
BASE += ["--mesh_data", "1", "--save_strategy", "no", "--per_device_train_batch_size", "1"]
BASE += ["--eval_strategy", "no"]
GOOD_ROWS = [{"text": f"{a}+{a}={2 * a}"} for a in range(16)]


def _jsonl(path: Path, rows) -> str:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return str(path)


def _text(path: Path, text: str) -> str:
    path.write_text(text)
    return str(path)


def _data(tmp: Path) -> list[str]:
    return ["--dataset_name", _jsonl(tmp / "good.jsonl", GOOD_ROWS)]


def _model_copy(tmp: Path) -> Path:
    model = tmp / "model"
    shutil.copytree(task.asset_path("sft_model"), model)
    return model


def _rewrite_safetensors(path: Path, drop: str) -> None:
    from jaxrl.models.weights_io import SafetensorsFile, write_safetensors

    src = SafetensorsFile(path)
    arrays = {k: src.get(k) for k in src.keys() if k != drop}
    specs = {k: (v.shape, v.dtype) for k, v in arrays.items()}
    tmp = path.with_suffix(".tmp")
    write_safetensors(tmp, specs, arrays.__getitem__, metadata={"format": "pt"})
    tmp.replace(path)


def missing_weight(tmp: Path) -> list[str]:
    model = _model_copy(tmp)
    _rewrite_safetensors(model / "model.safetensors", "model.layers.0.mlp.up_proj.weight")
    return [*_data(tmp), "--model_name_or_path", str(model)]


def truncated_weights(tmp: Path) -> list[str]:
    model = _model_copy(tmp)
    weights = model / "model.safetensors"
    os.truncate(weights, weights.stat().st_size // 2)
    return [*_data(tmp), "--model_name_or_path", str(model)]


def corrupt_weights(tmp: Path) -> list[str]:
    model = _model_copy(tmp)
    (model / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json" * 4)
    return [*_data(tmp), "--model_name_or_path", str(model)]


def output_dir_is_a_file(tmp: Path) -> list[str]:
    (tmp / "out").write_text("not a directory")
    # The bad dataset is never read: output_dir is checked before loading anything.
    return ["--dataset_name", _jsonl(tmp / "bad.jsonl", ["{broken"])]


def previous_run(tmp: Path) -> list[str]:
    (tmp / "out" / "checkpoints" / "checkpoint-4").mkdir(parents=True)
    (tmp / "out" / "metrics.jsonl").write_text('{"step": 1, "loss": 2.0}\n')
    return _data(tmp)


def live_lock(tmp: Path) -> list[str]:
    holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    live_lock.holders.append(holder)
    (tmp / "out").mkdir()
    lock = {"pid": holder.pid, "host": socket.gethostname(), "started": 0}
    (tmp / "out" / "jaxrl.lock").write_text(json.dumps(lock))
    return _data(tmp)


live_lock.holders = []


def unrelated_directory(tmp: Path) -> list[str]:
    (tmp / "notes").mkdir()
    (tmp / "notes" / "readme.txt").write_text("hello")
    (tmp / "notes" / "plot.png").write_bytes(b"\x89PNG")
    return ["--dataset_name", str(tmp / "notes")]


# (id, setup(tmp) -> extra flags, expected exit status, words the message must contain)
CASES = [
    ("empty dataset file", lambda t: ["--dataset_name", _jsonl(t / "e.jsonl", [])], 2, ["e.jsonl", "is empty"]),
    ("malformed JSON line", lambda t: ["--dataset_name", _jsonl(t / "m.jsonl", ['{"text": "a"}', '{"text": "b"', '{"text": "c"}'])], 2, ["m.jsonl", "line 2", "not valid JSON"]),
    ("null in a text column", lambda t: ["--dataset_name", _jsonl(t / "n.jsonl", [{"text": "a"}, {"text": None}])], 2, ["'text'", "row 2", "null"]),
    ("number in a text column", lambda t: ["--dataset_name", _jsonl(t / "i.jsonl", [{"text": "a"}, {"text": "b"}, {"text": 7}])], 2, ["'text'", "row 3", "7 (int)"]),
    ("directory of unrelated files", unrelated_directory, 2, ["notes", "readme.txt", "save_to_disk"]),
    ("checkpoint missing a weight", missing_weight, 2, ["model.layers.0.mlp.up_proj.weight", "re-download"]),
    ("truncated safetensors", truncated_weights, 2, ["model.safetensors", "truncated"]),
    ("corrupt safetensors", corrupt_weights, 2, ["model.safetensors", "corrupt"]),
    ("output_dir is a file", output_dir_is_a_file, 2, ["is an existing file", "--output_dir"]),
    ("output_dir under a file", lambda t: [*output_dir_is_a_file(t), "--output_dir", str(t / "out" / "run")], 2, ["cannot be created", f"{os.sep}out' is an existing file"]),
    ("resume from a checkpoint that does not exist", lambda t: [*_data(t), "--resume_from_checkpoint", str(t / "runs/nowhere/checkpoints/checkpoint-5")], 2, ["runs/nowhere/checkpoints/checkpoint-5' does not exist", "runs' is missing"]),
    ("output_dir holds a previous run", previous_run, 2, ["--overwrite_output_dir", "--resume_from_checkpoint", "checkpoints/", "metrics.jsonl"]),
    ("output_dir in use by a live run", live_lock, 2, ["in use by another run", "jaxrl.lock"]),
    ("malformed YAML config", lambda t: [*_data(t), "--config", _text(t / "bad.yaml", "learning_rate: [1e-4\nmax_steps: 2\n")], 2, ["bad.yaml", "line"]),
    ("learning_rate is nan", lambda t: [*_data(t), "--learning_rate", "nan"], 2, ["learning_rate"]),
    ("eval without an eval dataset", lambda t: [*_data(t), "--eval_strategy", "steps"], 2, ["eval_strategy", "eval_dataset"]),
    ("unknown --algo", lambda t: ["--algo", "bogus"], 2, ["'bogus'", *ALGORITHMS]),
    ("KTO data without a label column", lambda t: ["--algo", "kto", "--per_device_train_batch_size", "2", "--dataset_name", _jsonl(t / "k.jsonl", [{"prompt": "1+1=", "completion": "2"}] * 4)], 2, ["KTO", "'label'", "completion"]),
]  # fmt: skip


@pytest.fixture(autouse=True, scope="module")
def _stop_lock_holders():
    yield
    for holder in live_lock.holders:
        holder.kill()
        holder.wait()


@pytest.mark.parametrize("setup,status,words", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input_is_one_clear_paragraph(tmp_path, capsys, setup, status, words):
    extra = setup(tmp_path)
    assert main([*BASE, "--output_dir", str(tmp_path / "out"), *extra]) == status
    err = capsys.readouterr().err
    message = [line for line in err.splitlines() if line.startswith("jaxrl.train: error:")]
    assert len(message) == 1, err[-3000:]
    for word in words:
        assert word in message[0], f"{word!r} not in {message[0]!r}"
    assert "Traceback" not in err


@pytest.mark.slow
def test_a_bad_input_exits_2_without_traceback_as_a_process(tmp_path):
    """The same contract seen from outside: the process status, and stderr with no traceback."""
    data = _jsonl(tmp_path / "m.jsonl", ['{"text": "a"}', "{oops"])
    proc = subprocess.run(
        [sys.executable, "-m", "jaxrl.train", *BASE, "--dataset_name", data],
        capture_output=True,
        text=True,
        cwd=tmp_path,
    )
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "m.jsonl: line 2 is not valid JSON" in proc.stderr
    assert "Traceback" not in proc.stderr


def _run(out: Path, *extra: str) -> int:
    return main([*BASE, "--output_dir", str(out), "--logging_steps", "1", *extra])


def _steps(out: Path) -> list[int]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [r["step"] for r in rows if "loss" in r]


@pytest.mark.slow
def test_overwrite_resume_kill_and_damaged_checkpoint_continue_one_run(tmp_path, caplog, capsys):
    """Three former tests, continuing one 4-step run saving at steps 2 and 4 (in `out`), copied as
    it finished (to `damaged`) so that it is trained once:

    Part 1 (`out`; was test_overwrite_and_resume_keep_one_runs_results): the output-dir guard
    keeps one run's results: a second run is refused and changes nothing, a resume continues the
    same run (no line twice), an overwrite starts afresh with the old checkpoints gone, and the
    lock is released.
    Part 2 (`out`; was test_kill_before_first_checkpoint_then_resume_has_no_duplicate_lines):
    the overwrite's run is the 2-step run without saves that part needs; a kill before its first
    checkpoint followed by a resume restarts from scratch with no line twice.
    Part 3 (`damaged`; was test_resume_falls_back_past_a_damaged_newest_checkpoint): a resume
    falls back past a damaged newest checkpoint (steps 3 and 4 re-run from step 2, no line twice,
    the damaged directory set aside); with every checkpoint damaged, a clear error naming the
    directory.
    """
    data = _data(tmp_path)
    out = tmp_path / "out"
    save = ["--save_strategy", "steps", "--save_steps", "2", "--max_steps", "4"]
    assert _run(out, *data, *save) == 0
    assert _steps(out) == [1, 2, 3, 4]
    damaged = tmp_path / "damaged"
    shutil.copytree(out, damaged)

    # Part 1. Refused without a choice; the first run's results are untouched.
    assert _run(out, *data, *save) == 2
    assert _steps(out) == [1, 2, 3, 4] and (out / "checkpoints" / "checkpoint-4").is_dir()
    # Resume continues the same run (nothing left to do at step 4: no new step lines).
    assert _run(out, *data, *save, "--resume_from_checkpoint", "true") == 0
    assert _steps(out) == [1, 2, 3, 4]
    # Overwrite starts afresh: the old step directories are gone, not mixed with new ones.
    assert _run(out, *data, "--max_steps", "2", "--overwrite_output_dir", "true") == 0
    assert _steps(out) == [1, 2] and not (out / "checkpoints" / "checkpoint-4").exists()
    assert not (out / "jaxrl.lock").exists()

    # Part 2. What a run killed (SIGKILL) after logging 2 steps but before any save leaves
    # behind: metrics lines, no checkpoint, and a lock whose holder is gone. The overwrite's run
    # above is that run (`--max_steps 2`, BASE saves nothing), less the kill.
    assert not (out / "checkpoints").exists() or not any((out / "checkpoints").iterdir())
    shutil.rmtree(out / "final")
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)  # fmt: skip
    lock = {"pid": int(dead.stdout), "host": socket.gethostname(), "started": 0}
    (out / "jaxrl.lock").write_text(json.dumps(lock))
    assert _run(out, *data, "--max_steps", "3", "--resume_from_checkpoint", "true") == 0
    assert _steps(out) == [1, 2, 3]  # restarted from scratch: no line twice

    # Part 3, on the copy of the finished 4-step run.
    out = damaged
    want = _steps(out)
    (out / "checkpoints" / "checkpoint-4" / "metadata" / "metadata").write_text('{"trunc')
    shutil.rmtree(out / "final")
    caplog.clear()
    assert _run(out, *data, *save, "--resume_from_checkpoint", "true") == 0
    assert "checkpoints/checkpoint-4 is damaged" in caplog.text
    assert _steps(out) == want  # steps 3 and 4 re-run from step 2, lines not duplicated
    assert list((out / "checkpoints").glob("damaged-4-*"))
    # Every checkpoint damaged: a clear error naming the directory.
    for step in (2, 4):
        (out / "checkpoints" / f"checkpoint-{step}" / "metadata" / "metadata").write_text("{")
    capsys.readouterr()
    assert _run(out, *data, *save, "--resume_from_checkpoint", "true") == 2
    assert f"No intact checkpoint in {out / 'checkpoints'}" in capsys.readouterr().err


# A tiny GRPO/RLOO run on the embedded prompts: 2 prompts x 4 completions, scored by the user's
# reward function, failing at the first scoring (before any train step is compiled).
ONLINE = ["--max_steps", "1", "--per_device_train_batch_size", "8", "--num_generations", "4"]
ONLINE += ["--eval_strategy", "no", "--eval_on_start", "false", "--save_strategy", "no"]
ONLINE += ["--disable_tqdm", "true", "--mesh_data", "1", "--mesh_fsdp", "1"]

USER_REWARDS = """
def reads_answer(prompts, completions, **kwargs):
    return [float(c == a) for c, a in zip(completions, kwargs["answer"])]


def infinite(prompts, completions, **kwargs):
    return [float("inf")] * len(prompts)
"""


@pytest.fixture
def user_rewards(tmp_path, monkeypatch, request):
    """A module of the user's reward functions, importable by its dotted name."""
    name = f"user_rewards_{request.node.name.replace('[', '_').replace(']', '')}"
    (tmp_path / f"{name}.py").write_text(USER_REWARDS)
    monkeypatch.syspath_prepend(str(tmp_path))
    return name


def _error_lines(err: str) -> list[str]:
    return [line for line in err.splitlines() if line.startswith("jaxrl.train: error:")]


@pytest.mark.parametrize("algo", ["grpo", "rloo"])
def test_a_raising_reward_function_exits_2_with_its_own_traceback(
    tmp_path, capsys, user_rewards, algo
):
    flags = ["--algo", algo, *ONLINE, "--reward_funcs", f"{user_rewards}.reads_answer"]
    assert main([*flags, "--output_dir", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    message = _error_lines(err)
    assert len(message) == 1, err[-3000:]
    for word in ["'reads_answer' raised KeyError: 'answer'", "at global step 0", "dataset lacks"]:
        assert word in message[0], message[0]
    # The user's code stays visible above the paragraph; jaxrl's plumbing does not.
    assert f"{user_rewards}.py" in err and 'kwargs["answer"]' in err
    assert "jaxrl/trainers" not in err and "jaxrl/rewards.py" not in err


def test_an_infinite_reward_names_its_function_not_the_learning_rate(
    tmp_path, capsys, user_rewards
):
    flags = ["--algo", "grpo", *ONLINE, "--reward_funcs", f"{user_rewards}.infinite"]
    assert main([*flags, "--output_dir", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    message = _error_lines(err)
    assert len(message) == 1 and "Traceback" not in err, err[-3000:]
    assert "'infinite' returned inf for completion 0" in message[0]
    assert "learning_rate" not in message[0]


def test_disk_full_during_a_save_is_one_paragraph_and_keeps_earlier_checkpoints(
    tmp_path, capsys, monkeypatch
):
    """ENOSPC from the checkpoint writer (the second save's metadata file): one paragraph naming
    the directory and the space needed, no orbax tracebacks, checkpoint-1 intact and resumable."""
    import errno

    import orbax.checkpoint as ocp

    write = ocp.JsonCheckpointHandler._save_fn
    calls = []

    async def full_disk(self, item, directory):
        calls.append(directory)
        if len(calls) >= 2:
            raise OSError(errno.ENOSPC, "No space left on device", str(directory))
        return await write(self, item, directory)

    monkeypatch.setattr(ocp.JsonCheckpointHandler, "_save_fn", full_disk)
    out = tmp_path / "out"
    save = ["--save_strategy", "steps", "--save_steps", "1", "--max_steps", "3"]
    assert main([*BASE, *_data(tmp_path), *save, "--output_dir", str(out)]) == 2
    err = capsys.readouterr().err
    message = _error_lines(err)
    assert len(message) == 1 and "Traceback" not in err, err[-3000:]
    for word in ["disk is full", "checkpoint 2", str(out / "checkpoints"), "needs about"]:
        assert word in message[0], message[0]
    assert "MB" in message[0] and str(out / "checkpoints" / "checkpoint-1") in message[0]
    assert "--resume_from_checkpoint true" in message[0]
    monkeypatch.undo()
    assert main([*BASE, *_data(tmp_path), *save, "--output_dir", str(out), "--logging_steps", "1", "--resume_from_checkpoint", "true"]) == 0  # fmt: skip
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == [
        "checkpoint-1",
        "checkpoint-2",
        "checkpoint-3",
    ]


def _ddpo_causal_lm(tmp: Path) -> list[str]:
    return ["--pretrained_model", str(task.asset_path("sft_model"))]


# `--algo ddpo` has a CLI of its own (no BASE flags); each case fails before any model is built.
DDPO_CASES = [
    ("missing pipeline directory", lambda t: ["--pretrained_model", str(t / "nowhere")], ["nowhere' does not exist", "StableDiffusionPipeline.save_pretrained"]),
    ("causal LM as a pipeline", _ddpo_causal_lm, ["not a diffusers Stable Diffusion directory", "unet/", "scheduler/"]),
    ("num_epochs not a number", lambda t: ["--num_epochs", "abc"], ["--num_epochs expects int", "'abc'"]),
]  # fmt: skip


@pytest.mark.parametrize("setup,words", [c[1:] for c in DDPO_CASES], ids=[c[0] for c in DDPO_CASES])
def test_ddpo_bad_input_is_one_clear_paragraph(tmp_path, capsys, setup, words):
    argv = ["--algo", "ddpo", "--output_dir", str(tmp_path / "out"), *setup(tmp_path)]
    assert main(argv) == 2
    err = capsys.readouterr().err
    message = _error_lines(err)
    assert len(message) == 1 and "Traceback" not in err, err[-3000:]
    for word in words:
        assert word in message[0], message[0]


def test_ppo_refuses_a_causal_lm_as_reward_model(tmp_path, capsys):
    """A causal LM has no trained score head: PPO would train on random scores (was a warning)."""
    sft = str(task.asset_path("sft_model"))
    argv = ["--algo", "ppo", "--max_steps", "1", "--disable_tqdm", "true", "--save_strategy", "no"]
    argv += ["--reward_model", sft, "--output_dir", str(tmp_path / "out")]
    assert main(argv) == 2
    err = capsys.readouterr().err
    message = _error_lines(err)
    assert len(message) == 1 and "Traceback" not in err, err[-3000:]
    for word in [
        f"{sft} has no trained score head",
        "causal LM, not a reward model",
        "--algo reward",
    ]:
        assert word in message[0], message[0]
    assert not (tmp_path / "out" / "final").exists()


def test_an_adapter_directory_as_the_model_loads_its_base_and_the_adapter(tmp_path, capsys):
    """As PEFT's AutoPeftModel classes (and transformers with peft installed) do: the base named
    in adapter_config.json, then the adapter, whose weights continue training (lora_B saved
    nonzero comes back, not PEFT's zero init); the tokenizer is the base's."""
    import numpy as np
    from flax import nnx

    from jaxrl import lora, models
    from jaxrl.models.weights_io import SafetensorsFile

    base = str(task.asset_path("sft_model"))
    model = models.from_pretrained(base)
    lora.apply_lora(model, lora.LoraConfig(r=2, target_modules=["q_proj"]), nnx.Rngs(0))
    state = nnx.state(model, nnx.Param)
    nnx.update(model, jax.tree.map(lambda x: x + 0.01, state))  # lora_B no longer zero
    adapter = tmp_path / "adapter"
    lora.save_peft_adapter(model, adapter, base_model_name_or_path=base)
    saved = SafetensorsFile(adapter / "adapter_model.safetensors")
    key = next(k for k in saved.keys() if k.endswith("lora_B.weight"))

    out = tmp_path / "out"
    argv = [*BASE, *_data(tmp_path), "--learning_rate", "1e-9", "--output_dir", str(out)]
    assert main([*argv, "--model_name_or_path", str(adapter)]) == 0, capsys.readouterr().err[-3000:]
    trained = SafetensorsFile(out / "final" / "adapter_model.safetensors")
    np.testing.assert_allclose(trained.get(key), saved.get(key), atol=1e-5)
    assert np.abs(saved.get(key)).min() > 0.005


def test_an_adapter_directory_where_a_full_model_is_needed_says_so(tmp_path):
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text(
        json.dumps({"base_model_name_or_path": "org/base"})
    )
    from jaxrl import models

    with pytest.raises(ValueError, match="is a PEFT adapter .* for the base model 'org/base'"):
        models.from_pretrained(adapter)
    (adapter / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA"}))
    with pytest.raises(ValueError, match="names no base model"):
        models.from_pretrained(adapter)


# Config ranges: refused when the config is built, before any model or data is loaded.
RANGE_CASES = [
    ("dpo", "beta", "inf", "`beta` must be a finite number > 0 and <= 1000; got inf"),
    ("dpo", "beta", "nan", "`beta` must be a finite number > 0 and <= 1000; got nan"),
    ("dpo", "beta", "-0.1", "`beta` must be a finite number > 0 and <= 1000; got -0.1"),
    ("dpo", "beta", "1e9", "got 1000000000.0. beta scales the implicit reward"),
    ("grpo", "beta", "inf", "`beta` must be a finite number >= 0 and <= 1000; got inf"),
    ("grpo", "beta", "nan", "got nan. beta weighs the KL"),
    ("rloo", "beta", "-1", "`beta` must be a finite number >= 0 and <= 1000; got -1"),
    ("rloo", "beta", "1e9", "got 1000000000.0"),
    ("grpo", "epsilon", "-0.2", "`epsilon` must be a finite number >= 0; got -0.2"),
    ("grpo", "temperature", "0", "`temperature` must be a finite number > 0 and <= 100; got 0"),
    ("rloo", "temperature", "-1", "`temperature` must be a finite number > 0 and <= 100; got -1"),
    ("grpo", "temperature", "1e9", "got 1000000000.0. Logits are divided by it"),
    ("ppo", "temperature", "1e9", "`temperature` must be a finite number > 0 and <= 100"),
]


@pytest.mark.parametrize("algo,field,value,words", RANGE_CASES, ids=[f"{c[0]} {c[1]}={c[2]}" for c in RANGE_CASES])  # fmt: skip
def test_config_values_out_of_range_are_refused(tmp_path, capsys, algo, field, value, words):
    argv = ["--algo", algo, f"--{field}", value, "--output_dir", str(tmp_path / "out")]
    assert main(argv) == 2
    err = capsys.readouterr().err
    message = _error_lines(err)
    assert len(message) == 1 and "Traceback" not in err, err[-3000:]
    assert words in message[0], message[0]


def test_completions_must_fit_the_models_positions(tmp_path, capsys):
    """The shipped model has 64 positions (the character tokenizer adds no special tokens)."""
    out = ["--output_dir", str(tmp_path / "out")]
    assert main(["--algo", "grpo", *ONLINE, *out, "--max_completion_length", "100"]) == 2
    message = _error_lines(capsys.readouterr().err)
    assert len(message) == 1, message
    assert "max_completion_length=100 plus the longest prompt of the train dataset" in message[0]
    assert "beyond the model's 64 positions" in message[0]
    longest = int(re.search(r"\((\d+) tokens, row", message[0]).group(1))
    assert f"is {longest + 100} tokens" in message[0]
    assert f"Lower max_completion_length to at most {64 - longest}" in message[0]

    rows = [{"prompt": "1+1="}, {"prompt": "12+" * 40 + "1="}]
    data = ["--dataset_name", _jsonl(tmp_path / "long.jsonl", rows)]
    argv = ["--algo", "rloo", *ONLINE, *out, *data, "--reward_funcs", "arith_correct"]
    assert main(argv) == 2
    message = _error_lines(capsys.readouterr().err)
    assert len(message) == 1, message
    assert "Prompt 1 of the train dataset is 122 tokens long" in message[0]
    assert "only 64 positions" in message[0]


def test_ppo_rollouts_must_fit_the_models_positions(tmp_path, capsys):
    """PPO's queries plus `response_length` beyond the shipped model's 64 positions: exit 2 at
    the first rollout, naming the largest response_length that fits."""
    argv = ["--algo", "ppo", "--max_steps", "1", "--disable_tqdm", "true", "--save_strategy", "no"]
    argv += ["--response_length", "100", "--output_dir", str(tmp_path / "out")]
    assert main(argv) == 2
    err = capsys.readouterr().err
    message = _error_lines(err)
    assert len(message) == 1 and "Traceback" not in err, err[-3000:]
    assert "response_length=100 plus the longest query" in message[0]
    assert "beyond the model's 64 positions" in message[0]
    longest = int(re.search(r"\((\d+) tokens, row", message[0]).group(1))
    assert f"Lower response_length to at most {64 - longest}" in message[0]
