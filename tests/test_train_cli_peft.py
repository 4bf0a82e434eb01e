"""`python -m jaxrl.train --use_peft true --lora_r ...`: TRL ModelConfig's PEFT/bitsandbytes flags
on the CLI build the same LoRA setup as `jaxrl.scripting.get_peft_config`, train only the adapters
and export a PEFT adapter; flags that would do nothing are refused."""

import json
import logging

import numpy as np
import pytest
from flax import nnx

from jaxrl.core import quant
from jaxrl.data import task
from jaxrl.train import build_trainer, main

MODEL = str(task.asset_path("sft_model"))
FLAGS = ["--model_name_or_path", MODEL, "--disable_tqdm", "true", "--report_to", "none"]
FLAGS += ["--per_device_train_batch_size", "4", "--save_strategy", "no"]
FLAGS += ["--mesh_data", "1", "--mesh_fsdp", "1", "--mesh_tensor", "1"]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """32 rows of the embedded task (tokenizing all 4000 would dominate the test)."""
    path = tmp_path_factory.mktemp("data") / "sft.jsonl"
    lines = task.asset_path("sft_train.jsonl").read_text().splitlines()[:32]
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def base(data: str, out) -> list[str]:
    return ["--algo", "sft", *FLAGS, "--dataset_name", data, "--output_dir", str(out)]


@pytest.mark.slow
def test_cli_lora_trains_adapters_only_and_exports_peft(tmp_path, data, caplog):
    from safetensors.numpy import load_file

    out = tmp_path / "run"
    flags = [*base(data, out), "--max_steps", "2", "--learning_rate", "1e-2"]
    flags += ["--use_peft", "true", "--lora_r", "4", "--lora_alpha", "8"]
    flags += ["--lora_target_modules", "q_proj", "v_proj"]
    with caplog.at_level(logging.INFO, logger="jaxrl"):
        assert main(flags) == 0
    # The q/v adapters (r=4 A and B of each projection) are all that is trained, as
    # scripting.get_peft_config builds them from the same fields.
    hidden, layers, kv = 128, 4, 64  # the shipped model: 4 heads, 2 KV heads of 32
    want = layers * (4 * (hidden + hidden) + 4 * (hidden + kv))
    assert f"LoRA: trainable params {want} ||" in caplog.text
    final = out / "final"
    assert not (final / "model.safetensors").exists()
    config = json.loads((final / "adapter_config.json").read_text())
    assert config["r"] == 4 and config["lora_alpha"] == 8
    targets = config["target_modules"]  # full module names, as PEFT may write them
    assert len(targets) == 8 and all(
        t.endswith(("self_attn.q_proj", "self_attn.v_proj")) for t in targets
    )
    weights = load_file(final / "adapter_model.safetensors")
    assert sum(w.size for w in weights.values()) == want
    assert all("lora_" in k for k in weights)
    # LoRA B starts at zero; two steps at lr 1e-2 moved it, so the adapter trained.
    assert max(np.abs(w).max() for k, w in weights.items() if "lora_B" in k) > 0
    assert "library_name: peft" in (final / "README.md").read_text()


def test_cli_qlora_flags_quantize_the_base(tmp_path, data):
    flags = [*base(data, tmp_path), "--max_steps", "1"]
    trainer = build_trainer([*flags, "--use_peft", "true", "--load_in_4bit", "true"])
    kernels = [
        v.get_value()
        for _, v in nnx.iter_graph(trainer.model)
        if isinstance(v, nnx.Param) and isinstance(v.get_value(), quant.QuantizedArray)
    ]
    assert trainer.is_peft and kernels and all(isinstance(k, quant.NF4Array) for k in kernels)


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--lora_r", "4"], "--use_peft true"),
        (["--use_peft", "true", "--use_dora", "true"], "DoRA"),
        (["--use_peft", "true", "--bnb_4bit_quant_storage", "uint8"], "bnb_4bit_quant_storage"),
        (["--load_in_4bit", "true"], "needs peft_config"),
    ],
)
def test_cli_peft_flags_that_would_do_nothing_are_refused(tmp_path, data, capsys, extra, message):
    flags = [*base(data, tmp_path), "--max_steps", "1"]
    assert main([*flags, *extra]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.slow
def test_cli_lora_on_policy_trains_adapters_and_exports_peft(tmp_path, caplog):
    # GRPO with --use_peft on the embedded task: one small update, the PEFT adapter exported.
    out = tmp_path / "grpo"
    flags = ["--algo", "grpo", "--output_dir", str(out), "--max_steps", "1"]
    flags += ["--eval_strategy", "no", "--eval_on_start", "false", "--save_strategy", "no"]
    flags += ["--per_device_train_batch_size", "1", "--num_generations", "2"]
    flags += ["--generation_batch_size", "16", "--max_completion_length", "4"]
    flags += ["--mesh_data", "-1", "--mesh_fsdp", "1", "--disable_tqdm", "true"]
    flags += ["--use_peft", "true", "--lora_r", "2", "--lora_target_modules", "q_proj"]
    with caplog.at_level(logging.INFO, logger="jaxrl"):
        assert main(flags) == 0
    hidden, layers = 128, 4
    want = layers * 2 * (hidden + hidden)  # q_proj: A [2, 128] and B [128, 2] per layer
    assert f"LoRA: trainable params {want} ||" in caplog.text
    assert (out / "final" / "adapter_config.json").is_file()
    assert not (out / "final" / "model.safetensors").exists()
