"""The family table (`jaxrl.models.families`) and the import graph of `jaxrl.models`."""

import ast
from pathlib import Path

import pytest
import transformers

from jaxrl.models import families, moe
from jaxrl.models.hf_config import config_from_hf

MODELS_DIR = Path(families.__file__).parent


@pytest.mark.parametrize("model_type", families.SUPPORTED_MODEL_TYPES)
def test_every_family_is_a_transformers_model_type(model_type):
    """A misspelt key would make its family unloadable: transformers must know each one."""
    assert transformers.AutoConfig.for_model(model_type).model_type == model_type


def test_derived_tables():
    assert families.LANGUAGE_MODEL_PREFIX == {"gemma3": "model.language_model"}
    assert "gpt2" not in families.LLAMA_FAMILY and "gemma3" not in families.LLAMA_FAMILY
    assert len(families.LLAMA_FAMILY) == len(families.SUPPORTED_MODEL_TYPES) - 2
    # `jaxrl.lora` reads the MoE block's attribute for the families where it is not "mlp".
    assert moe.MOE_ATTRIBUTE == {"mixtral": "block_sparse_moe"}


@pytest.mark.parametrize(
    "model_type", [t for t, f in families.FAMILIES.items() if f.moe is not None]
)
def test_moe_families_build_moe_configs(model_type):
    hf_config = transformers.AutoConfig.for_model(
        model_type, num_hidden_layers=2, num_experts_per_tok=1
    )
    config = config_from_hf(hf_config)
    assert config.moe_layers and all(config.moe_layers)
    assert config.num_experts > 0 and config.moe_intermediate_size > 0


def test_unknown_family_is_a_clear_error():
    with pytest.raises(ValueError, match=r"model_type='bert' is not supported.*llama, mistral"):
        families.family("bert")


def _models_imports() -> dict[str, list[tuple[str, bool]]]:
    """module -> [(imported jaxrl.models module, at module level?)] for jaxrl/models/*.py."""
    modules = {p.stem for p in MODELS_DIR.glob("*.py")} - {"__init__"}
    graph = {}
    for name in sorted(modules):
        tree = ast.parse((MODELS_DIR / f"{name}.py").read_text())
        top = {id(node) for node in tree.body}
        edges = []
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module == "jaxrl.models":
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("jaxrl.models."):
                targets = [node.module.split(".")[2]]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names if a.name.startswith("jaxrl.models.")]
                targets = [n.split(".")[2] for n in names]
            else:
                continue
            edges += [(t, id(node) in top) for t in targets if t in modules]
        graph[name] = edges
    return graph


def test_models_package_is_acyclic():
    """`jaxrl.models`' modules import each other bottom-up, at module level only: no circle, and
    no function-local import of a sibling (they only ever dodged circles)."""
    graph = _models_imports()
    local = [(m, t) for m, edges in graph.items() for t, at_top in edges if not at_top]
    assert not local, f"function-local imports of jaxrl.models modules: {local}"
    done: set[str] = set()

    def visit(module: str, path: tuple[str, ...]) -> None:
        if module in path:
            raise AssertionError(f"import circle: {' -> '.join((*path, module))}")
        if module in done:
            return
        for target, _ in graph[module]:
            visit(target, (*path, module))
        done.add(module)

    for module in graph:
        visit(module, ())
