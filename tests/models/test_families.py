"""The family table (`jaxrl.models.families`) and the import graph of `jaxrl.models`."""

import ast
import re
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


def test_checkpoint_and_lora_traits():
    """What `hf`, `hf_keys` and `jaxrl.lora` read from the table, for a few families."""
    llama, gpt2, gemma3 = (families.family(t) for t in ("llama", "gpt2", "gemma3"))
    assert (llama.hf_causal_arch, llama.hf_seq_cls_arch) == (
        "LlamaForCausalLM",
        "LlamaForSequenceClassification",
    )
    assert (gpt2.hf_causal_arch, gpt2.hf_seq_cls_arch) == (
        "GPT2LMHeadModel",
        "GPT2ForSequenceClassification",
    )
    assert gemma3.hf_causal_arch == "Gemma3ForConditionalGeneration"
    assert families.family("gemma3_text").hf_seq_cls_arch == "Gemma3TextForSequenceClassification"
    assert families.family("granite").hf_seq_cls_arch is None
    assert families.family("olmoe").hf_seq_cls_arch is None
    assert all(f.hf_causal_arch for f in families.FAMILIES.values())
    assert (llama.base_prefix, llama.layer_stack_name) == ("model", "layers")
    assert llama.conv1d_modules == ()
    assert (gpt2.base_prefix, gpt2.layer_stack_name) == ("transformer", "h")
    assert gpt2.conv1d_modules == ("c_attn", "c_proj", "c_fc")
    assert llama.default_lora_targets == ("q_proj", "v_proj")
    assert gpt2.default_lora_targets == ("c_attn",)
    assert families.family("phi3").default_lora_targets is None
    assert families.family("mixtral").default_lora_targets is None  # see peft_v5_config
    conversion = {
        t: f.moe.peft_v5_conversion for t, f in families.FAMILIES.items() if f.moe is not None
    }
    assert conversion == {
        "qwen2_moe": None,
        "qwen3_moe": "qwen2_moe",
        "mixtral": "mixtral",
        "olmoe": "qwen2_moe",
        "gpt_oss": None,
    }
    routers = [t for t, f in families.FAMILIES.items() if f.moe and f.moe.router_bias]
    assert routers == ["gpt_oss"]


def test_lora_default_targets_follow_the_table():
    from jaxrl.lora import DEFAULT_TARGETS

    assert DEFAULT_TARGETS == {
        "llama": ("q_proj", "v_proj"),
        "mistral": ("q_proj", "v_proj"),
        "qwen2": ("q_proj", "v_proj"),
        "qwen3": ("q_proj", "v_proj"),
        "gemma": ("q_proj", "v_proj"),
        "gemma2": ("q_proj", "v_proj"),
        "gemma3_text": ("q_proj", "v_proj"),
        "gpt2": ("c_attn",),
    }


def test_no_model_type_tests_outside_the_table():
    """Per-family differences live in `families.py`: no other module compares `model_type`
    against a family name (reading a table derived from it, such as `LANGUAGE_MODEL_PREFIX`,
    is fine)."""
    hits = []
    for path in sorted(MODELS_DIR.parent.rglob("*.py")):
        if path.name == "families.py":
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if re.search(r"model_type (==|!=|in|not in) \S*[\"'(\[]", line):
                hits.append(f"{path.relative_to(MODELS_DIR.parent)}:{number}: {line.strip()}")
    assert not hits, hits


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
