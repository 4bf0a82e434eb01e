"""jaxrl.models.hf_keys: every param of ours maps onto the key and shape transformers gives it,
and the layout conversion round-trips; the models layer never imports jaxrl.lora."""

from __future__ import annotations

import ast
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers
from flax import nnx

from jaxrl.models import build_model, config_from_hf, hf_keys
from tests.models.conftest import FAMILIES

MODELS_DIR = Path(hf_keys.__file__).parent


def _abstract_state(hf_config, scan_layers: bool):
    config = config_from_hf(hf_config, scan_layers=scan_layers)
    model = nnx.eval_shape(lambda: build_model(config, nnx.Rngs(0), "causal_lm", 1))
    return nnx.state(model), config


@pytest.mark.parametrize("scan_layers", [False, True])
@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_keys_and_shapes_match_transformers(family, scan_layers):
    hf_config = FAMILIES[family][0]()
    with torch.device("meta"):
        reference = transformers.AutoModelForCausalLM.from_config(hf_config)
    want = {
        k: tuple(v.shape)
        for k, v in reference.state_dict().items()
        if not k.endswith(("rotary_emb.inv_freq", ".attn.bias", ".attn.masked_bias"))
    }
    if hf_config.tie_word_embeddings:
        want.pop("lm_head.weight", None)
    state, config = _abstract_state(hf_config, scan_layers)
    got = {}
    for entry in hf_keys.entries(state, config):
        for key in entry.keys():
            got[key] = tuple(entry.hf_shape)
    assert got == want


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_layout_round_trip(family):
    state, config = _abstract_state(FAMILIES[family][0](), scan_layers=True)
    rng = np.random.default_rng(0)
    for entry in hf_keys.entries(state, config):
        x = rng.standard_normal(entry.hf_shape).astype(np.float32)
        ours = hf_keys.hf_to_ours(x, entry.path, entry.layer_shape, config, entry.layout)
        assert ours.shape == tuple(entry.layer_shape)
        back = hf_keys.ours_to_hf(ours, entry.path, entry.hf_shape, config, entry.layout)
        np.testing.assert_array_equal(back, x)


def test_models_never_import_lora():
    """jaxrl.models sits below jaxrl.lora: LoRA and the value-head loader with PEFT options
    (`jaxrl.lora.value_head`) import the models, never the other way round."""
    offenders = []
    for path in sorted(MODELS_DIR.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            else:
                continue
            if any(n == "jaxrl.lora" or n.startswith("jaxrl.lora.") for n in names):
                offenders.append(str(path.relative_to(MODELS_DIR)))
    assert offenders == []
