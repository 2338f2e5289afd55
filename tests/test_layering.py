"""Imports run one way: entrypoints → engine → executor → worker → model → the leaves.

Reads every module of the package (imports inside functions included) and fails on an import
of a higher layer.
See ../shared/design/architecture.md, "Layers".
"""

from __future__ import annotations

import ast
from pathlib import Path

import shardserve

PACKAGE = Path(shardserve.__file__).parent

# Higher number = higher layer. A module may import its own layer or any lower one.
LAYERS = {
    "entrypoints": 5,
    "engine": 4,
    "executor": 3,
    "worker": 2,
    "model": 1,
    # Plain data below the model (engine/config_builder.py reads the model's files); it uses
    # distributed's RankLayout for the rank arithmetic.
    "config": 0.5,
    # LoRA adapters as plain data (the request, the files peft writes); reads config's arch.
    "lora": 0.5,
    # Below all: leaves that the layers above share.
    "ipc": 0,
    "distributed": 0,
    "envs": 0,
    "sampling_params": 0,
    "pooling_params": 0,
    "messages": 0,
    "errors": 0,
    "outputs": 0,
    "inputs": 0,
    "process_setup": 0,
    "idle_threads": 0,
}
# The package's own __init__ re-exports the public API (LLM), like an entry point.
TOP_LEVEL_FACADES = {"__init__", "__main__"}


def _layer_of(module: str) -> float | None:
    """The layer of a dotted module under shardserve ("shardserve.engine.core" → 4)."""
    parts = module.split(".")
    if parts[0] != "shardserve" or len(parts) < 2:
        return None
    return LAYERS.get(parts[1])


def _imports(path: Path, module: str) -> list[tuple[int, str]]:
    tree = ast.parse(path.read_text(), filename=str(path))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against this module's package
                base = module.split(".")[: -node.level]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target == "shardserve":  # `from shardserve import envs`: the names are modules
                found += [(node.lineno, f"shardserve.{alias.name}") for alias in node.names]
            else:
                found.append((node.lineno, target))
    return found


def _modules() -> list[tuple[Path, str]]:
    out = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE.parent).with_suffix("")
        out.append((path, ".".join(rel.parts)))
    return out


def test_every_module_has_a_layer():
    unknown = {
        module.split(".")[1]
        for _, module in _modules()
        if module.split(".")[1] not in LAYERS and module.split(".")[1] not in TOP_LEVEL_FACADES
    }
    assert not unknown, f"modules outside every layer: {sorted(unknown)}; add them to LAYERS"


def test_imports_never_go_up_a_layer():
    violations = []
    for path, module in _modules():
        own = _layer_of(module)
        if own is None:  # shardserve/__init__.py, __main__.py: facades
            continue
        for lineno, target in _imports(path, module):
            theirs = _layer_of(target)
            if theirs is not None and theirs > own:
                violations.append(f"{path.relative_to(PACKAGE.parent)}:{lineno} imports {target}")
    assert not violations, "imports against the layer order:\n" + "\n".join(violations)


def test_the_checker_catches_an_upward_import(tmp_path):
    # The test must be able to fail: an executor module importing the engine is caught.
    bad = tmp_path / "bad.py"
    bad.write_text("from shardserve.engine.core import EngineCore\nfrom shardserve import envs\n")
    imports = _imports(bad, "shardserve.executor.bad")
    assert [(t, _layer_of(t)) for _, t in imports] == [
        ("shardserve.engine.core", 4),
        ("shardserve.envs", 0),
    ]
    assert _layer_of("shardserve.executor.bad") < _layer_of(imports[0][1])


def _module_edges() -> dict[str, set[str]]:
    """Module -> the package's modules it imports (at the top or inside functions); `from
    pkg import name` counts as importing pkg.name where that is a module. Imports under
    `if TYPE_CHECKING:` never run, so they make no circle."""
    known = {module for _, module in _modules()}
    known |= {m.removesuffix(".__init__") for m in known}
    edges: dict[str, set[str]] = {}
    for path, module in _modules():
        name = module.removesuffix(".__init__")
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.If) and ast.unparse(node.test).endswith("TYPE_CHECKING"):
                node.body = []
        targets = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                targets |= {alias.name for alias in node.names}
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = module.split(".")[: -node.level]
                    base = ".".join(parts + ([node.module] if node.module else []))
                subs = {f"{base}.{alias.name}" for alias in node.names} & known
                targets |= subs or {base}
        edges[name] = {t for t in targets if t in known and t != name}
    return edges


def _mutual_imports(edges: dict[str, set[str]]) -> list[tuple[str, str]]:
    return sorted((a, b) for a, targets in edges.items() for b in targets
                  if a < b and a in edges.get(b, set()))


def test_no_two_modules_import_each_other():
    pairs = _mutual_imports(_module_edges())
    assert not pairs, "modules that import each other (lazily or not):\n" + "\n".join(
        f"{a} <-> {b}" for a, b in pairs)


def test_the_circle_check_can_fail():
    edges = {"shardserve.engine.a": {"shardserve.engine.b"},
             "shardserve.engine.b": {"shardserve.engine.a", "shardserve.envs"}}
    assert _mutual_imports(edges) == [("shardserve.engine.a", "shardserve.engine.b")]
