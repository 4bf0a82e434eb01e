"""jaxrl on its base install, without torch: the embedded DDPO job runs on the shipped tiny
pipeline, a run is not preceded by transformers' "PyTorch was not found" notice, and what truly
needs torch (a `.bin` checkpoint) exits 2 naming the extra to install.

In-process tests hide torch with a `sys.modules` stub (enough for code that imports torch
directly); the CLI runs in subprocesses that do not see torch at all (`tests/no_torch.py`)."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from no_torch import command
from xla_flags import with_devices

import jaxrl
from jaxrl.models.diffusion import load_pipeline
from jaxrl.models.diffusion.tiny import CLIP_TEXT, UNET, tiny_pipeline
from jaxrl.train import main

NOTICE = "PyTorch was not found"


@pytest.fixture
def without_torch(monkeypatch):
    """`import torch` fails from here on. (Not a whole base install: transformers found torch
    when this process imported it and cannot load a tokenizer under the stub; the subprocess
    tests below see no torch at all.)"""
    monkeypatch.setitem(sys.modules, "torch", None)


def test_tiny_pipeline_ships_in_the_package_as_safetensors(monkeypatch, tmp_path):
    with monkeypatch.context() as m:
        m.setitem(sys.modules, "torch", None)
        m.setenv("JAXRL_CACHE", str(tmp_path / "empty_cache"))  # where torch built it before
        path = tiny_pipeline()
    assert path.is_relative_to(Path(jaxrl.__file__).parent)  # package data: wheels have it
    weights = sorted(p.relative_to(path).as_posix() for p in path.rglob("*.safetensors"))
    assert weights == [
        "text_encoder/model.safetensors",
        "unet/diffusion_pytorch_model.safetensors",
        "vae/diffusion_pytorch_model.safetensors",
    ]
    assert not list(path.rglob("*.bin"))
    sd = load_pipeline(path)
    assert sd.unet.config.block_out_channels == UNET["block_out_channels"]
    assert sd.text_encoder.config.hidden_size == CLIP_TEXT["hidden_size"]
    (ids,) = sd.tokenizer(["a photo of a cat"], padding="max_length", max_length=20).input_ids
    assert len(ids) == 20 and ids[0] == CLIP_TEXT["bos_token_id"]
    assert sd.tokenizer.decode(ids, skip_special_tokens=True) == "a photo of a cat"
    # Seeded random weights, not an all-zero placeholder.
    kernel = np.asarray(sd.unet.conv_in.kernel[...])
    assert kernel.shape == (3, 3, 4, 8) and 0.05 < kernel.std() < 1.0


def test_bin_checkpoint_without_torch_exits_2_naming_the_extra(without_torch, tmp_path, capsys):
    pipe = tmp_path / "sd"
    shutil.copytree(tiny_pipeline(), pipe)
    (pipe / "text_encoder" / "model.safetensors").unlink()
    (pipe / "text_encoder" / "pytorch_model.bin").write_bytes(b"a PyTorch pickle")
    argv = ["--algo", "ddpo", "--pretrained_model", str(pipe), "--logdir", str(tmp_path / "o")]
    assert main(argv) == 2
    err = capsys.readouterr().err
    (message,) = [line for line in err.splitlines() if line.startswith("jaxrl.train: error:")]
    assert "pytorch_model.bin" in message and "pip install 'jaxrl[torch]'" in message
    assert "--index-url https://download.pytorch.org/whl/cpu" in message
    assert "Traceback" not in err


def _run(*args: str, **env: str) -> subprocess.CompletedProcess:
    full_env = {**os.environ, "XLA_FLAGS": with_devices(1), **env}
    return subprocess.run(command(*args), env=full_env, capture_output=True, text=True, timeout=900)


@pytest.mark.slow
def test_import_without_torch_prints_no_pytorch_notice():
    probe = (
        "import jaxrl, jaxrl.train\ntry:\n    import torch\nexcept ImportError:\n    print('ok')"
    )
    done = _run("-c", probe)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-3000:]
    assert NOTICE not in done.stderr + done.stdout


@pytest.mark.slow
def test_embedded_ddpo_job_runs_without_torch(tmp_path):
    """`python -m jaxrl.train --algo ddpo`, one small epoch, with an empty cache: exit 0, the
    embedded jobs' layout (outputs/ddpo in the working directory: metrics, model, images) and a
    progress line per log, as the other trainers print without a terminal."""
    small = ["--num_epochs", "1", "--sample_num_steps", "2", "--sample_batch_size", "2"]
    small += ["--sample_num_batches_per_epoch", "1", "--train_batch_size", "2"]
    small += ["--train_gradient_accumulation_steps", "1"]
    done = _run("-m", "jaxrl.train", "--algo", "ddpo", *small, JAXRL_CACHE=str(tmp_path))
    assert done.returncode == 0, done.stderr[-3000:]
    out = Path("outputs/ddpo")  # the test's own empty working directory (conftest)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert any("reward_mean" in r for r in rows)
    assert (out / "unet" / "config.json").exists() and (out / "images" / "epoch_0").is_dir()
    assert "step 1/1" in done.stdout and "reward_mean=" in done.stdout
    assert NOTICE not in done.stderr + done.stdout
