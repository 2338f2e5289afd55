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
    # Above the model only: it reads the architecture from the model's files (model.arch,
    # model.loader); the model never reads the engine's config.
    "config": 1.5,
    "model": 1,
    # Below all: leaves that the layers above share.
    "ipc": 0,
    "distributed": 0,
    "envs": 0,
    "sampling_params": 0,
    "messages": 0,
    "errors": 0,
    "outputs": 0,
    "inputs": 0,
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
