"""LogCompletionsCallback / WeaveCallback: TRL's arguments and errors, completions from the
trainer's sampler equal to transformers' greedy `generate` of the exported model, jsonl output,
Weave's EvaluationLogger in tracing and evaluation modes (a fake `weave` module: no network)."""

import json
import sys
import types

import datasets
import pytest
import torch
from trainer_utils import base_args
from transformers import AutoModelForCausalLM

from jaxrl import DPOConfig, DPOTrainer, SFTConfig, SFTTrainer
from jaxrl.callbacks.completions import LogCompletionsCallback, WeaveCallback
from jaxrl.generation import GenerationConfig

GEN = GenerationConfig(max_new_tokens=5)


def hf_greedy(model_dir, tokenizer, prompts, max_new_tokens):
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    out = []
    for prompt in prompts:
        ids = torch.tensor([tokenizer(prompt)["input_ids"]])
        with torch.no_grad():
            gen = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=max_new_tokens,
                do_sample=False,
                eos_token_id=tokenizer.eos_token_id,
                pad_token_id=tokenizer.pad_token_id,
            )
        out.append(tokenizer.decode(gen[0, ids.shape[1] :], skip_special_tokens=True))
    return out


def dpo_trainer(tmp_path, hf_model_dir, tokenizer, pref_data, **kw):
    args = DPOConfig(**base_args(tmp_path, max_steps=1, per_device_eval_batch_size=4, **kw))
    return DPOTrainer(
        hf_model_dir,
        args=args,
        train_dataset=pref_data[0],
        eval_dataset=pref_data[1],
        processing_class=tokenizer,
    )


@pytest.mark.slow
def test_log_completions_match_transformers_generate(tmp_path, hf_model_dir, tokenizer, pref_data):
    trainer = dpo_trainer(tmp_path, hf_model_dir, tokenizer, pref_data)
    callback = LogCompletionsCallback(trainer, generation_config=GEN, num_prompts=6, freq=1)
    trainer.add_callback(callback)
    trainer.train()
    rows = [json.loads(line) for line in (tmp_path / "completions.jsonl").read_text().splitlines()]
    prompts = list(pref_data[1]["prompt"][:6])
    assert [r["prompt"] for r in rows] == prompts
    assert {r["step"] for r in rows} == {1}
    export = trainer.save_model(str(tmp_path / "export"))
    want = hf_greedy(export, tokenizer, prompts, GEN.max_new_tokens)
    assert [r["completion"] for r in rows] == want
    assert callback.table == [["1", p, c] for p, c in zip(prompts, want, strict=True)]


def test_callbacks_need_eval_prompts(tmp_path, hf_model_dir, tokenizer, pref_data):
    trainer = DPOTrainer(
        hf_model_dir,
        args=DPOConfig(**base_args(tmp_path / "a")),
        train_dataset=pref_data[0],
        processing_class=tokenizer,
    )
    with pytest.raises(ValueError, match="evaluation dataset"):
        LogCompletionsCallback(trainer)
    text = datasets.Dataset.from_dict({"text": ["1+2=3", "4+5=9"] * 8})
    sft = SFTTrainer(
        hf_model_dir,
        args=SFTConfig(**base_args(tmp_path / "b", per_device_train_batch_size=2)),
        train_dataset=text,
        eval_dataset=text,
        processing_class=tokenizer,
    )
    with pytest.raises(ValueError, match="`prompt` column"):
        LogCompletionsCallback(sft)


class FakeWeave(types.ModuleType):
    """Records what WeaveCallback sends to Weave's EvaluationLogger."""

    def __init__(self):
        super().__init__("weave")
        self.inits, self.loggers = [], []
        fake = self

        class Pred:
            def __init__(self, inputs, output):
                self.inputs, self.output, self.scores, self.finished = inputs, output, {}, False

            def log_score(self, scorer, score):
                self.scores[scorer] = score

            def finish(self):
                self.finished = True

        class EvaluationLogger:
            def __init__(self, model, dataset, eval_attributes):
                self.model, self.dataset, self.attrs = model, dataset, eval_attributes
                self.preds, self.summary, self.finished = [], None, False
                fake.loggers.append(self)

            def log_prediction(self, inputs, output):
                self.preds.append(Pred(inputs, output))
                return self.preds[-1]

            def log_summary(self, summary):
                self.summary = summary

            def finish(self):
                self.finished = True

        self.EvaluationLogger = EvaluationLogger
        self.init = lambda project: fake.inits.append(project) or object()


@pytest.fixture
def fake_weave(monkeypatch):
    weave = FakeWeave()
    context = types.ModuleType("weave.trace.context")
    context.weave_client_context = types.SimpleNamespace(get_weave_client=lambda: None)
    monkeypatch.setitem(sys.modules, "weave", weave)
    monkeypatch.setitem(sys.modules, "weave.trace", types.ModuleType("weave.trace"))
    monkeypatch.setitem(sys.modules, "weave.trace.context", context)
    return weave


@pytest.mark.slow
@pytest.mark.parametrize("scored", [False, True])
def test_weave_tracing_and_evaluation(
    tmp_path, hf_model_dir, tokenizer, pref_data, fake_weave, scored
):
    trainer = dpo_trainer(tmp_path, hf_model_dir, tokenizer, pref_data, eval_strategy="steps")
    scorers = {"length": lambda prompt, completion: float(len(completion))} if scored else None
    callback = WeaveCallback(
        trainer, project_name="proj", scorers=scorers, generation_config=GEN, num_prompts=4
    )
    trainer.add_callback(callback)
    trainer.train()
    assert fake_weave.inits == ["proj"]
    (log,) = fake_weave.loggers
    assert log.dataset == "eval_dataset" and log.attrs["training_step"] == 1
    prompts = list(pref_data[1]["prompt"][:4])
    assert [p.inputs["prompt"] for p in log.preds] == prompts
    assert [p.output for p in log.preds] == trainer.generate_completions(prompts, GEN)
    assert all(p.finished for p in log.preds)
    if scored:
        lengths = [float(len(p.output)) for p in log.preds]
        assert [p.scores["length"] for p in log.preds] == lengths
        assert log.summary == {
            "total_predictions": 4,
            "successful_predictions": 4,
            "avg_length": sum(lengths) / 4,
        }
    else:
        assert log.finished and log.summary is None


def test_weave_missing_is_a_clear_error(tmp_path, hf_model_dir, tokenizer, pref_data, monkeypatch):
    monkeypatch.setitem(sys.modules, "weave", None)
    trainer = dpo_trainer(tmp_path, hf_model_dir, tokenizer, pref_data)
    with pytest.raises(ImportError, match="pip install"):
        WeaveCallback(trainer, project_name="p")


@pytest.mark.slow
def test_dpo_generate_during_eval_game_log(tmp_path, hf_model_dir, tokenizer, pref_data):
    """TRL < 1.0's `generate_during_eval`: at the evaluation of step 1, a random eval batch is
    sampled from the policy and from the frozen reference; with `top_k=1` in the model's
    generation config, sampling is greedy, so both columns equal transformers' greedy `generate`
    of the exported policy and of the initial model, with `max_length` tokens in total."""
    import shutil

    model_dir = tmp_path / "model"
    shutil.copytree(hf_model_dir, model_dir)
    (model_dir / "generation_config.json").write_text(json.dumps({"top_k": 1}))
    args = base_args(tmp_path, max_steps=1, learning_rate=3e-2, per_device_eval_batch_size=4)
    trainer = DPOTrainer(
        str(model_dir),
        args=DPOConfig(**args, max_length=12, eval_strategy="steps", generate_during_eval=True),
        train_dataset=pref_data[0],
        eval_dataset=pref_data[1],
        processing_class=tokenizer,
    )
    trainer.train()
    rows = [json.loads(line) for line in (tmp_path / "game_log.jsonl").read_text().splitlines()]
    assert len(rows) == 4 and {r["step"] for r in rows} == {1}
    prompts = [r["prompt"] for r in rows]
    assert set(prompts) <= set(pref_data[1]["prompt"]) and len(set(prompts)) == 4
    budget = 12 - max(len(tokenizer(p)["input_ids"]) for p in prompts)
    export = trainer.save_model(str(tmp_path / "export"))
    assert [r["policy"] for r in rows] == hf_greedy(export, tokenizer, prompts, budget)
    assert [r["ref_model"] for r in rows] == hf_greedy(hf_model_dir, tokenizer, prompts, budget)
    assert any(r["policy"] != r["ref_model"] for r in rows)  # the two columns are two models

    logged = []
    fake = types.ModuleType("wandb")
    fake.run = object()
    fake.Table = lambda columns, data: (columns, data)
    fake.log = logged.append
    trainer.args.report_to = ["wandb"]
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(sys.modules, "wandb", fake)
        again = trainer.log_game(trainer.eval_dataset)
    (entry,) = logged
    columns, data = entry["game_log"]
    assert columns == ["Prompt", "Policy", "Ref Model"]
    assert data == [[r["prompt"], r["policy"], r["ref_model"]] for r in again]
