"""transformers model objects read in memory (`jaxrl.models.from_transformers`): the same model
as loading the directory the object would save, placed on the mesh the same way."""

from __future__ import annotations

import sys

import jax
import numpy as np
import pytest
import torch
import transformers
from flax import nnx

from jaxrl.models import from_pretrained, from_transformers
from jaxrl.models.hf_objects import StateDictReader
from jaxrl.parallel import make_mesh
from tests.model_calls import merged_call
from tests.models.conftest import FAMILIES, padded_batch, torch_logits


def _flat(model) -> dict:
    return {p: v.get_value() for p, v in nnx.to_flat_state(nnx.state(model))}


def _assert_same_model(ours, want) -> None:
    a, b = _flat(ours), _flat(want)
    assert sorted(a) == sorted(b)
    for path in b:
        np.testing.assert_array_equal(np.asarray(a[path]), np.asarray(b[path]), err_msg=str(path))
        assert a[path].sharding == b[path].sharding, path


@pytest.mark.parametrize(
    ("family", "scan"), [("qwen2", False), ("gemma3", True), ("gpt2", False), ("mistral", True)]
)
def test_object_is_its_directory(hf_causal, family, scan):
    """Tied (qwen2) and untied heads, GPT-2's Conv1D layout, scanned and unrolled stacks, on an
    fsdp x tensor mesh: parameter for parameter and placement for placement the directory's
    model; the logits are the torch model's."""
    ref = hf_causal(family)
    mesh = make_mesh(1, 2, 2, devices=jax.devices()[:4])
    ours = from_transformers(ref.model, mesh=mesh, scan_layers=scan)
    _assert_same_model(ours, from_pretrained(ref.path, mesh=mesh, scan_layers=scan))
    assert ours.config.mesh == mesh
    ids, mask, _ = padded_batch()
    logits = np.asarray(merged_call(*nnx.split(ours), ids, mask)) * mask[..., None]
    want = torch_logits(ref.model, ids, mask) * mask[..., None]
    np.testing.assert_allclose(logits, want, atol=1e-4)


def test_bf16_object_and_param_dtype():
    """A bf16 torch model is read bit for bit into bf16 params, and upcast exactly to f32."""
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(FAMILIES["llama"][0]()).to(torch.bfloat16)
    want = hf.model.layers[1].mlp.down_proj.weight.detach().float().numpy().T
    bf16 = from_transformers(hf, param_dtype=jax.numpy.bfloat16)
    kernel = bf16.model.layers[1].mlp.down_proj.kernel.get_value()
    assert kernel.dtype == jax.numpy.bfloat16
    np.testing.assert_array_equal(np.asarray(kernel, np.float32), want)
    f32 = from_transformers(hf, param_dtype=jax.numpy.float32)
    np.testing.assert_array_equal(np.asarray(f32.model.layers[1].mlp.down_proj.kernel), want)


def test_sequence_classifier_object_keeps_its_labels_and_score():
    """An object built from a config has no `architectures`: its class tells a classifier
    (num_labels and score head kept) from a causal LM (score head new, as from its directory)."""
    torch.manual_seed(1)
    config = FAMILIES["qwen3"][0]()
    config.num_labels = 3
    hf = transformers.AutoModelForSequenceClassification.from_config(config).eval()
    assert not getattr(hf.config, "architectures", None)
    ours = from_transformers(hf, task="sequence_classification")
    assert ours.num_labels == 3
    np.testing.assert_array_equal(np.asarray(ours.score.kernel), hf.score.weight.detach().numpy().T)
    ids, mask, _ = padded_batch()
    with torch.no_grad():
        want = hf(
            input_ids=torch.from_numpy(np.where(mask == 1, ids, 0)).long(),
            attention_mask=torch.from_numpy(mask).long(),
        ).logits.numpy()
    np.testing.assert_allclose(
        np.asarray(merged_call(*nnx.split(ours), ids, mask)), want, atol=1e-4
    )

    causal = transformers.AutoModelForCausalLM.from_config(FAMILIES["qwen3"][0]())
    with pytest.warns(UserWarning, match="The given Qwen3ForCausalLM has no 'score.weight'"):
        fresh = from_transformers(causal, task="sequence_classification")
    assert fresh.num_labels == 1


def test_later_changes_to_the_torch_model_do_not_reach_ours():
    torch.manual_seed(2)
    hf = transformers.AutoModelForCausalLM.from_config(FAMILIES["llama"][0]())
    ours = from_transformers(hf)
    before = np.asarray(ours.model.embed_tokens.embedding).copy()
    with torch.no_grad():
        hf.model.embed_tokens.weight.add_(1.0)
    np.testing.assert_array_equal(np.asarray(ours.model.embed_tokens.embedding), before)


def test_not_a_transformers_model_and_no_torch(monkeypatch):
    with pytest.raises(TypeError, match="transformers PreTrainedModel"):
        from_transformers(object())
    monkeypatch.setitem(sys.modules, "torch", None)  # as on an install without the extra
    with pytest.raises(ImportError, match=r'pip install "jaxrl\[torch\]"'):
        StateDictReader({})
