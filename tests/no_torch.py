"""Subprocesses that see jaxrl's base install: torch and the packages built on it (TRL, PEFT,
Accelerate, bitsandbytes, torchvision) neither import nor show up in `importlib.metadata`, as
when they are not installed, while the rest of this environment stays as it is.

A `sys.modules['torch'] = None` stub is not enough: libraries that find torch's distribution
(or see the `torch` key in `sys.modules`) then try to use it. The interpreter runs a small
wrapper instead, which swaps the path-based import finder for one that skips those packages and
their distributions, then runs the module (`-m NAME ARGS`) or code (`-c CODE ARGS`) given.
"""

import json
import sys

BLOCKED = ("torch", "torchvision", "torchaudio", "trl", "peft", "accelerate", "bitsandbytes")

_WRAPPER = """
import importlib.machinery, json, runpy, sys

blocked = set(json.loads(sys.argv[1]))


class Finder(importlib.machinery.PathFinder):
    @classmethod
    def find_spec(cls, name, path=None, target=None):
        if name.partition(".")[0] in blocked:
            return None
        return super().find_spec(name, path, target)

    @classmethod
    def find_distributions(cls, *args, **kwargs):
        dists = super().find_distributions(*args, **kwargs)
        return (d for d in dists if (d.metadata["Name"] or "").lower() not in blocked)


sys.meta_path[:] = [Finder if f is importlib.machinery.PathFinder else f for f in sys.meta_path]
mode, target, *rest = sys.argv[2:]
if mode == "-m":
    sys.argv = [target, *rest]
    runpy.run_module(target, run_name="__main__", alter_sys=True)
else:
    sys.argv = ["-c", *rest]
    exec(compile(target, "<string>", "exec"), {"__name__": "__main__"})
"""


def command(mode: str, target: str, *args: str) -> list[str]:
    """argv of `python -m target args` (mode "-m") or `python -c target args` (mode "-c")
    without torch."""
    return [sys.executable, "-c", _WRAPPER, json.dumps(BLOCKED), mode, target, *args]
