"""The shipped tiny SD pipeline (`jaxrl/assets/tiny_sd/`) is what its recipe makes:
`tests/assets/make_tiny_sd.py` with diffusers/transformers (PyTorch) gives the same tensors and
configs, so the assets are reproducible and their configs are `jaxrl.models.diffusion.tiny`'s."""

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest

from jaxrl.models.diffusion import tiny
from jaxrl.models.weights_io import SafetensorsFile

ROOT = Path(__file__).resolve().parents[3]
WEIGHTS = (
    "unet/diffusion_pytorch_model.safetensors",
    "vae/diffusion_pytorch_model.safetensors",
    "text_encoder/model.safetensors",
)
TEXT_FILES = ("tokenizer/vocab.json", "tokenizer/merges.txt", "tokenizer/tokenizer.json")


def _recipe():
    spec = importlib.util.spec_from_file_location(
        "make_tiny_sd", ROOT / "tests" / "assets" / "make_tiny_sd.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow  # imports diffusers' PyTorch models (~20 s on a loaded 2-core machine)
def test_shipped_pipeline_is_what_its_recipe_builds(tmp_path):
    built = _recipe().build(tmp_path / "tiny_sd")
    shipped = tiny.tiny_pipeline()
    for name in WEIGHTS:
        ours, fresh = SafetensorsFile(shipped / name), SafetensorsFile(built / name)
        assert sorted(ours.keys()) == sorted(fresh.keys()), name
        for key in fresh.keys():
            np.testing.assert_array_equal(ours.get(key), fresh.get(key), err_msg=f"{name}:{key}")
    for name in TEXT_FILES:
        assert (shipped / name).read_text() == (built / name).read_text(), name
    # Configs: equal apart from the library versions that wrote them.
    for name in ("unet", "vae", "text_encoder", "scheduler"):
        file = "scheduler_config.json" if name == "scheduler" else "config.json"
        ours, fresh = (json.loads((d / name / file).read_text()) for d in (shipped, built))
        versions = ("_diffusers_version", "transformers_version")
        assert {k: v for k, v in ours.items() if k not in versions} == {
            k: v for k, v in fresh.items() if k not in versions
        }, name
