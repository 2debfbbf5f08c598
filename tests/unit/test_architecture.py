"""The layers of docs/architecture.md, checked on every import of every package module."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("lookup_table", "optimizer_service", "trainer")

# (module prefix, layer): a module may import modules of its own layer or below.
LAYERS = [
    ("lookup_table.errors", 0),
    ("lookup_table.core", 1),
    ("lookup_table.config", 2),
    ("lookup_table.memcached", 3),
    ("lookup_table.store", 4),
    ("lookup_table.dense", 4),
    ("lookup_table.client", 5),
    ("lookup_table.keras.layer", 5),  # DistributedEmbedding: a leaf of keras/
    ("lookup_table.keras.rows", 5),  # a batch's ids and rows, fetched ahead, patched
    ("lookup_table.keras.session", 5),  # the cluster side of training (store, client, layers)
    ("lookup_table.keras.steps", 5),  # the graph step that Trainer and model.fit run
    ("lookup_table.keras.tensors", 5),  # numpy arrays handed to TensorFlow without a copy
    ("lookup_table.keras.fit", 5),  # RemoteOptimizer: Keras' model.fit on the session
    ("lookup_table.keras.serving", 5),  # the SavedModel writer: a model and rows given, no cluster
    # the Keras facade (layer, optimizer, callback) and keras.export, whose bound model's
    # export snapshots the cluster as a checkpoint does (ops/)
    ("lookup_table.keras", 6),
    ("lookup_table", 6),  # the package itself (lazy re-exports) and ops/
    ("optimizer_service", 7),
    ("trainer", 8),
]


def _layer(module: str) -> int:
    for prefix, layer in LAYERS:
        if module == prefix or module.startswith(prefix + "."):
            return layer
    raise AssertionError(f"no layer for {module}")


def _modules() -> Iterator[tuple[str, Path]]:
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            yield ".".join(parts), path


def _imports(path: Path) -> Iterator[tuple[str, list[str], bool, int]]:
    """(module, names, under TYPE_CHECKING, line) of every import in the file."""
    tree = ast.parse(path.read_text(), str(path))
    typing_only: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            typing_only.update(id(n) for stmt in node.body for n in ast.walk(stmt))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, [], id(node) in typing_only, node.lineno
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [a.name for a in node.names]
            yield node.module, names, id(node) in typing_only, node.lineno


def test_dependencies_point_down_the_layers() -> None:
    wrong = []
    for module, path in _modules():
        own = _layer(module)
        for target, names, typing_only, line in _imports(path):
            if target.split(".")[0] not in PACKAGES:
                continue
            # `from lookup_table.memcached import commands`: the layer of the submodule
            full = [f"{target}.{n}" for n in names] or [target]
            for imported in full:
                top = imported.split(".")[0]
                try:
                    layer = _layer(imported)
                except AssertionError:
                    layer = _layer(top)
                if typing_only and own == 1 and imported.startswith("lookup_table.config"):
                    continue  # the optimizers' configs, for type hints only
                if layer > own or (
                    own in (7, 8) and layer in (7, 8) and top != module.split(".")[0]
                ):
                    wrong.append(f"{path.relative_to(ROOT)}:{line} imports {imported}")
    assert wrong == []


def test_the_library_never_imports_the_service_or_the_trainer() -> None:
    wrong = [
        f"{path.relative_to(ROOT)}:{line}"
        for module, path in _modules()
        if module.startswith("lookup_table")
        for target, _, _, line in _imports(path)
        if target.split(".")[0] in ("optimizer_service", "trainer")
    ]
    assert wrong == []


def test_no_package_module_imports_torch() -> None:
    """torch, torchrec and fbgemm_gpu are the benchmarks' optional baselines (the
    torch-baselines extra), never a dependency of the library, the service or the trainer."""
    wrong = [
        f"{path.relative_to(ROOT)}:{line}: {target}"
        for _, path in _modules()
        for target, _, _, line in _imports(path)
        if target.split(".")[0] in ("torch", "torchrec", "fbgemm_gpu")
    ]
    assert wrong == []


def test_no_module_imports_another_modules_private_names() -> None:
    wrong = [
        f"{path.relative_to(ROOT)}:{line} takes {name} from {target}"
        for module, path in _modules()
        for target, names, _, line in _imports(path)
        if target.split(".")[0] in PACKAGES and target != module
        for name in names
        if name.startswith("_") and not name.startswith("__")
    ]
    assert wrong == []


def _module_of(imported: str, modules: set[str]) -> str | None:
    """The project module an import runs: the longest prefix that is one."""
    parts = imported.split(".")
    for end in range(len(parts), 0, -1):
        candidate = ".".join(parts[:end])
        if candidate in modules:
            return candidate
    return None


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every strongly connected group of two or more modules (Tarjan), sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            group = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                group.append(member)
                if member == node:
                    break
            if len(group) > 1:
                groups.append(sorted(group))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return sorted(groups)


def _runtime_graph() -> dict[str, set[str]]:
    """module -> the project modules it imports when it runs, in a function or not
    (imports under TYPE_CHECKING never run and are left out). Importing `a.b.c` first
    runs the packages `a` and `a.b`: those count too, except the module's own packages,
    which run before it does."""
    paths = dict(_modules())
    modules = set(paths)
    graph: dict[str, set[str]] = {module: set() for module in modules}
    for module, path in paths.items():
        own = {".".join(module.split(".")[:end]) for end in range(1, module.count(".") + 1)}
        for target, names, typing_only, _ in _imports(path):
            if typing_only or target.split(".")[0] not in PACKAGES:
                continue
            for imported in [f"{target}.{n}" for n in names] or [target]:
                found = _module_of(imported, modules)
                if found is None:
                    continue
                parts = found.split(".")
                runs = {".".join(parts[:end]) for end in range(1, len(parts) + 1)}
                graph[module] |= {m for m in runs & modules if m not in own and m != module}
    return graph


def test_import_cycles_are_found() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": {"e"}}
    assert import_cycles(graph) == [["a", "b", "c"]]
    assert import_cycles({"a": {"b"}, "b": set()}) == []


def test_importing_a_module_runs_its_packages() -> None:
    """`from lookup_table.keras.layer import ...` outside keras/ runs the facade
    keras/__init__ first (a module below it that did so would be in a cycle with it);
    inside keras/ the package already runs."""
    graph = _runtime_graph()
    assert "lookup_table.keras" in graph["lookup_table.ops.checkpoint.cli"]
    assert "lookup_table.keras" not in _runtime_graph()["lookup_table.keras.session"]


def test_no_import_cycles_function_level_imports_included() -> None:
    cycles = [" -> ".join(group) for group in import_cycles(_runtime_graph())]
    assert cycles == []


def test_the_savedmodel_writer_reaches_no_cluster() -> None:
    """lookup_table.keras.serving writes what it is given: nothing it runs, directly or through
    another module, opens a connection to memcached or to the service."""
    graph = _runtime_graph()
    reached: set[str] = set()
    todo = [
        m
        for m in graph
        if m == "lookup_table.keras.serving" or m.startswith("lookup_table.keras.serving.")
    ]
    while todo:
        module = todo.pop()
        if module not in reached:
            reached.add(module)
            todo.extend(graph[module])
    cluster = ("lookup_table.memcached", "lookup_table.store", "lookup_table.client")
    cluster += ("lookup_table.keras.session", "lookup_table.keras.fit", "lookup_table.ops")
    wrong = sorted(m for m in reached if m.startswith(cluster))
    assert wrong == []


# Keras' private names that no public API replaces, each read in one helper of ours
KERAS_PRIVATE = {"_flatten_layers", "_loss_tracker"}


def _private_uses(source: str) -> Iterator[tuple[int, str]]:
    """(line, name) of every `obj._name` whose name the module itself does not define."""
    tree = ast.parse(source)
    own = {
        node.name
        for node in ast.walk(tree)
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef)
    } | {
        node.attr
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store)
    }
    for node in ast.walk(tree):
        name = getattr(node, "attr", "")
        if (
            isinstance(node, ast.Attribute)
            and name.startswith("_")
            and not name.startswith("__")
            and name not in own | KERAS_PRIVATE
        ):
            yield node.lineno, name


def test_the_keras_side_uses_no_private_name_of_another_module() -> None:
    """Trainer and RemoteOptimizer compose TrainingSession's public step API."""
    wrong = [
        f"{path.relative_to(ROOT)}:{line} uses {name}"
        for module, path in _modules()
        if module.startswith(("lookup_table.keras", "trainer"))
        for line, name in _private_uses(path.read_text())
    ]
    assert wrong == []


def test_a_private_call_across_modules_is_caught() -> None:
    inherited = "class Trainer(TrainingSession):\n    def fit(self):\n        self._settle()\n"
    assert list(_private_uses(inherited)) == [(3, "_settle")]


def test_the_keras_layer_is_a_leaf() -> None:
    """DistributedEmbedding imports nothing of the Keras side: the session binds to it."""
    path = ROOT / "lookup_table" / "keras" / "layer.py"
    assert [t for t, _, _, _ in _imports(path) if t.startswith("lookup_table.keras")] == []
