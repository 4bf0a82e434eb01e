"""LoRA / QLoRA in the SFT, reward and DPO trainers (`peft_config=`, `quantization_config=`):
adapter-only train state, loss parity with the merged model, the DPO reference as the base
without the adapter, PEFT export, NF4 base, and exact resume from adapter-only checkpoints."""

import os

import chex
import jax
import numpy as np
import pytest
from flax import nnx
from trainer_utils import base_args, killed_after_checkpoint, train_logs

from jaxrl import DPOConfig, RewardConfig, SFTConfig, lora, models
from jaxrl.algos.dpo import pair_logps
from jaxrl.callbacks.base import TrainerCallback
from jaxrl.callbacks.bema import BEMACallback
from jaxrl.core import quant
from jaxrl.trainers import DPOTrainer, RewardTrainer, SFTTrainer
from tests.model_calls import jit_call

# init_lora_weights=False: B is random too, so the adapter changes the model from step 0.
NONZERO = lora.LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", init_lora_weights=False)


def _host(tree):
    return jax.tree.map(np.asarray, jax.device_get(tree))


def _leaves_equal(a, b) -> bool:
    return all(
        np.array_equal(x, y)
        for x, y in zip(jax.tree.leaves(_host(a)), jax.tree.leaves(_host(b)), strict=True)
    )


def _sft(tmp_path, model, tokenizer, data, **kw):
    trainer_kw = {
        k: kw.pop(k) for k in ("peft_config", "quantization_config", "callbacks") if k in kw
    }
    return SFTTrainer(
        model,
        SFTConfig(**base_args(tmp_path, **kw)),
        train_dataset=data[0],
        eval_dataset=data[1],
        processing_class=tokenizer,
        **trainer_kw,
    )


@pytest.mark.slow
def test_sft_lora_matches_merged_model_trains_only_adapters_and_exports(
    tmp_path, tokenizer, hf_model_dir, sft_data
):
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    # overwrite_output_dir: evaluate() below logs to metrics.jsonl before train() starts.
    trainer = _sft(
        tmp_path / "lora",
        hf_model_dir,
        tokenizer,
        sft_data,
        peft_config=NONZERO,
        overwrite_output_dir=True,
    )
    n_trainable, _ = lora.trainable_parameters(trainer.model)
    merged = lora.merge_lora(trainer.model)
    full = _sft(tmp_path / "full", merged, tokenizer, sft_data)
    # Step 0: the adapter-over-base loss is the merged full model's.
    full_loss = full.evaluate()["eval_loss"]
    lora_loss = trainer.evaluate()["eval_loss"]
    assert lora_loss == pytest.approx(full_loss, rel=1e-5)
    state = trainer.train_state
    assert set(state.frozen) == {"base"}
    n_adapter = sum(x.size for x in jax.tree.leaves(state.params))
    assert n_adapter == n_trainable
    # AdamW holds two moments per trainable param (+ a few scalar counters), nothing for the base.
    n_opt = sum(np.size(x) for x in jax.tree.leaves(state.opt_state))
    assert 2 * n_adapter <= n_opt <= 2 * n_adapter + 16
    base0, adapter0 = _host(state.frozen["base"]), _host(state.params)

    trainer.train()
    state = trainer.train_state
    chex.assert_trees_all_equal(state.frozen["base"], base0, strict=True)  # base bit-identical
    changed = [
        not np.array_equal(a, b)
        for a, b in zip(
            jax.tree.leaves(_host(state.params)), jax.tree.leaves(adapter0), strict=True
        )
    ]
    assert all(changed)

    # PEFT export: PeftModel over the PyTorch base gives the trained model's logits.
    ids = np.asarray([[3, 5, 7, 9, 4, 6, 8, 10]], np.int32)
    ours = np.asarray(jit_call(trainer.current_model(), ids, np.ones_like(ids)), np.float32)
    out = trainer.save_model(str(tmp_path / "adapter"))
    with open(os.path.join(out, lora.ADAPTER_CONFIG)) as f:
        assert f'"base_model_name_or_path": "{hf_model_dir}"' in f.read()
    base_pt = AutoModelForCausalLM.from_pretrained(hf_model_dir, dtype=torch.float32)
    peft_model = PeftModel.from_pretrained(base_pt, out).eval()
    with torch.no_grad():
        theirs = peft_model(torch.from_numpy(ids.astype(np.int64))).logits.numpy()
    np.testing.assert_allclose(ours, theirs, atol=2e-4, rtol=1e-4)
    # merge_and_unload-style export: a plain HF directory with the same logits.
    merged_dir = trainer.save_model(str(tmp_path / "merged"), merged=True)
    plain = AutoModelForCausalLM.from_pretrained(merged_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        theirs = plain(torch.from_numpy(ids.astype(np.int64))).logits.numpy()
    np.testing.assert_allclose(ours, theirs, atol=2e-4, rtol=1e-4)


@pytest.mark.slow
def test_dpo_lora_reference_is_the_base_without_adapter(
    tmp_path, tokenizer, hf_model_dir, pref_data
):
    trainer = DPOTrainer(
        hf_model_dir,
        args=DPOConfig(**base_args(tmp_path, max_steps=1)),
        train_dataset=pref_data[0],
        processing_class=tokenizer,
        peft_config=NONZERO,
    )
    trainer._ensure_state()
    state = trainer.train_state
    assert "ref" not in state.frozen  # no second copy of the weights
    host = trainer._collate(list(trainer.train_dataset.select(range(4))))
    mb = {k: v for k, v in trainer._to_device({k: v[None] for k, v in host.items()}).items()}
    mb = {k: v[0] for k, v in mb.items()}
    ref_c, ref_r = jax.jit(trainer._ref_pair_logps)(state, mb)
    chunk = trainer.args.logprob_chunk_size

    @nnx.jit  # both models' log-probs in one program (eagerly, each operation compiled its own)
    def base_and_policy(base, policy, mb):
        return pair_logps(base, mb, chunk, with_stats=False), pair_logps(policy, mb, chunk, False)

    want, policy = base_and_policy(
        models.from_pretrained(hf_model_dir), trainer.current_model(), mb
    )
    np.testing.assert_allclose(ref_c, want["chosen"], rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(ref_r, want["rejected"], rtol=1e-5, atol=1e-4)
    assert np.max(np.abs(np.asarray(policy["chosen"]) - np.asarray(want["chosen"]))) > 1e-2
    trainer.train()
    first = train_logs(trainer)[0]
    # rewards = beta * (policy - ref) log-probs: non-zero since the adapter starts non-zero.
    assert np.isfinite(first["loss"]) and abs(first["rewards/chosen"]) > 1e-4


def test_lora_rejections(tmp_path, tokenizer, hf_model_dir, pref_data, sft_data):
    with pytest.raises(ValueError, match="sync_ref_model"):
        DPOTrainer(
            hf_model_dir,
            args=DPOConfig(**base_args(tmp_path / "a", sync_ref_model=True)),
            train_dataset=pref_data[0],
            processing_class=tokenizer,
            peft_config=NONZERO,
        )
    with pytest.raises(ValueError, match="needs peft_config"):
        _sft(tmp_path / "b", hf_model_dir, tokenizer, sft_data, quantization_config="nf4")
    bema = _sft(
        tmp_path / "c",
        hf_model_dir,
        tokenizer,
        sft_data,
        peft_config=NONZERO,
        callbacks=[BEMACallback()],
    )
    with pytest.raises(ValueError, match="BEMACallback"):
        bema.train()
    with pytest.raises(ValueError, match="SEQ_CLS"):
        _sft(
            tmp_path / "d",
            hf_model_dir,
            tokenizer,
            sft_data,
            peft_config=lora.LoraConfig(task_type="SEQ_CLS"),
        )


def test_quantization_config_from_bitsandbytes_fields():
    from transformers import BitsAndBytesConfig

    from jaxrl.trainers.model_setup import _quantization_scheme

    assert (
        _quantization_scheme(BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4"))
        == "nf4"
    )
    assert _quantization_scheme(BitsAndBytesConfig(load_in_8bit=True)) == "int8"
    with pytest.raises(ValueError, match="fp4"):
        _quantization_scheme(BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="fp4"))
    with pytest.raises(ValueError, match="int4"):
        _quantization_scheme("int4")


@pytest.mark.slow
def test_qlora_nf4_base_trains(tmp_path, tokenizer, hf_model_dir, sft_data):
    trainer = _sft(
        tmp_path,
        hf_model_dir,
        tokenizer,
        sft_data,
        peft_config=lora.LoraConfig(r=8, lora_alpha=16, target_modules="all-linear"),
        quantization_config="nf4",
        max_steps=6,
        learning_rate=2e-2,
    )
    trainer.train()
    base = trainer.train_state.frozen["base"]
    leaves = jax.tree.leaves(base, is_leaf=lambda x: isinstance(x, quant.QuantizedArray))
    assert any(isinstance(x, quant.NF4Array) for x in leaves)
    losses = [h["loss"] for h in train_logs(trainer)]
    assert losses[-1] < losses[0] - 0.05


@pytest.mark.slow
def test_lora_resume_is_exact_and_checkpoint_has_no_base(
    tmp_path, tokenizer, hf_model_dir, sft_data
):
    cfg = lora.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.1, target_modules=("q_proj", "v_proj"))
    kw = dict(max_steps=4, learning_rate=1e-2, save_strategy="steps", save_steps=2)
    full = _sft(tmp_path / "full", hf_model_dir, tokenizer, sft_data, peft_config=cfg, **kw)
    full.train()
    # The interrupted run is the uninterrupted one up to its step-2 save (same config, same
    # seed): a copy of `full`'s checkpoint-2 is what it leaves, without training it again.
    killed_after_checkpoint(tmp_path / "full", 2, tmp_path / "run")
    ckpt = tmp_path / "run" / "checkpoints" / "checkpoint-2"

    class StepsRun(TrainerCallback):
        def __init__(self):
            self.steps = []

        def on_step_end(self, args, state, control, **kwargs):
            self.steps.append(state.global_step)

    steps_run = StepsRun()
    # The resumed trainer restores into a tree without frozen["base"] (it reloads the base from
    # the model path), so this also checks that the checkpoint holds no base weights.
    resumed = _sft(
        tmp_path / "run",
        hf_model_dir,
        tokenizer,
        sft_data,
        peft_config=cfg,
        callbacks=[steps_run],
        resume_from_checkpoint=str(ckpt),
        overwrite_output_dir=False,
        **kw,
    )
    resumed.train()
    # It resumed: only steps 3-4 ran (a fresh run of this seeded config would match the losses
    # and params below too, so this is what shows the checkpoint was restored).
    assert steps_run.steps == [3, 4]
    want = [h["loss"] for h in train_logs(full)][2:]
    got = [h["loss"] for h in train_logs(resumed)][-2:]
    np.testing.assert_array_equal(got, want)
    chex.assert_trees_all_equal(resumed.train_state.params, full.train_state.params, strict=True)


@pytest.mark.slow
def test_reward_lora_trains_the_score_head(tmp_path, tokenizer, hf_model_dir, pref_data):
    trainer = RewardTrainer(
        hf_model_dir,
        args=RewardConfig(**base_args(tmp_path, max_steps=3, learning_rate=1e-2)),
        train_dataset=pref_data[0],
        processing_class=tokenizer,
        peft_config=lora.LoraConfig(r=4, lora_alpha=8),
    )
    assert trainer.lora_config.task_type == "SEQ_CLS"
    trainer._ensure_state()
    saved = nnx.filter_state(trainer.train_state.params, lora.SavedParam)
    score0 = _host(saved)
    assert jax.tree.leaves(score0)
    trainer.train()
    after = _host(nnx.filter_state(trainer.train_state.params, lora.SavedParam))
    assert not _leaves_equal(after, score0)
    assert all(np.isfinite(h["loss"]) for h in train_logs(trainer))


def test_disable_dropout_turns_off_lora_dropout(
    tmp_path, tokenizer, hf_model_dir, pref_data, sft_data
):
    """TRL's `disable_dropout_in_model` runs on the PEFT model, so DPO's default
    `disable_dropout=True` trains without LoRA dropout; SFT (no such field) keeps it."""
    cfg = lora.LoraConfig(
        r=4, lora_alpha=8, lora_dropout=0.5, target_modules="all-linear", init_lora_weights=False
    )

    def losses_with_two_keys(trainer):
        trainer._ensure_state()
        state = trainer.train_state
        host = trainer._collate(list(trainer.train_dataset.select(range(4))))
        mb = trainer._to_device({k: v[None] for k, v in host.items()})
        mb = {k: v[0] for k, v in mb.items()}
        fn = jax.jit(trainer._with_lora_dropout(trainer._loss_fn()))
        return [float(fn(state.params, state, mb, jax.random.key(s), {})[0]) for s in (0, 1)]

    dpo = DPOTrainer(
        hf_model_dir,
        args=DPOConfig(**base_args(tmp_path / "dpo", max_steps=1)),
        train_dataset=pref_data[0],
        processing_class=tokenizer,
        peft_config=cfg,
    )
    assert dpo.args.disable_dropout
    a, b = losses_with_two_keys(dpo)
    assert a == b
    sft = _sft(tmp_path / "sft", hf_model_dir, tokenizer, sft_data, peft_config=cfg, max_steps=1)
    a, b = losses_with_two_keys(sft)
    assert abs(a - b) > 1e-4
