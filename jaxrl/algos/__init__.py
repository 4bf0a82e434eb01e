"""The traced math of each algorithm, importable and testable without a trainer.

One module per algorithm (`sft`, `reward`, `dpo`, `ppo`, `grpo`, `rloo`, `ddpo`) plus the forward
helpers they share (`masks`, `rollout`, `router_aux`). Each builds pure functions of arrays and
models (loss factories, log-prob and entropy helpers) from a config; nothing here touches the host
loop, datasets, files or callbacks.
"""
