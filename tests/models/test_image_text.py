"""Gemma 3's image-text checkpoints (`Gemma3ForConditionalGeneration`, gemma-3-4b/12b/27b):
jaxrl loads and trains their language model on text; the vision tower and projector are never
run and `save_pretrained` copies them through bit for bit. Logits vs transformers, generation
and the load/save round trip are in the FAMILIES tests (`gemma3_vlm`)."""

import json
import shutil
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import peft
import pytest
import torch
import transformers
from flax import nnx
from safetensors import safe_open

from jaxrl import lora
from jaxrl.models import from_config, from_pretrained, save_pretrained
from tests.models.conftest import FAMILIES, padded_batch, torch_logits


def _tensors(directory) -> dict[str, np.ndarray]:
    """Every tensor of a (possibly sharded) safetensors checkpoint, bf16 viewed as uint16."""
    out = {}
    for file in sorted(directory.glob("*.safetensors")):
        with safe_open(file, "pt") as f:
            for key in f.keys():
                t = f.get_tensor(key)
                out[key] = (t.view(torch.int16) if t.dtype == torch.bfloat16 else t).numpy()
    return out


def _masked_max_diff(a, b, mask) -> float:
    return float(np.max(np.abs(np.asarray(a) - np.asarray(b)) * mask[..., None]))


def _perturbed(model):
    """The model with every language-model weight changed (as training would)."""
    graphdef, params = nnx.split(model)
    params = jax.tree.map(lambda x: x * 1.01 + 0.001, params)
    return nnx.merge(graphdef, params)


def test_vision_weights_copied_through_and_language_weights_saved(hf_causal, tmp_path):
    ref = hf_causal("gemma3_vlm")
    source = _tensors(ref.path)
    # transformers' on-disk layout (`language_model.model.*`), which jaxrl writes too
    vision = {k for k in source if not k.startswith("language_model.model.")}
    assert any(k.startswith("vision_tower.") for k in vision)
    assert any(k.startswith("multi_modal_projector.") for k in vision)

    model = _perturbed(from_pretrained(ref.path))
    save_pretrained(model, tmp_path)
    saved = _tensors(tmp_path)
    assert set(saved) == set(source)  # the tied LM head is not written, as transformers does
    for key in vision:
        assert saved[key].dtype == source[key].dtype
        np.testing.assert_array_equal(saved[key], source[key], err_msg=key)
    embed = "language_model.model.embed_tokens.weight"
    np.testing.assert_allclose(saved[embed], source[embed] * 1.01 + 0.001, rtol=1e-6)

    config = json.loads((tmp_path / "config.json").read_text())
    assert config["model_type"] == "gemma3"
    assert config["architectures"] == ["Gemma3ForConditionalGeneration"]
    assert config["vision_config"]["hidden_size"] == 16
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    ids, right, _ = padded_batch()
    got = model(jnp.asarray(np.where(right == 1, ids, 0)), jnp.asarray(right))
    assert _masked_max_diff(torch_logits(reloaded, ids, right), got, right) <= 1e-5


def test_saving_over_the_source_checkpoint(hf_causal, tmp_path):
    """The vision weights are read before the checkpoint they come from is overwritten."""
    ref = hf_causal("gemma3_vlm")
    shutil.copytree(ref.path, tmp_path / "ckpt")
    source = _tensors(tmp_path / "ckpt")
    model = _perturbed(from_pretrained(tmp_path / "ckpt"))
    save_pretrained(model, tmp_path / "ckpt")
    saved = _tensors(tmp_path / "ckpt")
    assert set(saved) == set(source)
    for key in source:
        if not key.startswith("language_model.model."):
            np.testing.assert_array_equal(saved[key], source[key], err_msg=key)


def test_save_errors_and_warnings(hf_causal, tmp_path):
    ref = hf_causal("gemma3_vlm")
    shutil.copytree(ref.path, tmp_path / "gone")
    model = from_pretrained(tmp_path / "gone")
    shutil.rmtree(tmp_path / "gone")
    with pytest.raises(FileNotFoundError, match="vision-tower weights .* no longer exists"):
        save_pretrained(model, tmp_path / "out")

    fresh = from_config(FAMILIES["gemma3_vlm"][0]())
    with pytest.warns(UserWarning, match="no vision-tower weights"):
        save_pretrained(fresh, tmp_path / "fresh")
    assert not any("vision" in k for k in _tensors(tmp_path / "fresh"))


def test_sequence_classification(hf_seq_cls, tmp_path):
    """`Gemma3ForSequenceClassification` (the image-text model with a score head): scores at
    the last non-pad token (the text config's pad id) equal transformers', and it saves back."""
    ref = hf_seq_cls("gemma3_vlm")
    assert type(ref.model).__name__ == "Gemma3ForSequenceClassification"
    model = from_pretrained(ref.path, task="sequence_classification")
    ids, right, _ = padded_batch()
    ids = np.where(right == 1, ids, 0)
    with torch.no_grad():
        want = ref.model(input_ids=torch.from_numpy(ids).long()).logits.numpy()
    got = np.asarray(model(jnp.asarray(ids)))
    np.testing.assert_allclose(got, want, atol=1e-5)
    save_pretrained(model, tmp_path)
    reloaded = transformers.AutoModelForSequenceClassification.from_pretrained(tmp_path).eval()
    assert type(reloaded).__name__ == "Gemma3ForSequenceClassification"
    with torch.no_grad():
        again = reloaded(input_ids=torch.from_numpy(ids).long()).logits.numpy()
    np.testing.assert_allclose(again, want, atol=1e-6)


def test_lora_adapters_match_peft(hf_causal, tmp_path):
    """PEFT adapts the vision tower's `q_proj`/`v_proj` too (same names): an untrained one
    (lora_B zero) changes nothing and is dropped on load, a trained one is refused; the
    language model's adapters equal PEFT's, and jaxrl's file loads in PEFT with equal logits."""
    ref = hf_causal("gemma3_vlm")
    with pytest.raises(ValueError, match="No default LoRA targets for 'gemma3'"):
        lora.apply_lora(from_pretrained(ref.path), lora.LoraConfig(r=2), nnx.Rngs(0))

    def hf_model():
        return transformers.AutoModelForCausalLM.from_pretrained(
            ref.path, attn_implementation="eager"
        ).eval()

    torch.manual_seed(0)
    targets = ["q_proj", "v_proj"]
    policy = peft.get_peft_model(
        hf_model(), peft.LoraConfig(r=4, lora_alpha=8, target_modules=targets)
    ).eval()
    with torch.no_grad():  # train the language model's adapters only
        for name, p in policy.named_parameters():
            if "lora_B" in name and "language_model" in name:
                p.normal_(0, 0.1)
    policy.save_pretrained(tmp_path / "peft")
    ids, right, _ = padded_batch()
    model = lora.load_peft_adapter(from_pretrained(ref.path), tmp_path / "peft")
    ours = np.asarray(model(jnp.asarray(np.where(right == 1, ids, 0)), jnp.asarray(right)))
    theirs = torch_logits(policy, ids, right)
    assert _masked_max_diff(ours, theirs, right) < 1e-4
    assert _masked_max_diff(ours, torch_logits(ref.model, ids, right), right) > 0.05

    lora.save_peft_adapter(model, tmp_path / "ours", base_model_name_or_path=str(ref.path))
    reloaded = peft.PeftModel.from_pretrained(hf_model(), tmp_path / "ours").eval()
    assert _masked_max_diff(torch_logits(reloaded, ids, right), ours, right) < 1e-4

    with torch.no_grad():
        for name, p in policy.named_parameters():
            if "lora_B" in name and "vision_tower" in name:
                p.normal_(0, 0.1)
    policy.save_pretrained(tmp_path / "vision")
    with pytest.raises(ValueError, match="trained adapters outside the language model"):
        lora.load_peft_adapter(from_pretrained(ref.path), tmp_path / "vision")


def test_reads_the_module_named_layout(hf_causal, tmp_path):
    """Checkpoints named as transformers v5 names the modules (`model.language_model.*`,
    `model.vision_tower.*`; what other tools write) load as well, and logits match."""
    from safetensors.numpy import save_file

    ref = hf_causal("gemma3_vlm")
    renamed = {}
    for key, value in _tensors(ref.path).items():
        key = key.replace("language_model.model.", "model.language_model.")
        renamed[key if key.startswith("model.") else "model." + key] = value
    assert all(v.dtype != np.int16 for v in renamed.values())  # f32 checkpoint
    (tmp_path / "ckpt").mkdir()
    shutil.copy(ref.path / "config.json", tmp_path / "ckpt")
    save_file(renamed, tmp_path / "ckpt" / "model.safetensors", metadata={"format": "pt"})
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no weight left unused
        model = from_pretrained(tmp_path / "ckpt")
    ids, right, _ = padded_batch()
    got = model(jnp.asarray(np.where(right == 1, ids, 0)), jnp.asarray(right))
    assert _masked_max_diff(got, torch_logits(ref.model, ids, right), right) <= 1e-4
