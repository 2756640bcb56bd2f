"""The family seam: generic modules never ask which family a model is, mla_func has no import
cycle, and a family defined outside mla_func loads and runs through the registry alone."""

from __future__ import annotations

import ast
import dataclasses
import json
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

import mla_func as mf
from mla_func.demo.export import params_to_hf
from mla_func.models.mla.family import MLA
from mla_func.models.random_weights import random_params

ROOT = Path(__file__).resolve().parent.parent
# Where each package's files are (pyproject.toml's package-dir).
PACKAGE_DIRS = {"mla_func": ROOT / "mla_func", "mla_func.kernels": ROOT / "kernels", "mla_func.state": ROOT / "state"}

# Packages and modules that run every model the same way: they reach a model's family through
# `config.family` only. `core.config` is left out: `ModelConfig` still holds the MLA families'
# attention fields (kv_lora_rank, the indexer's) as shared fields, and their checks. The loader and
# the CLI are not generic either: they default to the registry of every family (`models.registry.FAMILIES`).
GENERIC_PACKAGES = ("mla_func.core", "mla_func.serving", "mla_func.server", "mla_func.checkpoint",
                    "mla_func.parallel")
GENERIC_MODULES = ("mla_func.models.memory", "mla_func.models.tensor_shapes", "mla_func.models.random_weights")
NOT_GENERIC = ("mla_func.core.config",)

# The families' own folders, the registry that imports them all, and the named presets.
FAMILY_MODULES = re.compile(r"^mla_func\.(models\.(mla|dsa|v4)(\.\w+)?|models\.registry|models\.presets|state\.v4_cache)$")

# A family's names: model_types, the families' own names as identifiers, their models' names.
FAMILY_NAMES = re.compile(r"deepseek_v\d|DeepSeek-V\d|V3\.2|\bv32\b|\bv4\b|\bV4\b|v4_|\bdsa\b|\bDSA\b|is_sparse|"
                          r"_family\b|\bFAMILIES\b|\bDSA_|\bdsa_|models\.(mla|dsa|v4)\b")


def _modules() -> dict[str, tuple[Path, bool]]:
    """Every module of the installed layout: name -> (file, is a package)."""
    out = {}
    for package, folder in PACKAGE_DIRS.items():
        for path in folder.rglob("*.py"):
            parts = list(path.relative_to(folder).with_suffix("").parts)
            if package == "mla_func" and parts[0] in ("kernels", "state"):
                continue
            is_package = parts[-1] == "__init__"
            parts = parts[:-1] if is_package else parts
            out[".".join([package, *parts])] = (path, is_package)
    return out


MODULES = _modules()
GENERIC = sorted(name for name in MODULES
                 if (name.startswith(tuple(p + "." for p in GENERIC_PACKAGES)) or name in GENERIC_PACKAGES
                     or name in GENERIC_MODULES) and name not in NOT_GENERIC)


def _type_checking_only(tree: ast.Module) -> set[int]:
    """The nodes under `if TYPE_CHECKING:`: annotations, never run, so no import at run time."""
    skipped: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
            for statement in node.body:
                skipped.update(id(n) for n in ast.walk(statement))
    return skipped


def _imports(name: str) -> set[str]:
    """The mla_func modules `name` imports when it runs, at the top or inside a function (a lazy import counts)."""
    path, is_package = MODULES[name]
    tree = ast.parse(path.read_text())
    skipped = _type_checking_only(tree)
    package = name if is_package else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.ImportFrom):
            base = package.split(".")[:len(package.split(".")) - node.level + 1] if node.level else []
            module = ".".join(base + ([node.module] if node.module else []))
            # `from package import submodule` runs the submodule (the package is a parent of both
            # and is initialised first either way); `from module import name` runs the module.
            submodules = [f"{module}.{alias.name}" for alias in node.names if f"{module}.{alias.name}" in MODULES]
            candidates = submodules if len(submodules) == len(node.names) else [module, *submodules]
        elif isinstance(node, ast.Import):
            candidates = [alias.name for alias in node.names]
        else:
            continue
        found.update(c for c in candidates if c in MODULES and c != name)
    return found


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    out.append(sorted(component))
    return out


@pytest.mark.parametrize("module", GENERIC)
def test_generic_module_imports_no_family(module):
    name = module
    family_imports = sorted(m for m in _imports(name) if FAMILY_MODULES.match(m))
    assert not family_imports, f"{name} imports family modules {family_imports}: ask config.family instead"


@pytest.mark.parametrize("module", GENERIC)
def test_generic_module_names_no_family(module):
    path, _ = MODULES[module]
    hits = [f"{path.name}:{n}: {line.strip()}" for n, line in enumerate(path.read_text().splitlines(), 1)
            if FAMILY_NAMES.search(line)]
    assert not hits, "generic code names a family:\n" + "\n".join(hits)


def test_the_name_patterns_catch_what_they_are_for():
    for text in ('config.v4 is not None', '"deepseek_v32"', "from .v4_layers import", "DSA_DECODER",
                 "config.is_sparse", "DeepSeek-V4's layers", "from .mla_family import MLA",
                 "from mla_func.models.v4.layers import V4_LAYER", "import mla_func.models.dsa.attention"):
        assert FAMILY_NAMES.search(text), text
    for text in ("mla_attention", "kv_lora_rank", "cache_groups", "family.supports_batch_invariant",
                 "from mla_func.models.mtp.layer import mtp_layer"):
        assert not FAMILY_NAMES.search(text), text
    assert "mla_func.core.forward" in GENERIC and "mla_func.serving.engine" in GENERIC
    assert FAMILY_MODULES.match("mla_func.models.v4.attention") and not FAMILY_MODULES.match("mla_func.models.load")


def test_no_import_cycle_in_mla_func():
    graph = {name: _imports(name) for name in MODULES}
    assert _cycles(graph) == []


def test_the_cycle_finder_sees_a_lazy_import_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


# A toy family: DeepSeek-V3's layers under a model_type of its own, without batch-invariant ops or MTP.
# It is built here, outside mla_func, and reaches the loader through the registry it is given.
def _toy_from_hf(raw, family):
    mla = MLA.config_from_hf({**raw, "model_type": "deepseek_v3"}, MLA)
    return dataclasses.replace(mla, family=family, model_type=raw["model_type"])


def _toy_to_hf(config):
    as_mla = dataclasses.replace(config, family=MLA, model_type="deepseek_v3")
    return {**MLA.config_to_hf(as_mla), "model_type": "toy_mla", "architectures": ["ToyForCausalLM"]}


TOY = dataclasses.replace(MLA, name="toy", title="Toy", model_types=("toy_mla",), config_from_hf=_toy_from_hf,
                          config_to_hf=_toy_to_hf, supports_batch_invariant=False, mtp=None)


@pytest.fixture(scope="module")
def toy_folder(tmp_path_factory):
    config = dataclasses.replace(mf.PRESETS["tiny"](), family=TOY, model_type="toy_mla")
    params, _ = random_params(config, dtype=torch.float32, device=torch.device("cpu"), seed=0, progress=False,
                              max_model_len=None)
    folder = tmp_path_factory.mktemp("toy")
    (folder / "config.json").write_text(json.dumps(config.to_hf_dict()))
    save_file({name: t.contiguous() for name, t in params_to_hf(params).items()}, str(folder / "model.safetensors"))
    return folder


def test_a_toy_family_loads_and_runs_through_the_registry_alone(toy_folder):
    with pytest.raises(mf.ConfigError, match="'model_type' = 'toy_mla'"):
        mf.load_model(toy_folder, device="cpu")
    families = mf.registry(*dict.fromkeys(mf.FAMILIES.values()), TOY)
    assert families["toy_mla"] is TOY and families["deepseek_v4"] is mf.FAMILIES["deepseek_v4"]
    model = mf.load_model(toy_folder, device="cpu", families=families)
    assert model.config.family is TOY and model.config.model_type == "toy_mla"
    assert mf.config_from_hf_dict(model.config.to_hf_dict(), families) == model.config
    state = mf.init_state(model, num_blocks=8, block_size=16)
    plan = mf.StepPlan(prefill=(mf.SeqPlan(token_ids=tuple(range(5, 25)), start_pos=0, block_table=(1, 2)),))
    batch, mode = mf.plan_step(model.config, state, plan)
    logits, state = mf.prefill(model.params, state, batch, mode)
    assert logits.shape == (1, model.config.vocab_size) and torch.isfinite(logits).all()
    with pytest.raises(ValueError, match="Toy's layers have no batch-invariant ops"):
        mf.make_step(model, batch_invariant=True)
    with pytest.raises(mf.CheckpointError, match="Toy multi-token prediction is not supported"):
        mf.load_model(toy_folder, device="cpu", families=families, mtp=True)


def test_a_registry_refuses_two_families_for_one_model_type():
    with pytest.raises(ValueError, match="'deepseek_v3' is claimed by families 'mla' and 'toy'"):
        mf.registry(MLA, dataclasses.replace(TOY, model_types=("deepseek_v3",)))
