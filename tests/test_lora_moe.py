"""LoRA on mixture-of-experts models (jaxrl.lora's `LoraRouter` / `LoraExperts`) against PEFT 0.21
under transformers v5: the same adapters for `"all-linear"`, expert names and
`target_parameters` (PEFT turns router / expert targets into `ParamWrapper`s on the fused
`[E, out, in]` expert tensors), the same logits and LoRA gradients (scanned and unrolled, on an
8-device mesh and one device), adapter files each side loads, and PEFT's merged weights."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import peft
import pytest
import torch
import trl
from flax import nnx
from safetensors.numpy import load_file, save_file

from jaxrl import lora
from jaxrl.models import from_pretrained, save_pretrained
from jaxrl.parallel import make_mesh
from tests.model_calls import jit_call
from tests.models.conftest import padded_batch, torch_logits
from tests.test_lora import ATOL, hf_models, load_hf, masked_max_diff

EXPERTS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    return hf_models(tmp_path_factory)


def peft_model(path, **options):
    """PEFT's LoRA on the transformers model in `path`, with random B (non-zero adapters)."""
    torch.manual_seed(1)
    config = peft.LoraConfig(r=2, lora_alpha=4, init_lora_weights=False, **options)
    return peft.get_peft_model(load_hf(path), config).eval()


def adapter_file(directory) -> dict[str, np.ndarray]:
    return load_file(directory / "adapter_model.safetensors")


def file_shapes(directory) -> dict[str, tuple[int, ...]]:
    return {k: v.shape for k, v in adapter_file(directory).items()}


# family, scan_layers, PEFT options, the MoE adapters PEFT's file holds (layer 0): each MoE
# family and each way of reaching the router and experts.
PARITY_CASES = [
    # Attention via target_modules; routers, the fused gate_up (rank 2r, alpha 2a; the inner
    # ParamWrapper, `base_layer`) and down via target_parameters.
    (
        "qwen3_moe",
        True,
        {"target_modules": "all-linear"},
        ("gate", "experts", "experts.base_layer"),
    ),
    # Mixtral's v4 names; fused w1+w3 under rsLoRA: scaling 2a / sqrt(2r), not a / sqrt(r).
    (
        "mixtral",
        False,
        {"target_modules": ["q_proj", "w1", "w3", "w2", "gate"], "use_rslora": True},
        ("gate", "experts", "experts.base_layer"),
    ),
    # Explicit target_parameters: the fused gate_up keeps rank r.
    (
        "olmoe",
        True,
        {"target_modules": [], "target_parameters": EXPERTS},
        ("experts", "experts.base_layer"),
    ),
    # Qwen2-MoE is not converted by PEFT: "all-linear" reaches attention, the shared expert and
    # the dense layer; its router and experts only through target_parameters.
    (
        "qwen2_moe",
        False,
        {"target_modules": "all-linear", "target_parameters": ["mlp.gate.weight"]},
        ("gate",),
    ),
    # GPT-OSS: rank-r adapters on the native [E, D, 2F] gate_up_proj (gate/up interleaved in
    # B's columns) and [E, F, D] down_proj, next to attention projections with biases.
    (
        "gpt_oss",
        True,
        {"target_modules": ["q_proj", "o_proj"], "target_parameters": EXPERTS},
        ("experts", "experts.base_layer"),
    ),
]


@pytest.mark.parametrize(("family", "scan", "options", "moe_adapters"), PARITY_CASES)
def test_peft_parity_load_export_merge(hf_dir, tmp_path, family, scan, options, moe_adapters):
    path = hf_dir(family)
    policy = peft_model(path, **options)
    policy.save_pretrained(tmp_path / "peft")
    theirs_file = adapter_file(tmp_path / "peft")
    for name in moe_adapters:
        assert f"base_model.model.model.layers.0.mlp.{name}.lora_B.weight" in theirs_file

    ids, mask, _ = padded_batch()
    model = lora.load_peft_adapter(from_pretrained(path, scan_layers=scan), tmp_path / "peft")
    ours = np.asarray(jit_call(model, ids, mask))
    assert masked_max_diff(ours, torch_logits(policy, ids, mask), mask) < ATOL
    assert lora.trainable_parameters(model)[0] == policy.get_nb_trainable_parameters()[0]

    # Our file holds PEFT's tensors, and PEFT loads it with our logits.
    lora.save_peft_adapter(model, tmp_path / "ours")
    ours_file = adapter_file(tmp_path / "ours")
    assert ours_file.keys() == theirs_file.keys()
    for key, value in theirs_file.items():
        np.testing.assert_array_equal(ours_file[key], value, err_msg=key)
    reloaded = peft.PeftModel.from_pretrained(load_hf(path), tmp_path / "ours").eval()
    assert masked_max_diff(torch_logits(reloaded, ids, mask), ours, mask) < ATOL

    # Merged: the weights of PEFT's merge_and_unload.
    save_pretrained(lora.merge_lora(model), tmp_path / "merged")
    merged = load_hf(tmp_path / "merged").state_dict()
    want = policy.merge_and_unload().state_dict()
    assert merged.keys() == want.keys()
    for name, weight in want.items():
        np.testing.assert_allclose(merged[name].numpy(), weight.numpy(), atol=1e-6, err_msg=name)


def test_transformers_v4_adapter_loads_as_in_peft(hf_dir, tmp_path):
    """A Mixtral adapter saved under transformers v4 (one LoRA per expert and projection, the
    block named `block_sparse_moe`) loads as PEFT 0.21 loads it: w1 and w3 fused into one
    gate_up adapter of rank 2r (A stacked, B block-diagonal)."""
    path = hf_dir("mixtral")
    rng = np.random.default_rng(0)
    tensors = {}
    for layer in range(2):
        block = f"base_model.model.model.layers.{layer}.block_sparse_moe"
        tensors[f"{block}.gate.lora_A.weight"] = rng.normal(size=(2, 64))
        tensors[f"{block}.gate.lora_B.weight"] = rng.normal(size=(4, 2))
        for expert in range(4):
            for name, (n_in, n_out) in {"w1": (64, 96), "w3": (64, 96), "w2": (96, 64)}.items():
                key = f"{block}.experts.{expert}.{name}"
                tensors[f"{key}.lora_A.weight"] = 0.3 * rng.normal(size=(2, n_in))
                tensors[f"{key}.lora_B.weight"] = 0.3 * rng.normal(size=(n_out, 2))
    v4 = tmp_path / "v4"
    peft.LoraConfig(r=2, lora_alpha=4, target_modules=["w1", "w2", "w3", "gate"]).save_pretrained(
        v4
    )
    save_file(
        {k: v.astype(np.float32) for k, v in tensors.items()}, v4 / "adapter_model.safetensors"
    )
    theirs = peft.PeftModel.from_pretrained(load_hf(path), v4).eval()
    ours = lora.load_peft_adapter(from_pretrained(path, scan_layers=True), v4)
    ids, mask, _ = padded_batch()
    logits = np.asarray(jit_call(ours, ids, mask))
    assert masked_max_diff(logits, torch_logits(theirs, ids, mask), mask) < ATOL
    assert masked_max_diff(logits, torch_logits(load_hf(path), ids, mask), mask) > 0.1
    theirs.save_pretrained(tmp_path / "peft")  # PEFT's own v5 file of the converted adapter
    lora.save_peft_adapter(ours, tmp_path / "ours")
    want = adapter_file(tmp_path / "peft")
    assert adapter_file(tmp_path / "ours").keys() == want.keys()
    for key, value in adapter_file(tmp_path / "ours").items():
        np.testing.assert_allclose(value, want[key], atol=1e-7, err_msg=key)


def test_peft_conversion_of_targets(hf_dir):
    """PEFT's rewrite of `target_modules` for Qwen3-MoE (`_convert_peft_config_moe`), which
    `model.lora_config` keeps as PEFT's `peft_config` does."""
    model = lora.apply_lora(
        from_pretrained(hf_dir("qwen3_moe")),
        lora.LoraConfig(r=2, lora_alpha=4, target_modules="all-linear"),
        nnx.Rngs(0),
    )
    converted = peft_model(hf_dir("qwen3_moe"), target_modules="all-linear").peft_config["default"]
    ours = model.lora_config
    assert (
        set(ours.target_modules)
        == converted.target_modules
        == {"q_proj", "k_proj", "v_proj", "o_proj"}
    )
    assert set(ours.target_parameters) == converted.target_parameters
    assert dict(ours.rank_pattern) == converted.rank_pattern == {r".*\.gate_up_proj": 4}
    assert dict(ours.alpha_pattern) == converted.alpha_pattern == {r".*\.gate_up_proj": 8}
    experts = model.model.layers[0].mlp.experts
    assert isinstance(experts, lora.LoraExperts)
    assert experts.gate_up_lora_a.shape == (4, 64, 4)  # [E, D, 2r]
    assert experts.gate_up_lora_b.shape == (4, 4, 2, 32)  # [E, 2r, gate|up, F]
    assert experts.down_lora_b.shape == (4, 2, 64)
    assert isinstance(model.model.layers[1].mlp.gate, lora.LoraRouter)


@pytest.mark.parametrize(
    ("family", "options"),
    [
        # A regex loses its layer selection on converted MoE models (PEFT resolves it to names).
        ("qwen3_moe", {"target_modules": r".*\.1\.self_attn\.q_proj"}),
        ("qwen3_moe", {"target_modules": r".*\.1\.mlp\.experts\.(gate|up)_proj"}),
        ("mixtral", {"target_modules": ["w2", "gate"]}),
        # Per-layer target_parameters on an unrolled stack.
        (
            "olmoe",
            {
                "target_modules": ["o_proj"],
                "target_parameters": ["model.layers.1.mlp.experts.down_proj"],
            },
        ),
        # Qwen2-MoE: expert names reach the shared expert and the dense MLP only.
        ("qwen2_moe", {"target_modules": ["gate_proj", "shared_expert_gate"]}),
    ],
)
def test_adapted_tensors_follow_peft(hf_dir, tmp_path, family, options):
    path = hf_dir(family)
    peft_model(path, **options).save_pretrained(tmp_path / "peft")
    model = lora.apply_lora(
        from_pretrained(path), lora.LoraConfig(r=2, lora_alpha=4, **options), nnx.Rngs(0)
    )
    lora.save_peft_adapter(model, tmp_path / "ours")
    assert file_shapes(tmp_path / "ours") == file_shapes(tmp_path / "peft")
    # ... and jaxrl reads its own file back.
    again = lora.load_peft_adapter(from_pretrained(path), tmp_path / "ours")
    lora.save_peft_adapter(again, tmp_path / "again")
    for key, value in adapter_file(tmp_path / "ours").items():
        np.testing.assert_array_equal(adapter_file(tmp_path / "again")[key], value)


@pytest.mark.parametrize(
    ("family", "options", "message"),
    [
        ("qwen3_moe", {"target_modules": ["q_proj", "up_proj"]}, "without \\['gate_proj'\\]"),
        ("mixtral", {"target_modules": ["w1"]}, "without \\['w3'\\]"),
        ("qwen3_moe", {"target_modules": "all-linear", "lora_dropout": 0.05}, "lora_dropout"),
        ("qwen3_moe", {"target_modules": None}, "no default LoRA targets"),
        ("qwen2_moe", {"target_modules": ["gate"]}, "MoE router module"),
        ("qwen2_moe", {"target_modules": r".*\.experts\.3\.down_proj"}, "matched no linear layer"),
    ],
)
def test_targets_peft_refuses_are_refused(hf_dir, family, options, message):
    with pytest.raises(ValueError):  # PEFT refuses it too
        peft_model(hf_dir(family), **options)
    model = from_pretrained(hf_dir(family))
    with pytest.raises(ValueError, match=message):
        lora.apply_lora(model, lora.LoraConfig(r=2, **options), nnx.Rngs(0))


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"target_parameters": ["mlp.expert.down_proj"]}, "matched no parameter"),
        ({"target_parameters": ["self_attn.q_proj.weight"]}, "linear layer"),
    ],
)
def test_unsupported_target_parameters_are_refused(hf_dir, options, message):
    model = from_pretrained(hf_dir("qwen3_moe"))
    with pytest.raises(ValueError, match=message):
        lora.apply_lora(model, lora.LoraConfig(target_modules=["q_proj"], **options), nnx.Rngs(0))


def test_trl_and_peft_configs_carry_target_parameters():
    args = trl.ModelConfig(
        use_peft=True,
        lora_target_modules=["q_proj"],
        lora_target_parameters=EXPERTS,
        lora_dropout=0.0,
    )
    assert lora.LoraConfig.from_trl(args).target_parameters == tuple(sorted(EXPERTS))
    config = lora.LoraConfig.from_peft(
        peft.LoraConfig(
            target_parameters=EXPERTS, rank_pattern={"down_proj": 4}, alpha_pattern={"down_proj": 2}
        )
    )
    assert config.rank_and_alpha("model.layers.0.mlp.experts.down_proj") == (4, 2)
    assert config.rank_and_alpha("model.layers.0.mlp.experts.gate_up_proj") == (8, 8)


def torch_loss_and_grads(policy, ids, mask) -> tuple[float, dict[str, np.ndarray]]:
    """Mean squared logits over real tokens and its gradients of the LoRA weights, keyed as in
    PEFT's adapter file."""
    positions = np.maximum(np.cumsum(mask, axis=1) - 1, 0)
    policy.zero_grad()
    logits = policy(
        input_ids=torch.from_numpy(np.where(mask == 1, ids, 0)).long(),
        attention_mask=torch.from_numpy(mask).long(),
        position_ids=torch.from_numpy(positions).long(),
    ).logits
    loss = (logits.float() ** 2).mean(-1)[torch.from_numpy(mask).bool()].mean()
    loss.backward()
    grads = {
        name.replace(".default", ""): p.grad.numpy()
        for name, p in policy.named_parameters()
        if "lora_" in name
    }
    return float(loss), grads


@pytest.mark.parametrize(
    ("family", "options"),
    [
        ("qwen3_moe", {"target_modules": "all-linear"}),
        pytest.param(
            "gpt_oss",
            {"target_modules": ["q_proj", "o_proj"], "target_parameters": EXPERTS},
            marks=pytest.mark.slow,
        ),
    ],
)
def test_logits_and_gradients_equal_peft(hf_dir, tmp_path, family, options):
    """The loss and the gradients of every adapter (attention, routers, fused gate_up, down;
    GPT-OSS: its interleaved gate_up) equal torch autograd's through PEFT's ParamWrappers,
    unrolled on one device; scanned on an 8-device mesh (each device dispatches its own tokens,
    `shard_map`, the adapters gathered) they equal one device's."""
    path = hf_dir(family)
    policy = peft_model(path, **options)
    policy.save_pretrained(tmp_path / "peft")
    ids, mask, _ = padded_batch()
    ids, mask = np.tile(ids, (3, 1))[:8], np.tile(mask, (3, 1))[:8]
    want_loss, want = torch_loss_and_grads(policy, ids, mask)

    def run(scan, mesh):
        model = from_pretrained(path, scan_layers=scan, mesh=mesh)
        lora.load_peft_adapter(model, tmp_path / "peft")
        graphdef, adapter, base = lora.split_lora(model)

        @jax.jit
        def loss_and_grads(adapter, base):
            def loss_fn(adapter):
                logits = nnx.merge(graphdef, adapter, base)(jnp.asarray(ids), jnp.asarray(mask))
                per_token = jnp.mean(logits.astype(jnp.float32) ** 2, axis=-1)
                return jnp.sum(per_token * mask) / jnp.sum(mask)

            with lora.disable_adapter():
                base_loss = loss_fn(adapter)
            return base_loss, *jax.value_and_grad(loss_fn)(adapter)

        base_loss, loss, grads = loss_and_grads(adapter, base)
        nnx.update(model, grads)  # the gradients in the adapter's place, written as PEFT's file
        lora.save_peft_adapter(model, tmp_path / f"grads_{scan}")
        return float(base_loss), float(loss), adapter_file(tmp_path / f"grads_{scan}")

    base_loss, loss, got = run(False, None)
    assert abs(loss - want_loss) < 1e-5 * want_loss
    assert abs(base_loss - want_loss) > 1e-3 * want_loss  # disable_adapter: the base alone
    assert got.keys() == want.keys()
    assert any(".experts.base_layer.lora_B" in k for k in got)
    for key, value in want.items():
        np.testing.assert_allclose(got[key], value, atol=1e-4 * np.abs(value).max(), err_msg=key)

    _, mesh_loss, on_mesh = run(True, make_mesh(2, 2, 2))
    assert abs(mesh_loss - loss) < 1e-6 * loss
    for key, value in got.items():  # observed: 2e-5 of each tensor's largest entry
        scale = np.abs(value).max()
        np.testing.assert_allclose(on_mesh[key], value, atol=1e-4 * scale, err_msg=key)
