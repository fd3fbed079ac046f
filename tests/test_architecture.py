"""The layers of src/tformer, checked: which package may import which, no import cycles, no borrowed private names.

The packages, bottom to top (docs/ARCHITECTURE.md draws the tree); a module imports only from its own
layer and the layers below:

    errors, devices -> kernels -> model -> inference -> generation -> data -> checkpoints
      -> inspect, evaluation -> training -> tasks -> serve, bench -> cli

An import inside a function is still an import: the graph below is read with `ast` from every
statement of every module, not from what Python happens to load first.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "src" / "tformer"

# bottom to top: a package may import its own layer and the ones before it
LAYERS = [
    ["tformer.errors", "tformer.devices"],
    ["tformer.kernels"],
    ["tformer.model"],
    ["tformer.inference"],
    ["tformer.generation"],
    ["tformer.data"],
    ["tformer.checkpoints"],
    ["tformer.inspect", "tformer.evaluation"],
    ["tformer.training"],
    ["tformer.tasks"],
    ["tformer.serve", "tformer.bench"],
    ["tformer.cli", "tformer.__main__"],
]
LEVEL = {package: i for i, layer in enumerate(LAYERS) for package in layer}

# Imports from a package upward, each inside a method and on first use: model.generate(...) /
# model.stream(...) forward to the generation package (Hugging Face's API puts generate() on the model),
# and a GPT's fused decoding step (built from the model's layers) is made on its first decoding step.
UPWARD = {("tformer.model.models", "tformer.generation"), ("tformer.model.models", "tformer.inference.fused")}
# Inference never reaches into training: the server and bench score through evaluation, not a task.
NEVER = {"tformer.serve": ("tformer.tasks", "tformer.training"), "tformer.evaluation": ("tformer.training",)}

CORE_PACKAGES = ("tformer.errors", "tformer.devices", "tformer.kernels", "tformer.model", "tformer.inference")


def package_of(name: str) -> str:
    """The layer package of module `name` (tformer.model.attention -> tformer.model); the root: tformer."""
    return ".".join(name.split(".")[:2])


def in_core(name: str) -> bool:
    return name == "tformer" or package_of(name) in CORE_PACKAGES


def module_names() -> dict[str, Path]:
    names = {}
    for path in ROOT.rglob("*.py"):
        parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        names[".".join(parts)] = path
    return names


MODULES = module_names()


def lazy_exports() -> dict[str, str]:
    """tformer/__init__.py's `_EXPORTS` (public name -> module): `from tformer import X` imports that module."""
    for node in ast.parse((ROOT / "__init__.py").read_text()).body:
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", None) == "_EXPORTS":
            return {name: f"tformer.{mod}" for name, mod in ast.literal_eval(node.value).items()}
    return {}


def imports(name: str) -> list[tuple[str, str, int]]:
    """(imported tformer module, imported name or "", line) for every import statement of module `name`."""
    path = MODULES[name]
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    lazy = lazy_exports()
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [(a.name, "", node.lineno) for a in node.names if a.name.split(".")[0] == "tformer"]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[:len(package.split(".")) - node.level + 1]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            if source.split(".")[0] != "tformer":
                continue
            for a in node.names:
                if f"{source}.{a.name}" in MODULES:            # `from . import trace`: a module
                    found.append((f"{source}.{a.name}", "", node.lineno))
                elif source == "tformer" and a.name in lazy:   # `from tformer import Decoder`
                    found.append((lazy[a.name], a.name, node.lineno))
                else:
                    found.append((source, a.name, node.lineno))
    return found


def owner(target: str) -> str:
    """The module that `tformer.a.b` names (a module, or a name inside one)."""
    while target not in MODULES:
        target = target.rpartition(".")[0]
    return target


def graph() -> dict[str, set[str]]:
    edges: dict[str, set[str]] = {name: set() for name in MODULES}
    for name in MODULES:
        for target, _, _ in imports(name):
            if owner(target) != name:
                edges[name].add(owner(target))
    return edges


def find_cycle(edges: dict[str, set[str]]) -> list[str] | None:
    """One cycle as [a, b, ..., a], or None (depth-first search, white/grey/black)."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(edges):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def is_generation(name: str) -> bool:
    return package_of(name) == "tformer.generation"


def upward_imports(modules: dict[str, list[tuple[str, str, int]]]) -> list[str]:
    """Every import of a package from a higher layer (the root package, tformer/__init__.py, is the
    public face and may load anything), except the UPWARD edges, and every import NEVER forbids."""
    wrong = []
    for name, found in sorted(modules.items()):
        if name == "tformer":
            continue
        here = package_of(name)
        for target, _, line in found:
            to = owner(target)
            there = package_of(to)
            if to == "tformer" or (name, to) in UPWARD or there == here:
                continue
            if LEVEL[there] > LEVEL[here] or there in NEVER.get(here, ()):
                wrong.append(f"{name}:{line} imports {target}: {here} may not import {there}")
    return wrong


def test_every_package_has_a_layer():
    assert {package_of(name) for name in MODULES} - {"tformer"} == set(LEVEL)


def test_no_package_imports_a_higher_layer():
    wrong = upward_imports({name: imports(name) for name in MODULES})
    assert not wrong, "\n".join(wrong)


def test_the_layer_check_fails_on_an_upward_import():
    """Planted imports are caught: the training loop into the attention module, a task into the server;
    one within the model's own package is not."""
    planted = {"tformer.model.attention": [("tformer.training.loop", "fit", 1), ("tformer.model.masks", "", 2)],
               "tformer.serve.served": [("tformer.tasks.classify", "encode_texts", 3)]}
    assert upward_imports(planted) == [
        "tformer.model.attention:1 imports tformer.training.loop: tformer.model may not import tformer.training",
        "tformer.serve.served:3 imports tformer.tasks.classify: tformer.serve may not import tformer.tasks"]


def test_the_reader_sees_imports_inside_functions():
    """models.py imports the generation package only inside GenerationMixin's methods."""
    assert "tformer.generation" in {owner(target) for target, _, _ in imports("tformer.model.models")}


def test_no_import_cycle():
    cycle = find_cycle(graph())
    assert cycle is None, "import cycle (counting imports inside functions): " + " -> ".join(cycle)


def test_find_cycle_finds_one():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_devices_imports_nothing_but_errors():
    assert {owner(t) for t, _, _ in imports("tformer.devices")} <= {"tformer.errors"}


def test_library_code_never_imports_the_cli():
    wrong = [f"{name}:{line} imports {target}" for name in sorted(MODULES)
             if not name.startswith("tformer.cli") and name != "tformer.__main__"
             for target, _, line in imports(name) if owner(target).startswith("tformer.cli")]
    assert not wrong, "\n".join(wrong)


def test_no_module_imports_another_modules_private_names():
    wrong = [f"{name}:{line} imports {target}.{what}" for name in sorted(MODULES)
             for target, what, line in imports(name)
             if what.startswith("_") and not what.startswith("__") and owner(target) != name]
    assert not wrong, "\n".join(wrong)


def test_commands_do_not_borrow_from_sibling_commands():
    """A helper two commands share lives in a shared module (cli/common.py), not in one of the commands."""
    shared = {"tformer.cli", "tformer.cli.common", "tformer.cli.args"}
    wrong = [f"{name}:{line} imports {target}" for name in sorted(MODULES) if name.startswith("tformer.cli.")
             for target, _, line in imports(name)
             if owner(target).startswith("tformer.cli.") and owner(target) not in shared | {name}]
    assert not wrong, "\n".join(wrong)


def loaded_with(module: str) -> set[str]:
    """The tformer modules a fresh interpreter has loaded after `import module`."""
    code = f"import sys, {module}; print(' '.join(m for m in sys.modules if m.split('.')[0] == 'tformer'))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    return set(out.split())


@pytest.mark.parametrize("name", sorted(n for n in MODULES if n != "tformer" and in_core(n)))
def test_a_core_module_loads_only_the_core(name):
    assert {m for m in loaded_with(name) if not in_core(m)} == set()


def test_generation_loads_no_training_tasks_or_cli():
    extra = {m for m in loaded_with("tformer.generation") if not in_core(m) and not is_generation(m)}
    assert extra == set()


def test_every_module_is_short():
    """~300 lines at most: a longer module is several (training's loop.py is the training side's to split)."""
    long = {name: n for name, path in MODULES.items() if (n := len(path.read_text().splitlines())) > 300}
    assert long == {}


def test_the_package_loads_its_public_names_on_first_use():
    code = ("import sys, tformer; before = {m for m in sys.modules if m.startswith('tformer.')}; "
            "names = [getattr(tformer, n) for n in tformer.__all__]; "
            "print(sorted(m for m in before if m.split('.')[1] not in ('model', 'kernels', 'devices', 'errors')), "
            "tformer.__version__, callable(tformer.attention), tformer.Decoder.__module__)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["[]", "0.1.0", "True", "tformer.model.models"]
