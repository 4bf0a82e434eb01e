"""Gemma 3's image-text forward (`from_pretrained(..., vision=True)`): the SigLIP tower, the
projector and image features in the language model equal transformers'
`Gemma3ForConditionalGeneration` (logits with and without images, the bidirectional mask of
image tokens, gradients of vision and language weights), and the model saves back to
transformers' layout. One tiny random checkpoint for the file: 2 SigLIP layers on 28 x 28
images of 7 x 7 patches (a 4 x 4 grid pooled to 2 x 2 = 4 image tokens), the Gemma 3 text
model of the FAMILIES tests (a sliding layer of window 3, narrower than an image)."""

import json
import shutil
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from flax import nnx
from safetensors import safe_open
from safetensors.numpy import save_file

from jaxrl import lora, parallel
from jaxrl.models import from_config, from_pretrained, save_pretrained
from jaxrl.models.hf_keys import entries, ours_to_hf
from tests.model_calls import jit_call
from tests.models.conftest import FAMILIES

IMAGE, BOI, EOI = 125, 123, 124
TOKENS = 4  # mm_tokens_per_image


def _config():
    text = FAMILIES["gemma3"][0]().to_dict()
    vision = transformers.SiglipVisionConfig(
        hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
        image_size=28, patch_size=7, vision_use_head=False,
    )  # fmt: skip
    return transformers.Gemma3Config(
        text_config=text,
        vision_config=vision.to_dict(),
        mm_tokens_per_image=TOKENS,
        image_token_index=IMAGE,
        boi_token_index=BOI,
        eoi_token_index=EOI,
    )


@pytest.fixture(scope="module")
def ref(tmp_path_factory):
    """(torch model, checkpoint dir): every weight random (transformers zero-inits the projection
    and the norms, which would hide their mapping)."""
    torch.manual_seed(0)
    config = _config()
    config._attn_implementation = "eager"
    model = transformers.Gemma3ForConditionalGeneration(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "mm_input_projection" in name:
                p.normal_(0, 0.3)
            elif "norm" in name or name.endswith("bias"):
                p.add_(0.2 * torch.randn_like(p))
    path = tmp_path_factory.mktemp("gemma3_vision")
    model.save_pretrained(path)
    return model, path


def _batch(seed: int = 0):
    """Three right-padded rows: two images (a block at 2..5, another at 9..12), no image, one
    image; `pixel_values` in transformers' layout [N, C, H, W] and per row [B, 2, C, H, W]."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(3, 120, size=(3, 16)).astype(np.int32)
    lengths = np.array([16, 11, 10])
    for row, starts in ((0, (2, 9)), (2, (3,))):
        for s in starts:
            ids[row, s - 1], ids[row, s : s + TOKENS], ids[row, s + TOKENS] = BOI, IMAGE, EOI
    mask = (np.arange(16)[None] < lengths[:, None]).astype(np.int32)
    ids = np.where(mask == 1, ids, 0)
    token_type_ids = (ids == IMAGE).astype(np.int32)
    pixels = rng.normal(size=(3, 3, 28, 28)).astype(np.float32)
    per_row = np.zeros((3, 2, 3, 28, 28), np.float32)
    per_row[0], per_row[2, 0] = pixels[:2], pixels[2]
    return ids, mask, token_type_ids, pixels, per_row


def _torch_logits(model, ids, mask, token_type_ids=None, pixels=None):
    kwargs = {}
    if token_type_ids is not None:
        kwargs["token_type_ids"] = torch.from_numpy(token_type_ids).long()
    if pixels is not None:
        kwargs["pixel_values"] = torch.from_numpy(pixels)
    with torch.no_grad():
        out = model(
            input_ids=torch.from_numpy(ids).long(),
            attention_mask=torch.from_numpy(mask).long(),
            **kwargs,
        )
    return out.logits.float().numpy()


def _max_diff(a, b, mask) -> float:
    return float(np.max(np.abs(np.asarray(a) - np.asarray(b)) * mask[..., None]))


@pytest.fixture(scope="module")
def want(ref):
    model, _ = ref
    ids, mask, types, pixels, _ = _batch()
    return {
        "images": _torch_logits(model, ids, mask, types, pixels),
        "causal": _torch_logits(model, ids, mask, None, pixels),
        "text": _torch_logits(model, ids, mask),
    }


@pytest.mark.parametrize(
    "load", [{}, {"attention_impl": "xla"}, {"scan_layers": True}], ids=["blockwise", "xla", "scan"]
)
def test_logits_match_transformers(ref, want, load):
    _, path = ref
    model = from_pretrained(path, vision=True, **load)
    ids, mask, types, pixels, per_row = _batch()

    @nnx.jit  # the five forwards in one program
    def forwards(model, ids, mask, types, pixels, per_row):
        return (
            model(ids, mask, pixel_values=pixels, token_type_ids=types),
            model(ids, mask, pixel_values=per_row, token_type_ids=types),
            # Trainers call without a padding mask (right padding: causal attention is exact).
            model(ids, pixel_values=per_row, token_type_ids=types),
            model(ids, mask, pixel_values=pixels),
            model(ids, mask),
        )

    got, rows, unmasked, causal, text = forwards(
        model, *(jnp.asarray(x) for x in (ids, mask, types, pixels, per_row))
    )
    assert _max_diff(got, want["images"], mask) < 1e-5
    # The image block's bidirectional attention and the images themselves matter here.
    assert _max_diff(want["images"], want["causal"], mask) > 1e-2
    assert _max_diff(want["images"], want["text"], mask) > 1e-2
    assert _max_diff(rows, want["images"], mask) < 1e-5
    assert _max_diff(unmasked, want["images"], mask) < 1e-5
    assert _max_diff(causal, want["causal"], mask) < 1e-5
    assert _max_diff(text, want["text"], mask) < 1e-5


def test_gradients_match_torch(ref):
    """d(sum(w * logits)) wrt vision tower, projector and language-model weights, with
    `remat_policy="full"`."""
    torch_model, path = ref
    ids, mask, types, pixels, per_row = _batch(1)
    weights = np.random.default_rng(2).normal(size=(3, 16, 128)).astype(np.float32)
    weights *= mask[..., None]
    torch_model.zero_grad()
    out = torch_model(
        input_ids=torch.from_numpy(ids).long(),
        attention_mask=torch.from_numpy(mask).long(),
        token_type_ids=torch.from_numpy(types).long(),
        pixel_values=torch.from_numpy(pixels),
    )
    (out.logits * torch.from_numpy(weights)).sum().backward()
    want = {n: p.grad.numpy() for n, p in torch_model.named_parameters() if p.grad is not None}

    # Rematerialised layers (gradient checkpointing), the vision tower's included.
    model = from_pretrained(path, vision=True, remat_policy="full")
    graphdef, params = nnx.split(model)

    def loss(params):
        m = nnx.merge(graphdef, params)
        logits = m(jnp.asarray(ids), pixel_values=jnp.asarray(per_row), token_type_ids=types)
        return jnp.sum(logits * weights)

    grads = jax.jit(jax.grad(loss))(params)  # one program, not op-by-op compiles
    got = {}
    for entry in entries(grads, model.config):
        (key,) = entry.keys()
        value = np.asarray(entry.variable.get_value())
        got[key] = ours_to_hf(value, entry.path, entry.hf_shape, model.config, entry.layout)
    assert set(got) == set(want)
    for key in (
        "model.vision_tower.embeddings.patch_embedding.weight",
        "model.vision_tower.embeddings.position_embedding.weight",
        "model.vision_tower.encoder.layers.0.self_attn.q_proj.weight",
        "model.vision_tower.encoder.layers.1.mlp.fc1.bias",
        "model.vision_tower.post_layernorm.weight",
        "model.multi_modal_projector.mm_input_projection_weight",
        "model.multi_modal_projector.mm_soft_emb_norm.weight",
        "model.language_model.embed_tokens.weight",
        "model.language_model.layers.0.self_attn.k_proj.weight",
    ):
        scale = np.max(np.abs(want[key]))
        assert scale > 0, key
        np.testing.assert_allclose(got[key], want[key], atol=2e-5 * max(scale, 1.0), err_msg=key)


def _tensors(directory) -> dict[str, np.ndarray]:
    out = {}
    for file in sorted(directory.glob("*.safetensors")):
        with safe_open(file, "np") as f:
            out.update({k: f.get_tensor(k) for k in f.keys()})
    return out


def test_save_reload_round_trip(ref, tmp_path):
    """Changed vision and language weights are written in transformers' layout (the same keys
    as its own checkpoint), and transformers reloads them with our logits."""
    _, path = ref
    model = from_pretrained(path, vision=True)
    graphdef, params = nnx.split(model)
    model = nnx.merge(
        graphdef, jax.jit(lambda p: jax.tree.map(lambda x: x * 1.01 + 0.001, p))(params)
    )
    save_pretrained(model, tmp_path)
    saved, source = _tensors(tmp_path), _tensors(path)
    assert set(saved) == set(source)
    key = "vision_tower.encoder.layers.0.self_attn.q_proj.weight"
    np.testing.assert_allclose(saved[key], source[key] * 1.01 + 0.001, rtol=1e-6)
    assert json.loads((tmp_path / "config.json").read_text())["architectures"] == [
        "Gemma3ForConditionalGeneration"
    ]
    reloaded = transformers.AutoModelForImageTextToText.from_pretrained(tmp_path).eval()
    ids, mask, types, pixels, _ = _batch()
    got = jit_call(
        model, jnp.asarray(ids), jnp.asarray(mask), pixel_values=pixels, token_type_ids=types
    )
    assert _max_diff(got, _torch_logits(reloaded, ids, mask, types, pixels), mask) < 1e-5

    # The released Gemma 3 files name SigLIP as transformers v4 did (`vision_tower.vision_model.`)
    old = {k.replace("vision_tower.", "vision_tower.vision_model."): v for k, v in saved.items()}
    (tmp_path / "v4").mkdir()
    save_file(old, tmp_path / "v4" / "model.safetensors", metadata={"format": "pt"})
    shutil.copy(tmp_path / "config.json", tmp_path / "v4")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # every weight used
        again = from_pretrained(tmp_path / "v4", vision=True)
    got_again = jit_call(  # compiled as `got` was: bit-exact
        again, jnp.asarray(ids), jnp.asarray(mask), pixel_values=pixels, token_type_ids=types
    )
    np.testing.assert_array_equal(np.asarray(got_again), np.asarray(got))


def test_sharded_and_lora(ref):
    """On a (data, fsdp, tensor) mesh the vision params are sharded by their logical axes and
    logits are unchanged; PEFT's `q_proj` targets adapt the vision tower's layers too."""
    _, path = ref
    ids, mask, types, pixels, per_row = _batch()
    mesh = parallel.make_mesh(data=2, fsdp=2, tensor=2)
    model = from_pretrained(path, vision=True, mesh=mesh)
    fc1 = model.vision_tower.encoder.layers[0].mlp.fc1.kernel
    assert fc1.get_value().sharding.spec == jax.sharding.PartitionSpec("fsdp", "tensor")
    got = jax.jit(lambda m: m(jnp.asarray(ids), pixel_values=per_row, token_type_ids=types))(model)
    single = from_pretrained(path, vision=True)
    want = jit_call(
        single, jnp.asarray(ids), pixel_values=jnp.asarray(per_row), token_type_ids=types
    )
    assert _max_diff(got, want, mask) < 1e-5

    lora.apply_lora(single, lora.LoraConfig(r=2, target_modules=["q_proj"]), nnx.Rngs(0))
    adapted = single.vision_tower.encoder.layers[1].self_attn.q_proj
    assert type(adapted).__name__ == "LoraDense"
    assert type(single.model.layers[0].self_attn.q_proj).__name__ == "LoraDense"


def test_errors():
    config = _config()
    text_only = from_config(config)
    ids = jnp.zeros((1, 8), jnp.int32)
    with pytest.raises(ValueError, match="takes text only.*vision=True"):
        text_only(ids, pixel_values=jnp.zeros((1, 3, 28, 28)))
    with pytest.raises(ValueError, match="vision=True needs an image-text checkpoint"):
        from_config(FAMILIES["gemma3"][0](), vision=True)
    model = from_config(config, vision=True)
    ids = ids.at[0, 2:6].set(IMAGE)
    with pytest.raises(ValueError, match="Image features and image tokens do not match"):
        model(ids, pixel_values=jnp.zeros((2, 3, 28, 28)))
    with pytest.raises(ValueError, match="28 x 28"):
        model(ids, pixel_values=jnp.zeros((1, 3, 32, 32)))
    with pytest.raises(ValueError, match="task='causal_lm' only"):
        from_config(config, vision=True, task="sequence_classification")


def test_bf16_follows_torch_autocast(ref):
    """bf16 compute over f32 params (TRL's bf16=True) is torch autocast's numerics: mean |logit
    error| / mean |logit| against transformers under `torch.autocast` (SDPA), images and all.
    Measured over three random models: 4.4e-3 to 6.8e-3, all-bf16 activations 1.1e-2 to 1.2e-2,
    torch autocast's own gap to f32 8.6e-3 to 9.5e-3."""
    _, path = ref
    ids, mask, types, pixels, per_row = _batch()
    model = transformers.AutoModelForImageTextToText.from_pretrained(
        path, attn_implementation="sdpa"
    ).eval()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = _torch_logits(model, ids, mask, types, pixels)

    def gap(**dtypes) -> float:
        ours = from_pretrained(path, vision=True, dtype="bfloat16", **dtypes)
        run = jax.jit(lambda m: m(jnp.asarray(ids), pixel_values=per_row, token_type_ids=types))
        got = np.asarray(run(ours), np.float32)
        real = mask.astype(bool)
        return float(np.abs(got - want)[real].mean() / np.abs(want[real]).mean())

    autocast, all_bf16 = gap(), gap(residual_dtype="bfloat16")
    assert autocast < 8e-3
    assert autocast < 0.75 * all_bf16
