"""The package's modules import each other without a circle: errors and the values config keys
may take sit at the bottom, config checks import downward only. Read from the source with ast,
both the imports at a module's top and those deferred into functions (a deferred import still
runs, and a circle through it breaks as soon as someone moves it to the top)."""

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "maxtext_rocm"


def module_names() -> dict[str, Path]:
    names = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        names[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return names


def imports_of(path: Path, modules: dict[str, Path], top_level_only: bool) -> set[str]:
    """The package's modules that `path` imports. `from P import X` counts as importing P.X when
    that is a module, else P; a parent package run on the way in is not counted (every submodule
    import runs maxtext_rocm/__init__.py, which would make each a circle of no interest)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts[:-1])
    found = set()
    for node in tree.body if top_level_only else ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from . import x, from .y import z
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([node.module] if node.module else []))
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                found.add(sub if sub in modules else base)
    return {name for name in found if name in modules}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One circle of the graph as [a, b, ..., a], or None."""
    state, stack = {}, []

    def visit(node):
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        state[node] = "done"
        stack.pop()
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def import_graph(top_level_only: bool) -> dict[str, set[str]]:
    modules = module_names()
    return {name: imports_of(path, modules, top_level_only) - {name} for name, path in modules.items()}


@pytest.mark.parametrize("top_level_only", [True, False], ids=["module-level", "with-deferred"])
def test_the_package_has_no_import_circle(top_level_only):
    graph = import_graph(top_level_only)
    assert len(graph) > 30 and graph["maxtext_rocm.train"], "the graph was read"
    cycle = find_cycle(graph)
    assert cycle is None, "import circle: " + " -> ".join(cycle)


# The package's layers, bottom to top: a module imports only from its own subpackage (or root
# module) and from layers below it, never from its own layer's other members or from above.
# Root modules are the public entry points (and resolve.py, which every reader of a resolved
# config imports); `maxtext_rocm` is the package's __init__.
LAYERS = [
    ["errors"],
    ["data"],  # input pipelines read their config group as a plain object; they import no config code
    ["config"],
    ["numerics"],
    ["models"],  # pure: logical axes only, no mesh
    ["parallel"],  # the mesh-aware algorithms, built around model pieces
    ["resolve"],  # the one resolve step (maxtext_rocm/resolve.py): every "auto" decided for a mesh and target
    ["finetune"],  # LoRA (a dot strategy beside a frozen base) and DPO (on the mesh-aware loss)
    ["checkpoint", "reporting", "runtime"],
    ["trainer"],
    ["api", "planner", "convert"],
    ["generate", "compile", "goodput"],
    ["eval"],  # lm-evaluation-harness's model over api, generate and convert's record of the original
    ["train"],  # the command line: builds the Trainer with eval's periodic hooks (trainer/hooks.py)
    ["maxtext_rocm"],
]


def unit(module: str) -> str:
    """maxtext_rocm.trainer.step -> trainer; maxtext_rocm.train -> train; maxtext_rocm -> maxtext_rocm."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def test_subpackages_import_only_downward():
    level = {name: i for i, layer in enumerate(LAYERS) for name in layer}
    graph = import_graph(top_level_only=False)
    units = {unit(m) for m in graph}
    assert units == set(level), f"a unit is missing from LAYERS or gone from the package: {units ^ set(level)}"
    upward = sorted(f"{a} -> {b}" for a, imported in graph.items() for b in imported
                    if unit(a) != unit(b) and level[unit(b)] >= level[unit(a)])
    assert not upward, "imports against the layer order:\n" + "\n".join(upward)


def test_layer_check_sees_an_upward_import():
    level = {name: i for i, layer in enumerate(LAYERS) for name in layer}
    assert level[unit("maxtext_rocm.models.llama")] < level[unit("maxtext_rocm.trainer.step")]
    assert level[unit("maxtext_rocm.config.checks")] < level[unit("maxtext_rocm.parallel.sharding")]


def test_errors_and_config_choices_are_at_the_bottom():
    graph = import_graph(top_level_only=False)
    assert graph["maxtext_rocm.errors"] == set()
    # The keys' declarations (and the constants read from them) sit just above the errors.
    declarations = {"maxtext_rocm.config.schema", "maxtext_rocm.config.keys_model", "maxtext_rocm.config.keys_run",
                    "maxtext_rocm.config.declared"}
    for bottom in (*declarations, "maxtext_rocm.config.choices"):
        assert graph[bottom] <= declarations | {"maxtext_rocm.errors"}, (bottom, graph[bottom])
    assert "maxtext_rocm.config" not in graph["maxtext_rocm.config.checks"]  # checks import downward
    assert "maxtext_rocm.config" not in graph["maxtext_rocm.parallel.sharding"]


def test_find_cycle_finds_one():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None
