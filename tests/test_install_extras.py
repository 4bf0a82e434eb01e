"""Install extras (pyproject.toml) and the README's install lines: `jaxrl[cuda]` / `jaxrl[tpu]`
pull JAX's accelerator builds at the jax version jaxrl pins, under extra names that jax version
has; the README says how to get each and the CPU-only torch build."""

import importlib.metadata
import re
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
README = (ROOT / "README.md").read_text()


def _jax_pin() -> str:
    (pin,) = [d for d in PROJECT["dependencies"] if re.match(r"jax[<>=]", d)]
    return pin.removeprefix("jax")


@pytest.mark.parametrize(("extra", "jax_extra"), [("cuda", "cuda12"), ("tpu", "tpu")])
def test_accelerator_extra_is_jax_at_our_pin(extra, jax_extra):
    assert PROJECT["optional-dependencies"][extra] == [f"jax[{jax_extra}]{_jax_pin()}"]
    # The installed jax satisfies the pin, so its extras are the pinned version's extras.
    assert jax_extra in importlib.metadata.metadata("jax").get_all("Provides-Extra")


def test_readme_has_one_install_line_per_accelerator_and_cpu_torch():
    for extra in ("cuda", "tpu"):
        assert f'pip install -e ".[{extra}]"' in README
    assert "pip install torch --index-url https://download.pytorch.org/whl/cpu" in README
