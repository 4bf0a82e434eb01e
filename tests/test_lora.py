"""LoRA (jaxrl.lora) against PEFT: logits of base + adapter, adapter export/import, merge, and
the training contract (only adapters trained, optimizer state sized by the adapter)."""

from __future__ import annotations

import json
import math

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import peft
import pytest
import torch
import transformers
import trl
from flax import nnx
from jax.sharding import PartitionSpec

from jaxrl import lora, parallel
from jaxrl.core import quant
from jaxrl.models import from_pretrained, save_pretrained
from tests.model_calls import merged_call
from tests.models.conftest import FAMILIES, padded_batch, torch_logits

ATOL = 1e-4  # f32 logits of tiny models; observed differences are ~2e-6


def hf_models(tmp_path_factory):
    """Lazily saved tiny HF causal LMs `{family: directory}` with random biases and norms."""
    cache = {}

    def get(family: str):
        if family not in cache:
            torch.manual_seed(len(cache))
            config = FAMILIES[family][0]()
            model = transformers.AutoModelForCausalLM.from_config(config)
            with torch.no_grad():
                for name, p in model.named_parameters():
                    if name.endswith("bias") or "norm" in name or "ln_" in name:
                        p.add_(0.1 * torch.randn_like(p))
            path = tmp_path_factory.mktemp(family)
            model.save_pretrained(path)
            cache[family] = path
        return cache[family]

    return get


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    return hf_models(tmp_path_factory)


def load_hf(path):
    return transformers.AutoModelForCausalLM.from_pretrained(
        path, attn_implementation="eager"
    ).eval()


def forward(model, ids, mask) -> np.ndarray:
    """`model(ids, mask)` as one compiled program, without writing the state back. (Where a
    test's eager calls reuse operations earlier tests compiled, e.g. the quantized bases'
    dequantization, eager calls measured cheaper than compiling the whole model.)"""
    return np.asarray(merged_call(*nnx.split(model), ids, mask))


def masked_max_diff(a: np.ndarray, b: np.ndarray, mask: np.ndarray) -> float:
    return float(np.max(np.abs((np.asarray(a) - np.asarray(b)) * mask[..., None])))


# family, scan_layers, extra PEFT options (spread so each option meets a family)
PARITY_CASES = [
    ("llama", False, {"modules_to_save": ["lm_head"]}),
    ("mistral", False, {"target_modules": ["q_proj", "v_proj", "down_proj"]}),
    ("qwen2", False, {"use_rslora": True}),
    ("qwen3", False, {"target_modules": r".*\.(q_proj|k_proj|o_proj|up_proj)"}),
    ("gpt2", False, {}),
    ("gpt2", True, {"target_modules": ["c_attn", "c_fc"]}),
    ("gemma2", False, {}),  # PEFT's default targets for gemma2 (soft-capped attention)
    ("phi3", True, {"target_modules": ["qkv_proj", "gate_up_proj"]}),  # fused projections
    ("gemma3", True, {}),  # PEFT's default targets for gemma3_text
    ("mixtral", True, {"target_modules": ["q_proj", "v_proj"]}),  # PEFT's table's default
    # MoE: attention and the shared expert's gate (LoRA on routers and experts:
    # tests/test_lora_moe.py).
    ("qwen2_moe", False, {"target_modules": r".*\.(q_proj|o_proj|shared_expert_gate)"}),
    # GPT-OSS: biased attention projections next to the sinks (routers and experts refused).
    ("gpt_oss", True, {"target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"]}),
]
# The fast tier keeps one case; the others are slow.
PARITY_CASES = [
    pytest.param(*c, marks=() if c[:2] == ("qwen2", False) else pytest.mark.slow)
    for c in PARITY_CASES
]


@pytest.mark.parametrize(("family", "scan", "options"), PARITY_CASES)
def test_peft_parity_load_export_merge(hf_dir, tmp_path, family, scan, options):
    path = hf_dir(family)
    torch.manual_seed(1)
    # init_lora_weights=False: B is random too, so the adapter changes the logits.
    kwargs = {"r": 4, "lora_alpha": 8, "target_modules": "all-linear", **options}
    policy = peft.get_peft_model(
        load_hf(path), peft.LoraConfig(init_lora_weights=False, **kwargs)
    ).eval()
    if "modules_to_save" in options:
        with torch.no_grad():  # the saved copy must differ from the base head to be tested
            policy.base_model.model.lm_head.modules_to_save.default.weight.mul_(1.5)
    policy.save_pretrained(tmp_path / "peft")
    ids, mask, left = padded_batch()

    model = from_pretrained(path, scan_layers=scan)
    base_logits = forward(model, ids, mask)
    lora.load_peft_adapter(model, tmp_path / "peft")
    # The adapters are placed as the base params are (a model loaded without a mesh: one
    # device): a jitted call's outputs then come back placed as its inputs, not recompiled.
    assert len({v.sharding for v in jax.tree.leaves(nnx.state(model))}) == 1
    ours = forward(model, ids, mask)
    theirs = torch_logits(policy, ids, mask)
    assert masked_max_diff(ours, theirs, mask) < ATOL
    assert masked_max_diff(base_logits, theirs, mask) > 0.1  # the adapter matters
    np.testing.assert_allclose(
        forward(model, ids, left) * left[..., None],
        torch_logits(policy, ids, left) * left[..., None],
        atol=ATOL,
    )

    lora.save_peft_adapter(model, tmp_path / "ours", base_model_name_or_path=str(path))
    reloaded = peft.PeftModel.from_pretrained(load_hf(path), tmp_path / "ours").eval()
    assert masked_max_diff(torch_logits(reloaded, ids, mask), ours, mask) < ATOL
    saved_config = json.loads((tmp_path / "ours" / "adapter_config.json").read_text())
    assert saved_config["base_model_name_or_path"] == str(path)
    assert saved_config["fan_in_fan_out"] == (family == "gpt2")

    save_pretrained(lora.merge_lora(model), tmp_path / "merged")
    merged = load_hf(tmp_path / "merged")
    peft_merged = policy.merge_and_unload()
    assert (
        masked_max_diff(torch_logits(merged, ids, mask), torch_logits(peft_merged, ids, mask), mask)
        < ATOL
    )
    # merge_lora leaves the adapted model as it was
    assert masked_max_diff(forward(model, ids, mask), ours, mask) == 0.0


def test_reward_model_adapter_matches_peft(tmp_path):
    """SEQ_CLS: the score head is a modules_to_save module (PEFT adds it for this task type)."""
    torch.manual_seed(3)
    config = FAMILIES["qwen3"][0]()
    config.num_labels = 1
    hf_model = transformers.AutoModelForSequenceClassification.from_config(config)
    hf_model.save_pretrained(tmp_path / "base")
    policy = peft.get_peft_model(
        hf_model,
        peft.LoraConfig(
            r=4, task_type="SEQ_CLS", target_modules="all-linear", init_lora_weights=False
        ),
    ).eval()
    with torch.no_grad():
        policy.base_model.model.score.modules_to_save.default.weight.mul_(2.0)
    policy.save_pretrained(tmp_path / "peft")
    ids, mask, _ = padded_batch()
    with torch.no_grad():
        theirs = policy(
            input_ids=torch.from_numpy(np.where(mask == 1, ids, 0)).long(),
            attention_mask=torch.from_numpy(mask).long(),
        ).logits.numpy()
    model = from_pretrained(tmp_path / "base", task="sequence_classification")
    lora.load_peft_adapter(model, tmp_path / "peft")
    np.testing.assert_allclose(forward(model, ids, mask), theirs, atol=ATOL)
    _, adapter, _ = lora.split_lora(model)
    assert ("score", "kernel") in dict(nnx.to_flat_state(adapter))


def tiny_llama(hf_dir, scan=False, **config):
    model = from_pretrained(hf_dir("llama"), scan_layers=scan)
    return lora.apply_lora(model, lora.LoraConfig(**config), nnx.Rngs(0))


def test_default_init_is_peft_init(hf_dir):
    ids, mask, _ = padded_batch()
    base = from_pretrained(hf_dir("llama"))
    model = tiny_llama(hf_dir, r=8, target_modules="all-linear")
    # B = 0: the adapted model starts equal to the base.
    np.testing.assert_array_equal(np.asarray(model(ids, mask)), np.asarray(base(ids, mask)))
    a = np.asarray(model.model.layers[0].mlp.down_proj.lora_a[...])  # fan-in 96
    bound = 1 / math.sqrt(96)  # kaiming_uniform(a=sqrt(5)) on [r, in]
    assert np.abs(a).max() <= bound and np.abs(a).max() > 0.95 * bound
    assert abs(a.std() - bound / math.sqrt(3)) < 0.1 * bound
    gauss = tiny_llama(hf_dir, r=8, target_modules="all-linear", init_lora_weights="gaussian")
    a = np.concatenate(
        [
            np.ravel(v[...])
            for _, v in nnx.to_flat_state(nnx.state(gauss, nnx.LoRAParam))
            if v.shape[-1] == 8
        ]
    )
    assert abs(a.std() - 1 / 8) < 0.01


def adapted_names(model) -> set[str]:
    return {
        name
        for path, layer in nnx.iter_graph(model)
        if isinstance(layer, lora.LoraDense)
        for name in lora.hf_module_names(tuple(path), model.config)
    }


def test_target_selection_follows_peft(hf_dir):
    default = adapted_names(tiny_llama(hf_dir))
    assert default == {
        f"model.layers.{i}.self_attn.{m}" for i in (0, 1) for m in ("q_proj", "v_proj")
    }
    all_linear = adapted_names(tiny_llama(hf_dir, target_modules="all-linear"))
    assert len(all_linear) == 14 and not any("lm_head" in n for n in all_linear)
    regex = adapted_names(tiny_llama(hf_dir, target_modules=r".*\.1\.mlp\.(up|down)_proj"))
    assert regex == {"model.layers.1.mlp.up_proj", "model.layers.1.mlp.down_proj"}
    scanned = tiny_llama(hf_dir, scan=True, target_modules=["o_proj"])
    assert adapted_names(scanned) == {
        "model.layers.0.self_attn.o_proj",
        "model.layers.1.self_attn.o_proj",
    }
    assert scanned.model.layers.self_attn.o_proj.lora_a.shape == (2, 4, 16, 8)  # [L, N, H, r]


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"target_modules": ["lm_head"]}, "output head"),
        ({"target_modules": ["embed_tokens"]}, "modules_to_save"),
        ({"target_modules": ["nope"]}, "matched no linear layer"),
        ({"modules_to_save": ["nope"]}, "matched no module"),
    ],
)
def test_bad_targets_are_rejected(hf_dir, config, message):
    with pytest.raises(ValueError, match=message):
        tiny_llama(hf_dir, **config)


def test_layer_selective_targets_need_unscanned_stack(hf_dir):
    with pytest.raises(ValueError, match="scan_layers=False"):
        tiny_llama(hf_dir, scan=True, target_modules=r"model\.layers\.0\.self_attn\.q_proj")


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"bias": "all"}, "bias"),
        ({"init_lora_weights": "pissa"}, "init_lora_weights"),
        ({"lora_dropout": 1.0}, "lora_dropout"),
        ({"r": 0}, "rank"),
    ],
)
def test_unsupported_config_is_rejected(options, message):
    with pytest.raises(ValueError, match=message):
        lora.LoraConfig(**options)


def test_from_peft_and_trl_configs():
    config = lora.LoraConfig.from_peft(
        peft.LoraConfig(r=4, lora_alpha=16, target_modules=["v_proj", "q_proj"], use_rslora=True)
    )
    assert config == lora.LoraConfig(
        r=4, lora_alpha=16, target_modules=("q_proj", "v_proj"), use_rslora=True
    )
    assert config.scaling == 16 / 2
    with pytest.raises(ValueError, match="use_dora"):
        lora.LoraConfig.from_peft(peft.LoraConfig(use_dora=True))
    with pytest.raises(ValueError, match="layers_to_transform"):
        lora.LoraConfig.from_peft(peft.LoraConfig(layers_to_transform=[0]))
    args = trl.ModelConfig(use_peft=True, lora_target_modules=["all-linear"], lora_r=2)
    assert lora.LoraConfig.from_trl(args) == lora.LoraConfig(
        r=2, lora_alpha=32, lora_dropout=0.05, target_modules="all-linear", task_type="CAUSAL_LM"
    )
    assert lora.LoraConfig.from_trl(trl.ModelConfig()) is None


def test_base_quantization_from_trl_fields():
    assert lora.base_quantization(trl.ModelConfig()) is None
    assert lora.base_quantization(trl.ModelConfig(load_in_8bit=True)) == "int8"
    assert lora.base_quantization(trl.ModelConfig(load_in_4bit=True)) == "nf4"
    with pytest.raises(ValueError, match="nf4"):
        lora.base_quantization(trl.ModelConfig(load_in_4bit=True, bnb_4bit_quant_type="fp4"))
    with pytest.raises(ValueError, match="nested"):
        lora.base_quantization(trl.ModelConfig(load_in_4bit=True, use_bnb_nested_quant=True))


def lm_loss(model, ids, mask):
    logits = model(ids, mask)
    logp = jax.nn.log_softmax(logits[:, :-1])
    nll = -jnp.take_along_axis(logp, ids[:, 1:, None], axis=-1)[..., 0]
    return jnp.sum(nll * mask[:, 1:]) / jnp.sum(mask[:, 1:])


@pytest.mark.parametrize("scan", [False, True])
@pytest.mark.slow
def test_only_adapters_are_trained(hf_dir, scan):
    ids, mask, _ = padded_batch()
    model = tiny_llama(
        hf_dir,
        scan=scan,
        target_modules="all-linear",
        modules_to_save=["lm_head"],
        init_lora_weights=False,
    )
    graphdef, adapter, base = lora.split_lora(model)
    names = {str(p[-1]) for p, _ in nnx.to_flat_state(adapter)}
    assert names == {"lora_a", "lora_b", "kernel"}  # kernel: the saved lm_head
    base_before = jax.tree.map(np.asarray, base)
    tx = optax.adam(1e-2)

    @jax.jit
    def step(adapter, opt_state, base):
        def loss_fn(adapter):
            return lm_loss(nnx.merge(graphdef, adapter, base), ids, mask)

        loss, grads = jax.value_and_grad(loss_fn)(adapter)
        updates, opt_state = tx.update(grads, opt_state, adapter)
        return optax.apply_updates(adapter, updates), opt_state, loss, grads

    opt_state = tx.init(adapter)
    losses = []
    for i in range(3):
        adapter, opt_state, loss, grads = step(adapter, opt_state, base)
        losses.append(float(loss))
        if i == 0:  # every adapter tensor receives gradient
            assert all(np.abs(np.asarray(g)).max() > 0 for g in jax.tree.leaves(grads))
    assert losses[-1] < losses[0]
    chex.assert_trees_all_equal(base_before, base, strict=True)


def leaf_count(tree) -> int:
    return sum(x.size for x in jax.tree.leaves(tree))


def test_optimizer_state_scales_with_adapter_size(hf_dir):
    counts = {}
    for r in (2, 8):
        model = tiny_llama(hf_dir, r=r, target_modules="all-linear")
        _, adapter, base = lora.split_lora(model)
        opt_state = optax.adam(1e-3).init(adapter)
        counts[r] = (leaf_count(adapter), leaf_count(opt_state), leaf_count(base))
        assert counts[r][1] == 2 * counts[r][0] + 1  # mu, nu and the step count
        assert lora.trainable_parameters(model) == (counts[r][0], counts[r][0] + counts[r][2])
    assert counts[8][0] == 4 * counts[2][0]
    # Full fine-tuning's adam state would be 2x the base; LoRA r=2 needs a few percent of it.
    assert counts[2][1] < 0.05 * 2 * counts[2][2]


def test_dropout_only_with_an_rng(hf_dir):
    ids, mask, _ = padded_batch()
    model = tiny_llama(hf_dir, lora_dropout=0.5, init_lora_weights=False)
    graphdef, adapter, base = lora.split_lora(model)
    ids_seen = [
        np.ravel(v[...]) for _, v in nnx.to_flat_state(nnx.state(model, lora.LoraDropoutId))
    ]
    assert len(np.unique(np.concatenate(ids_seen))) == 4  # q and v of two layers

    @jax.jit
    def logits(adapter, key):
        with lora.dropout_rng(key):
            return nnx.merge(graphdef, adapter, base)(ids, mask)

    eval_logits = np.asarray(model(ids, mask))
    no_dropout = tiny_llama(hf_dir, init_lora_weights=False)
    np.testing.assert_array_equal(eval_logits, np.asarray(no_dropout(ids, mask)))
    a, b = (
        np.asarray(logits(adapter, jax.random.key(1))),
        np.asarray(logits(adapter, jax.random.key(2))),
    )
    assert masked_max_diff(a, eval_logits, mask) > 1e-3
    assert masked_max_diff(a, b, mask) > 1e-3
    np.testing.assert_array_equal(a, np.asarray(logits(adapter, jax.random.key(1))))


@pytest.mark.slow
def test_scanned_stack_draws_a_mask_per_layer(hf_dir):
    ids, mask, _ = padded_batch()
    config = {"lora_dropout": 0.5, "init_lora_weights": False, "target_modules": "all-linear"}
    unscanned, scanned = tiny_llama(hf_dir, **config), tiny_llama(hf_dir, scan=True, **config)
    # Same adapter weights in both layouts: copy the unscanned adapters into the stacked ones.
    for path, layer in nnx.iter_graph(scanned):
        if isinstance(layer, lora.LoraDense):
            name = path[-1]
            parent = path[-2]
            for attr in ("lora_a", "lora_b"):
                per_layer = [
                    getattr(getattr(unscanned.model.layers[i], parent), name) for i in range(2)
                ]
                getattr(layer, attr).set_value(
                    jnp.asarray(np.stack([getattr(p, attr)[...] for p in per_layer]))
                )
    graphdef, state = nnx.split(scanned)

    @jax.jit  # both calls in one program (eagerly, each operation compiled one of its own)
    def clean_and_dropped(state):
        model = nnx.merge(graphdef, state)
        with lora.dropout_rng(jax.random.key(0)):
            dropped = model(ids, mask)
        return model(ids, mask), dropped

    clean, dropped = map(np.asarray, clean_and_dropped(state))
    np.testing.assert_allclose(clean, forward(unscanned, ids, mask), atol=1e-5)
    ids_stacked = np.asarray(scanned.model.layers.mlp.up_proj.dropout_id[...])
    assert ids_stacked.shape == (2,) and ids_stacked[0] != ids_stacked[1]
    assert masked_max_diff(dropped, clean, mask) > 1e-3


@pytest.mark.slow
def test_disabled_adapter_is_the_base_model(hf_dir):
    """The DPO reference without a second copy: same states, adapters switched off in the trace."""
    ids, mask, _ = padded_batch()
    base_logits = forward(from_pretrained(hf_dir("llama")), ids, mask)
    model = tiny_llama(hf_dir, target_modules="all-linear", init_lora_weights=False)
    graphdef, adapter, base = lora.split_lora(model)

    @jax.jit
    def policy_and_reference(adapter, base):
        policy = nnx.merge(graphdef, adapter, base)
        with lora.disable_adapter():
            reference = policy(ids, mask)
        return policy(ids, mask), reference

    policy_logits, reference_logits = policy_and_reference(adapter, base)
    np.testing.assert_allclose(np.asarray(reference_logits), base_logits, atol=1e-6)
    assert masked_max_diff(np.asarray(policy_logits), base_logits, mask) > 0.1


@pytest.mark.slow
@pytest.mark.parametrize(
    ("scheme", "tolerance"), [pytest.param("int8", 0.05, marks=pytest.mark.slow), ("nf4", 0.5)]
)
def test_quantized_base_close_to_full_precision(hf_dir, scheme, tolerance):
    ids, mask, _ = padded_batch()
    model = tiny_llama(hf_dir, target_modules="all-linear", init_lora_weights=False)
    full = np.asarray(model(ids, mask))
    lora.quantize_base(model, scheme)
    kernels = nnx.state(model, nnx.Param)
    q_proj = model.model.layers[0].self_attn.q_proj.kernel.get_value()
    assert isinstance(q_proj, quant.NF4Array if scheme == "nf4" else quant.QuantizedArray)
    assert not isinstance(model.lm_head.kernel.get_value(), quant.QuantizedArray)  # as bnb
    assert not isinstance(model.model.embed_tokens.embedding.get_value(), quant.QuantizedArray)
    assert isinstance(model.model.layers[0].self_attn.q_proj.lora_a.get_value(), jax.Array)
    err = masked_max_diff(np.asarray(model(ids, mask)), full, mask)
    assert 0 < err < tolerance * np.abs(full).max()
    np.testing.assert_allclose(  # merging dequantizes the base and folds the adapter in
        np.asarray(lora.merge_lora(model)(ids, mask)), np.asarray(model(ids, mask)), atol=1e-4
    )
    # still trainable on the quantized base
    graphdef, adapter, base = lora.split_lora(model)
    grads = jax.jit(jax.grad(lambda a: lm_loss(nnx.merge(graphdef, a, base), ids, mask)))(adapter)
    assert all(np.abs(np.asarray(g)).max() > 0 for g in jax.tree.leaves(grads))
    assert quant.param_bytes(kernels) < quant.param_bytes(nnx.state(tiny_llama(hf_dir), nnx.Param))


@pytest.mark.slow
def test_quantized_errors_are_ordered(hf_dir):
    """NF4 (4.5 bits) is coarser than per-channel int8, both far below the adapter's effect."""
    ids, mask, _ = padded_batch()
    full = np.asarray(tiny_llama(hf_dir)(ids, mask))
    errors = {
        s: masked_max_diff(
            np.asarray(lora.quantize_base(tiny_llama(hf_dir), s)(ids, mask)), full, mask
        )
        for s in ("int8", "nf4")
    }
    assert errors["int8"] < errors["nf4"]


@pytest.mark.slow
def test_sharded_adapters_follow_logical_axes(hf_dir):
    ids, mask, _ = padded_batch()
    mesh = parallel.make_mesh(data=2, fsdp=2, tensor=2)
    reference = np.asarray(
        tiny_llama(hf_dir, init_lora_weights=False, target_modules="all-linear")(ids, mask)
    )
    model = from_pretrained(hf_dir("llama"), mesh=mesh)
    lora.apply_lora(
        model, lora.LoraConfig(init_lora_weights=False, target_modules="all-linear"), nnx.Rngs(0)
    )
    q_proj = model.model.layers[0].self_attn.q_proj
    assert q_proj.lora_a[...].sharding.spec == PartitionSpec("fsdp", None)
    assert q_proj.lora_b[...].sharding.spec == PartitionSpec(None, "tensor", None)
    lora.quantize_base(model, "nf4")
    graphdef, adapter, base = lora.split_lora(model)
    logits = jax.jit(lambda a, b: nnx.merge(graphdef, a, b)(ids, mask))(adapter, base)
    full = from_pretrained(hf_dir("llama"))
    lora.apply_lora(
        full, lora.LoraConfig(init_lora_weights=False, target_modules="all-linear"), nnx.Rngs(0)
    )
    lora.quantize_base(full, "nf4")
    np.testing.assert_allclose(np.asarray(logits), np.asarray(full(ids, mask)), atol=1e-4)
    assert masked_max_diff(np.asarray(logits), reference, mask) < 0.5 * np.abs(reference).max()


def test_load_adapter_errors(hf_dir, tmp_path):
    model = tiny_llama(hf_dir)
    with pytest.raises(ValueError, match="already has LoRA"):
        lora.apply_lora(model, lora.LoraConfig(), nnx.Rngs(0))
    with pytest.raises(FileNotFoundError, match="PEFT adapter"):
        lora.load_peft_adapter(from_pretrained(hf_dir("llama")), tmp_path)
    lora.save_peft_adapter(model, tmp_path)
    config = json.loads((tmp_path / "adapter_config.json").read_text())
    (tmp_path / "adapter_config.json").write_text(json.dumps({**config, "use_dora": True}))
    with pytest.raises(ValueError, match="use_dora"):
        lora.load_peft_adapter(from_pretrained(hf_dir("llama")), tmp_path)


@pytest.mark.parametrize(
    ("family", "options"),
    [("llama", {"modules_to_save": ["lm_head"]}), ("gpt2", {"target_modules": ["c_attn"]})],
)
def test_peft_model_object_is_base_plus_adapter_directory(hf_dir, tmp_path, family, options):
    """`lora.from_peft_model(PeftModel)` in memory = `from_pretrained(base)` +
    `load_peft_adapter(saved adapter)`, parameter for parameter; its logits are PEFT's."""
    path = hf_dir(family)
    torch.manual_seed(4)
    config = peft.LoraConfig(r=4, lora_alpha=8, init_lora_weights=False, **options)
    policy = peft.get_peft_model(load_hf(path), config).eval()
    if "modules_to_save" in options:
        with torch.no_grad():  # the trained copy differs from the base head
            policy.base_model.model.lm_head.modules_to_save.default.weight.mul_(1.5)
    policy.save_pretrained(tmp_path / "peft")
    ours = lora.from_peft_model(policy)
    want = lora.load_peft_adapter(from_pretrained(path), tmp_path / "peft")
    assert ours.lora_config == want.lora_config
    got, expected = nnx.to_flat_state(nnx.state(ours)), dict(nnx.to_flat_state(nnx.state(want)))
    assert sorted(p for p, _ in got) == sorted(expected)
    for p, v in got:
        np.testing.assert_array_equal(v.get_value(), expected[p].get_value(), err_msg=str(p))
    ids, mask, _ = padded_batch()
    assert masked_max_diff(forward(ours, ids, mask), torch_logits(policy, ids, mask), mask) < ATOL
