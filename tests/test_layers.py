"""The package's layering: each sub-package imports only from the ones below it (the order in
``ds_patrickstar/__init__.py``), and no module is larger than the project's limit. Static: reads
the sources, imports nothing."""
from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "ds_patrickstar"
LAYERS = ["chunks", "memory", "placement", "dist", "optim", "io", "integration"]
LEAVES = {"counters", "autograd_state"}  # importable from every layer
ENTRY_POINTS = {"__init__", "__main__", "plan", "zero_to_fp32"}  # the package root and the command lines: any layer
MAX_MODULE_LINES = 400


def _imported_packages(path: Path) -> set[str]:
    """First component under ds_patrickstar of every relative import in ``path``."""
    depth = len(path.relative_to(PACKAGE).parts) - 1
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level:
            up = node.level - 1  # how many packages above the module's own
            if up > depth:
                continue
            base = list(path.relative_to(PACKAGE).parts[:depth - up])
            target = base + (node.module.split(".") if node.module else [a.name for a in node.names][:1])
            found.add(target[0])
    return found


def _modules() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def test_sub_packages_import_only_downwards():
    wrong = []
    for path in _modules():
        parts = path.relative_to(PACKAGE).parts
        if len(parts) == 1:
            own = path.stem
            if own in ENTRY_POINTS:
                continue
            allowed = LEAVES - {own}  # a leaf imports no sub-package
        else:
            own = parts[0]
            allowed = set(LAYERS[:LAYERS.index(own) + 1]) | LEAVES
        for target in _imported_packages(path) - allowed:
            wrong.append(f"{path.relative_to(PACKAGE)} imports {target}")
    assert not wrong, wrong


def test_every_sub_package_says_what_it_owns_and_may_import():
    for layer in LAYERS:
        doc = ast.get_docstring(ast.parse((PACKAGE / layer / "__init__.py").read_text())) or ""
        assert "Owns" in doc and "May import" in doc, layer


def test_no_module_over_the_size_limit():
    sizes = {str(p.relative_to(PACKAGE)): len(p.read_text().splitlines()) for p in _modules()}
    assert max(sizes.values()) <= MAX_MODULE_LINES, {k: v for k, v in sizes.items() if v > MAX_MODULE_LINES}
