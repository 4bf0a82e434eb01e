"""Mixture-of-experts models (Qwen2-MoE, Qwen3-MoE, Mixtral, OLMoE) against transformers beyond
the logits of `test_hf_parity.py`: the load-balancing loss equals `outputs.aux_loss`, gradients
through the routing (top-k weights, router, expert weights) equal torch autograd's, results do
not depend on the mesh, and configs jaxrl cannot run are refused."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from flax import nnx

from jaxrl.models import config_from_hf, from_pretrained, moe
from jaxrl.models.presets import flops_per_token
from jaxrl.parallel import make_mesh
from tests.models.conftest import FAMILIES, padded_batch

MOE = ("qwen3_moe", "qwen2_moe", "mixtral", "olmoe", "gpt_oss")


def _hf_aux(ref, ids, mask) -> float:
    with torch.no_grad():
        out = ref.model(
            input_ids=torch.from_numpy(ids).long(),
            attention_mask=None if mask is None else torch.from_numpy(mask).long(),
            output_router_logits=True,
        )
    return float(out.aux_loss)


@nnx.jit
def _ours_aux(model, ids, mask):
    with moe.collect_router_stats(mask) as stats:
        model(ids, mask)
    return moe.load_balancing_loss(stats, mask, num_tokens=ids.size)


@pytest.mark.parametrize("family", MOE)
def test_load_balancing_loss_equals_transformers(family, hf_causal):
    """transformers' `load_balancing_loss_func` over the MoE layers only (Qwen2-MoE's dense
    layer has no router), padding excluded by the attention mask."""
    ref = hf_causal(family)
    ids, right, _ = padded_batch(seq_len=16)
    model = from_pretrained(ref.path)
    for mask in (right, None):
        want = _hf_aux(ref, ids, mask)
        got = float(_ours_aux(model, jnp.asarray(ids), None if mask is None else jnp.asarray(mask)))
        assert abs(got - want) < 1e-6 * want, mask
    # Without a collector the forward records nothing (and costs nothing extra).
    assert not moe.collecting_router_stats()


def _torch_grads(ref, ids, mask, coef):
    model = ref.model
    model.zero_grad()
    out = model(
        input_ids=torch.from_numpy(ids).long(),
        attention_mask=torch.from_numpy(mask).long(),
        output_router_logits=True,
    )
    valid = torch.from_numpy(mask).bool()
    loss = (out.logits.float() ** 2).mean(-1)[valid].mean() + coef * out.aux_loss
    loss.backward()
    return float(loss), {n: p.grad.numpy().copy() for n, p in model.named_parameters()}


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_gradients_equal_torch_autograd(family, hf_causal):
    """d(loss + coef * aux)/d(params) for router, expert and attention weights: the gradient
    reaches the router through the top-k routing weights and through the aux loss, as in torch."""
    ref = hf_causal(family)
    ids, right, _ = padded_batch(seq_len=12)
    coef = 0.5
    want_loss, want = _torch_grads(ref, ids, right, coef)
    model = from_pretrained(ref.path, scan_layers=True)
    graphdef, params = nnx.split(model)

    def loss_fn(params):
        m = nnx.merge(graphdef, params)
        mask = jnp.asarray(right)
        with moe.collect_router_stats(mask) as stats:
            logits = m(jnp.asarray(ids), mask)
        per_token = jnp.mean(logits.astype(jnp.float32) ** 2, axis=-1)
        main = jnp.sum(per_token * mask) / jnp.sum(mask)
        return main + coef * moe.load_balancing_loss(stats, mask)

    loss, grads = jax.jit(jax.value_and_grad(loss_fn))(params)  # one program, not op by op
    assert abs(float(loss) - want_loss) < 1e-5 * abs(want_loss)
    layers = grads["model"]["layers"]
    block = layers["block_sparse_moe" if family == "mixtral" else "mlp"]
    gate_name = "w1" if family == "mixtral" else "gate_proj"
    for layer in range(2):
        # transformers v5 modules (checkpoints keep the per-expert names): `mlp` for Mixtral
        # too, experts fused as gate_up_proj [E, 2F, D] (gate rows first).
        prefix = f"model.layers.{layer}."
        router = np.asarray(block["gate"]["kernel"][...])[layer].T
        np.testing.assert_allclose(router, want[prefix + "mlp.gate.weight"], atol=2e-6)
        experts = np.asarray(block["experts"][gate_name][...])[layer]  # [E, D, F]
        fused = want[prefix + "mlp.experts.gate_up_proj"]
        np.testing.assert_allclose(
            experts.transpose(0, 2, 1), fused[:, : experts.shape[-1]], atol=2e-6
        )
        q = np.asarray(layers["self_attn"]["q_proj"]["kernel"][...])[layer].reshape(64, -1).T
        np.testing.assert_allclose(q, want[prefix + "self_attn.q_proj.weight"], atol=2e-6)
    assert np.abs(want["model.layers.0.mlp.gate.weight"]).max() > 1e-4


def test_same_logits_aux_loss_and_gradients_on_every_mesh(hf_causal):
    """Under a mesh each device routes its own tokens (`shard_map` over the batch axes): the
    logits, the aux loss and the router / expert gradients equal one device's."""
    path = hf_causal("qwen3_moe").path
    ids, right, _ = padded_batch(seq_len=16)
    ids, right = np.tile(ids, (8, 1))[:8], np.tile(right, (8, 1))[:8]

    def run(mesh):
        model = from_pretrained(path, mesh=mesh, scan_layers=True)
        graphdef, params = nnx.split(model)

        def forward(params, ids, mask):
            with moe.collect_router_stats(mask) as stats:
                logits = nnx.merge(graphdef, params)(ids, mask)
            aux = moe.load_balancing_loss(stats, mask)
            return jnp.mean(logits.astype(jnp.float32) ** 2) + aux, (logits, aux)

        (_, (logits, aux)), grads = jax.jit(jax.value_and_grad(forward, has_aux=True))(
            params, jnp.asarray(ids), jnp.asarray(right)
        )
        block = grads["model"]["layers"]["mlp"]
        return (
            np.asarray(logits),
            float(aux),
            np.asarray(block["gate"]["kernel"][...]),
            np.asarray(block["experts"]["down_proj"][...]),
        )

    want = run(None)
    assert np.abs(want[2]).max() > 1e-4 and np.abs(want[3]).max() > 1e-4
    for shape in ((8, 1, 1), (2, 2, 2), (1, 4, 2)):
        got = run(make_mesh(*shape))
        np.testing.assert_allclose(got[0], want[0], atol=2e-5, err_msg=str(shape))
        assert abs(got[1] - want[1]) < 1e-6, shape
        np.testing.assert_allclose(got[2], want[2], atol=1e-6, err_msg=str(shape))
        np.testing.assert_allclose(got[3], want[3], atol=1e-6, err_msg=str(shape))


def test_each_device_dispatches_its_own_tokens(hf_causal):
    """The compiled (8, 1, 1) forward sorts 1/8 of the routed rows per device: no device sorts
    the whole batch's."""
    model = from_pretrained(hf_causal("qwen3_moe").path, mesh=make_mesh(8, 1, 1))
    ids = jnp.ones((8, 16), jnp.int32)
    hlo = jax.jit(lambda m, i: m(i)).lower(model, ids).compile().as_text()
    rows = 8 * 16 * 2  # tokens x top-2
    assert f"s32[{rows // 8}]" in hlo and "sort(" in hlo
    assert not any(f"[{rows}]" in line for line in hlo.splitlines() if "sort(" in line)


@pytest.mark.parametrize(
    ("family", "changes", "message"),
    [
        ("mixtral", {"router_jitter_noise": 0.1}, "router_jitter_noise"),
        ("olmoe", {"clip_qkv": 8.0}, "clip_qkv"),
        ("qwen3_moe", {"num_experts_per_tok": 5}, "exceeds the number of experts"),
    ],
)
def test_unsupported_moe_configs_are_refused(family, changes, message):
    hf_config = FAMILIES[family][0]()
    for key, value in changes.items():
        setattr(hf_config, key, value)
    with pytest.raises(ValueError, match=message):
        config_from_hf(hf_config)


def test_mixed_dense_and_moe_layers_need_an_unrolled_stack(hf_causal):
    path = hf_causal("qwen2_moe").path  # layer 1 is in mlp_only_layers
    config = config_from_hf(transformers.AutoConfig.from_pretrained(path))
    assert config.moe_layers == (True, False)
    with pytest.raises(ValueError, match="scan_layers=False"):
        from_pretrained(path, scan_layers=True)
    model = from_pretrained(path)
    assert isinstance(model.model.layers[0].mlp, moe.SparseMoeBlock)
    assert not isinstance(model.model.layers[1].mlp, moe.SparseMoeBlock)


def test_flops_count_the_weights_a_token_uses(hf_causal):
    """MFU's N for an MoE model: attention, the router, top-k of the experts and the shared
    expert with its gate on MoE layers; the dense MLP on the others; the unembedding."""
    config = config_from_hf(transformers.AutoConfig.from_pretrained(hf_causal("qwen2_moe").path))
    d, f_moe, f_shared, f_dense = 64, 32, 48, 96
    attn = 2 * d * 4 * 16 + 2 * d * 2 * 16
    moe_layer = d * 4 + 2 * 3 * d * f_moe + 3 * d * f_shared + d
    n_matmul = 2 * attn + moe_layer + 3 * d * f_dense + d * 128
    assert flops_per_token(config, 10) == 6 * n_matmul + 12 * 2 * 4 * 16 * 10
