"""LoRA / QLoRA in the online trainers (GRPO, RLOO, PPO): only the adapter (and PPO's value head)
is trained and held in the optimizer state, the base stays bit-identical, the reference is the
base without the adapter (no second copy), and the exported adapter loads with PEFT and gives
our logits."""

import os

import chex
import jax
import numpy as np
import pytest
from flax import nnx
from onpolicy_utils import RecordingReward, prompt_rows, recompute_logps
from trainer_utils import base_args, train_logs

from jaxrl import lora, models
from jaxrl.algos.rollout import completion_logprobs
from jaxrl.core import quant
from jaxrl.trainers.grpo import GRPOTrainer
from jaxrl.trainers.grpo_config import GRPOConfig
from jaxrl.trainers.rloo import RLOOTrainer
from jaxrl.trainers.rloo_config import RLOOConfig
from tests.model_calls import jit_call

# init_lora_weights=False: B is random too, so the adapter changes the model from step 0.
NONZERO = lora.LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", init_lora_weights=False)
IDS = np.asarray([[3, 5, 7, 9, 4, 6, 8, 10]], np.int32)


def _host(tree):
    return jax.tree.map(np.asarray, jax.device_get(tree))


def _size(tree) -> int:
    return sum(np.size(x) for x in jax.tree.leaves(tree))


def _online(cls, config_cls, model, tokenizer, tmp_path, model_kw=None, **kw):
    settings = dict(
        per_device_train_batch_size=8, num_generations=4, max_completion_length=4, max_steps=1
    )
    return cls(
        model,
        reward_funcs=RecordingReward(),
        args=config_cls(**base_args(tmp_path, **{**settings, **kw})),
        train_dataset=prompt_rows(16),
        processing_class=tokenizer,
        **(model_kw or {}),
    )


def _logits(model) -> np.ndarray:
    """The model's logits on IDS (f32) from one jitted program: called eagerly, every operation
    of the forward compiled a program of its own."""
    return np.asarray(jit_call(model, IDS, np.ones_like(IDS)), np.float32)


def _peft_logits(base_dir: str, adapter_dir: str) -> np.ndarray:
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    peft_model = PeftModel.from_pretrained(base, adapter_dir).eval()
    with torch.no_grad():
        return peft_model(torch.from_numpy(IDS.astype(np.int64))).logits.numpy()


@pytest.mark.slow
def test_grpo_lora_trains_only_the_adapter_with_the_base_as_reference(
    tmp_path, tokenizer, hf_model_dir
):
    import torch
    from transformers import AutoModelForCausalLM

    trainer = _online(
        GRPOTrainer,
        GRPOConfig,
        hf_model_dir,
        tokenizer,
        tmp_path,
        model_kw=dict(peft_config=NONZERO),
        beta=0.04,
        learning_rate=1e-2,
    )
    trainer._ensure_state()
    state = trainer.train_state
    assert set(state.frozen) == {"base"}  # no reference copy of the weights
    n_adapter = _size(state.params)
    assert n_adapter == lora.trainable_parameters(trainer.current_model())[0]
    # AdamW: two moments per adapter param (+ scalar counters), nothing for the base.
    assert 2 * n_adapter <= _size(state.opt_state) <= 2 * n_adapter + 16
    base0, adapter0 = _host(state.frozen["base"]), _host(state.params)

    trainer.train()
    state = trainer.train_state
    chex.assert_trees_all_equal(
        state.frozen["base"], base0, strict=True
    )  # the base is bit-identical
    assert not any(
        np.array_equal(a, b)
        for a, b in zip(
            jax.tree.leaves(_host(state.params)), jax.tree.leaves(adapter0), strict=True
        )
    )
    rollout = jax.device_get(trainer.rollout)
    # The reference is the base model without the adapter ...
    np.testing.assert_allclose(
        rollout["ref_logps"], recompute_logps(hf_model_dir, rollout), atol=2e-5
    )
    (log,) = train_logs(trainer)
    # ... and the non-zero adapter makes the policy differ from it from the first step.
    assert log["kl"] > 1e-3

    # The exported adapter gives our logits under PEFT; the merged export under transformers.
    ours = _logits(trainer.current_model())
    out = trainer.save_model(str(tmp_path / "adapter"))
    assert lora.ADAPTER_WEIGHTS in os.listdir(out) and "model.safetensors" not in os.listdir(out)
    np.testing.assert_allclose(ours, _peft_logits(hf_model_dir, out), atol=2e-4, rtol=1e-4)
    merged = trainer.save_model(str(tmp_path / "merged"), merged=True)
    plain = AutoModelForCausalLM.from_pretrained(merged, dtype=torch.float32).eval()
    with torch.no_grad():
        theirs = plain(torch.from_numpy(IDS.astype(np.int64))).logits.numpy()
    np.testing.assert_allclose(ours, theirs, atol=2e-4, rtol=1e-4)


@pytest.mark.slow
def test_rloo_qlora_kl_is_against_the_base(tmp_path, tokenizer, hf_model_dir):
    trainer = _online(
        RLOOTrainer,
        RLOOConfig,
        hf_model_dir,
        tokenizer,
        tmp_path,
        model_kw=dict(peft_config=NONZERO, quantization_config="nf4"),
        beta=0.05,
    )
    trainer.train()
    state = trainer.train_state
    leaves = jax.tree.leaves(
        state.frozen["base"], is_leaf=lambda x: isinstance(x, quant.QuantizedArray)
    )
    assert any(isinstance(x, quant.NF4Array) for x in leaves)
    assert set(state.frozen) == {"base"}
    rollout = jax.device_get(trainer.rollout)
    # The reference is the NF4 base without the adapter: the same checkpoint quantized alone.
    nf4_base = lora.quantize_base(models.from_pretrained(hf_model_dir), "nf4")
    batch = {k: rollout[k] for k in ("input_ids", "attention_mask", "completion_mask")}
    want = jax.jit(lambda b: completion_logprobs(nf4_base, b, temperature=1.0, chunk_size=128))(
        batch
    )
    np.testing.assert_allclose(rollout["ref_logps"], want, atol=1e-5)
    (log,) = train_logs(trainer)
    # RLOO's kl is the sampled sequences' mean log-ratio (either sign); against the adapter-off
    # base it is not 0.
    assert abs(log["kl"]) > 1e-3 and np.isfinite(log["loss"])


@pytest.mark.slow
def test_grpo_with_a_loaded_adapter_keeps_it_as_the_reference(tmp_path, tokenizer, hf_model_dir):
    model = models.from_pretrained(hf_model_dir)
    lora.apply_lora(model, NONZERO, nnx.Rngs(0))  # as lora.load_peft_adapter leaves it
    trainer = _online(GRPOTrainer, GRPOConfig, model, tokenizer, tmp_path, beta=0.04)
    trainer._ensure_state()
    # TRL's "ref" adapter: an adapter-sized frozen copy, not a copy of the model.
    assert set(trainer.train_state.frozen) == {"base", "ref_adapter"}
    ones = np.ones_like(IDS)
    batch = {"input_ids": IDS, "attention_mask": ones, "completion_mask": ones[:, 4:]}
    ref = trainer._jit_ref_logps(trainer.train_state, batch)

    def logps(m):
        return jax.jit(lambda b: completion_logprobs(m, b, temperature=1.0, chunk_size=128))(batch)

    np.testing.assert_allclose(ref, logps(trainer.current_model()), atol=1e-6)
    base = logps(models.from_pretrained(hf_model_dir))
    assert np.max(np.abs(np.asarray(ref) - np.asarray(base))) > 1e-2


def test_online_lora_rejections(tmp_path, tokenizer, hf_model_dir):
    with pytest.raises(ValueError, match="sync_ref_model"):
        _online(
            GRPOTrainer,
            GRPOConfig,
            hf_model_dir,
            tokenizer,
            tmp_path,
            model_kw=dict(peft_config=NONZERO),
            beta=0.04,
            sync_ref_model=True,
        )


def _ppo(model_dir, tmp_path, **kw):
    from jaxrl.trainers.ppo import PPOTrainer
    from jaxrl.trainers.ppo_config import PPOConfig

    config = PPOConfig(
        batch_size=4,
        mini_batch_size=2,
        ppo_epochs=2,
        learning_rate=1e-2,
        seed=0,
        output_dir=str(tmp_path),
        disable_tqdm=True,
        response_length=4,
        save_strategy="no",
    )
    return PPOTrainer(config, model_dir, **kw)


@pytest.mark.slow
def test_ppo_lora_trains_adapter_and_value_head_against_the_base(tmp_path, tokenizer, hf_model_dir):
    import torch
    from safetensors.numpy import load_file
    from transformers import AutoModelForCausalLM

    trainer = _ppo(hf_model_dir, tmp_path, peft_config=NONZERO)
    state = trainer.train_state
    assert trainer.is_peft_model and trainer.ref_model is None
    assert set(state.frozen) == {"base"}  # no reference copy of the weights
    n_adapter = lora.trainable_parameters(trainer.model.pretrained_model)[0]
    n_head = _size(nnx.state(trainer.model.v_head))
    assert _size(state.params) == n_adapter + n_head
    # Adam: two moments per trained param (+ a few scalars), nothing for the base.
    assert 2 * (n_adapter + n_head) <= _size(state.opt_state) <= 2 * (n_adapter + n_head) + 16
    base0, trained0 = _host(state.frozen["base"]), _host(state.params)

    queries = [np.asarray(tokenizer(p)["input_ids"]) for p in ["1+2=", "3+4=", "5+6=", "7+8="]]
    responses = trainer.generate(queries, return_prompt=False, do_sample=True, max_new_tokens=4)
    stats = trainer.step(queries, responses, [np.float32(s) for s in (1.0, 0.0, 2.0, -1.0)])
    # The reference log-probs are the base model's (adapter disabled) ...
    base = models.from_pretrained(hf_model_dir)
    inputs = trainer.prepare_model_inputs(queries, responses)
    want = jax.jit(lambda ids, m: _lm_logprobs(base, ids, m))(
        inputs["input_ids"], inputs["attention_mask"]
    )
    mask = np.asarray(stats["objective/ref_logprobs"]) != 0
    np.testing.assert_allclose(
        np.asarray(stats["objective/ref_logprobs"])[mask], np.asarray(want)[mask], atol=2e-5
    )
    # ... and differ from the policy's with the non-zero adapter.
    assert stats["objective/kl"] > 1e-3
    state = trainer.train_state
    chex.assert_trees_all_equal(state.frozen["base"], base0, strict=True)
    changed = [
        not np.array_equal(a, b)
        for a, b in zip(
            jax.tree.leaves(_host(state.params)), jax.tree.leaves(trained0), strict=True
        )
    ]
    assert all(changed)  # every adapter matrix and the value head moved

    ours = _logits(trainer.model.pretrained_model)
    out = str(tmp_path / "adapter")
    trainer.save_pretrained(out)
    np.testing.assert_allclose(ours, _peft_logits(hf_model_dir, out), atol=2e-4, rtol=1e-4)
    head = load_file(os.path.join(out, "model.safetensors"))
    assert sorted(head) == ["v_head.summary.bias", "v_head.summary.weight"]
    kernel = np.asarray(trainer.model.v_head.summary.kernel[...])
    np.testing.assert_allclose(head["v_head.summary.weight"], kernel.reshape(1, -1))
    merged = str(tmp_path / "merged")
    trainer.save_pretrained(merged, merged=True)
    plain = AutoModelForCausalLM.from_pretrained(merged, dtype=torch.float32).eval()
    with torch.no_grad():
        theirs = plain(torch.from_numpy(IDS.astype(np.int64))).logits.numpy()
    np.testing.assert_allclose(ours, theirs, atol=2e-4, rtol=1e-4)


def _lm_logprobs(model, ids_BL, mask_BL):
    from jaxrl.core.logprobs import token_logprobs

    h_BLD = model.hidden_states(ids_BL, mask_BL)
    return token_logprobs(h_BLD[:, :-1], model.unembed_weight(), ids_BL[:, 1:], chunk_size=128)


def test_ppo_lora_rejections(tmp_path, hf_model_dir):
    with pytest.raises(ValueError, match="num_shared_layers"):
        _ppo(hf_model_dir, tmp_path, peft_config=NONZERO, num_shared_layers=1)
    with pytest.raises(ValueError, match="needs peft_config"):
        _ppo(hf_model_dir, tmp_path, quantization_config="nf4")


@pytest.mark.slow
def test_ppo_qlora_from_trl_v072_loader_arguments(tmp_path, tokenizer, hf_model_dir):
    from peft import LoraConfig

    from jaxrl import AutoModelForCausalLMWithValueHead

    # TRL v0.7.2's PEFT PPO: the adapter and the 4-bit base come with the value-head model.
    model = AutoModelForCausalLMWithValueHead.from_pretrained(
        hf_model_dir,
        peft_config=LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]),
        load_in_4bit=True,
    )
    trainer = _ppo(model, tmp_path, tokenizer=tokenizer)
    assert trainer.is_peft_model and trainer.config.is_peft_model
    leaves = jax.tree.leaves(
        trainer.train_state.frozen["base"], is_leaf=lambda x: isinstance(x, quant.QuantizedArray)
    )
    assert any(isinstance(x, quant.NF4Array) for x in leaves)
    queries = [np.asarray(tokenizer(p)["input_ids"]) for p in ["1+2=", "3+4=", "5+6=", "7+8="]]
    responses = [np.asarray(tokenizer(r)["input_ids"]) for r in ["3", "7", "11", "15"]]
    stats = trainer.step(queries, responses, [np.float32(s) for s in (1.0, 0.0, 2.0, -1.0)])
    # B starts at zero: the policy is the base at the rollout, so the KL to the base is zero.
    assert stats["objective/kl"] == pytest.approx(0.0, abs=1e-6)
    assert np.isfinite(stats["ppo/loss/total"])
    with pytest.raises(ValueError, match="need peft_config"):
        AutoModelForCausalLMWithValueHead.from_pretrained(hf_model_dir, load_in_8bit=True)
