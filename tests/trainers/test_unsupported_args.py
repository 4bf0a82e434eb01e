"""TRL/HF trainer arguments jaxrl does not take are refused by name, with what to do instead
(not Python's "unexpected keyword argument"), before anything is loaded."""

import pytest

from jaxrl import DPOConfig, DPOTrainer, GRPOConfig, GRPOTrainer, SFTConfig, SFTTrainer


@pytest.mark.parametrize(
    "build",
    [
        lambda t, **kw: SFTTrainer("no/such/model", args=SFTConfig(output_dir=str(t)), **kw),
        lambda t, **kw: DPOTrainer("no/such/model", args=DPOConfig(output_dir=str(t)), **kw),
        lambda t, **kw: GRPOTrainer(
            "no/such/model", reward_funcs=len, args=GRPOConfig(output_dir=str(t)), **kw
        ),
    ],
    ids=["sft", "dpo", "grpo"],
)
def test_trl_arguments_jaxrl_does_not_take_are_named_with_the_fix(build, tmp_path):
    with pytest.raises(TypeError, match=r"`data_collator` is not supported by jaxrl's \w+Trainer"):
        build(tmp_path, data_collator=object())
    with pytest.raises(TypeError, match=r"optimizers=\(optax_tx, schedule\)"):
        build(tmp_path, optimizer_cls_and_kwargs=(object, {}))
    with pytest.raises(TypeError, match=r"`not_an_arg` is not an argument of \w+Trainer"):
        build(tmp_path, not_an_arg=1)
