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
    ("lookup_table.keras.fit", 5),  # RemoteOptimizer: Keras' model.fit on the session
    # a bound model's export snapshots the cluster as a checkpoint does (ops/)
    ("lookup_table.serving", 6),
    ("lookup_table.keras", 6),  # the Keras facade: layer, optimizer, export, callback
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
