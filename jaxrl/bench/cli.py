"""`python -m jaxrl.bench`'s entry point: which runner an `--algo` goes to, and the contract of
the output (one JSON object as the last stdout line; exit status 2 with a one-line error on bad
input). Must not time or build anything itself: the runners do.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable

from jaxrl.bench import step
from jaxrl.bench.compare import compare
from jaxrl.bench.ddpo import run_ddpo
from jaxrl.bench.distill import run as run_distill
from jaxrl.bench.generate import run_generate
from jaxrl.bench.grpo import run as run_grpo
from jaxrl.bench.lora import run_lora
from jaxrl.bench.ppo import run_ppo


def _algo(argv: list[str]) -> str | None:
    for i, a in enumerate(argv):
        if a == "--algo" and i + 1 < len(argv):
            return argv[i + 1]
        if a.startswith("--algo="):
            return a.split("=", 1)[1]
    return None


def _without_algo(argv: list[str]) -> list[str]:
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a == "--algo":
            skip = True
        elif not a.startswith("--algo="):
            out.append(a)
    return out


def _peft_on(argv: list[str]) -> bool:
    for i, a in enumerate(argv):
        flag, _, value = a.partition("=")
        if flag == "--use_peft":
            value = value or (argv[i + 1] if i + 1 < len(argv) else "")
            return value.lower() in ("true", "1", "yes")
    return False


# --algo -> runner (argv -> result); any other algo runs the trainer's train step (`step.run`),
# and `--use_peft true` the LoRA comparison (`lora.run_lora`) whatever the algo.
RUNNERS: dict[str, Callable[[list[str]], dict]] = {
    "generate": run_generate,
    "grpo": run_grpo,  # jaxrl vs TRL GRPOTrainer
    "ppo": run_ppo,
    "distill": run_distill,  # jaxrl vs TRL DistillationTrainer
    "ddpo": lambda argv: run_ddpo(_without_algo(argv)),  # its flags are its own, no --algo
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if any(a.split("=", 1)[0] == "--compare" for a in argv):
        try:
            rows = compare(argv)
        except ValueError as e:
            print(f"jaxrl.bench: error: {e}", file=sys.stderr)
            return 2
        print(json.dumps(rows))
        return 0
    try:
        algo = _algo(argv)
        if _peft_on(argv):
            result = run_lora(argv)
        else:
            result = RUNNERS.get(algo, step.run)(argv)
    except ValueError as e:
        print(f"jaxrl.bench: error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(result))
    return 0
