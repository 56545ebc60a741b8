"""The package's layering: each sub-package imports only from the ones below it (the order in
``ds_patrickstar/__init__.py``), no module imports another that imports it back (directly or
through others), no module or class is larger than the project's limit, and every Note cited is
defined once. Static: reads the sources, imports nothing."""
from __future__ import annotations

import ast
import re
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PACKAGE = REPO / "ds_patrickstar"
LAYERS = ["chunks", "memory", "disk", "store", "placement", "activations", "groups", "optim", "io", "integration"]
LEAVES = {"counters", "autograd_state", "run_state"}  # importable from every layer
ENTRY_POINTS = {"__init__", "__main__", "plan", "zero_to_fp32"}  # the package root and the command lines: any layer
MAX_MODULE_LINES = 400
MAX_CLASS_LINES = 250


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


def test_every_sub_package_is_packaged():
    """setup.cfg lists packages by hand: a sub-package it misses is missing from every wheel."""
    import configparser

    config = configparser.ConfigParser()
    config.read(REPO / "setup.cfg")
    listed = set(config["options"]["packages"].split())
    on_disk = {_module_name(p.parent) for p in PACKAGE.rglob("__init__.py")}
    assert on_disk <= listed, sorted(on_disk - listed)


def test_no_module_over_the_size_limit():
    sizes = {str(p.relative_to(PACKAGE)): len(p.read_text().splitlines()) for p in _modules()}
    assert max(sizes.values()) <= MAX_MODULE_LINES, {k: v for k, v in sizes.items() if v > MAX_MODULE_LINES}


def test_no_class_over_the_size_limit():
    sizes = {
        f"{p.relative_to(PACKAGE)}:{node.name}": node.end_lineno - node.lineno + 1
        for p in _modules()
        for node in ast.walk(ast.parse(p.read_text()))
        if isinstance(node, ast.ClassDef)
    }
    assert max(sizes.values()) <= MAX_CLASS_LINES, {k: v for k, v in sizes.items() if v > MAX_CLASS_LINES}


def test_no_buffer_is_handed_to_record_stream():
    """Collective buffers are held until the collective is waited on and freed after (see [Note: collective
    buffers]); a ``record_stream`` block stays reserved after the ledger released it."""
    assert [str(p.relative_to(PACKAGE)) for p in _modules() if "record_stream" in p.read_text()] == []


# ---- Notes ------------------------------------------------------------------------------------
NOTE_HEADER = re.compile(r'^\s*(?:#\s*)?(?:r?""")?\[Note: ([^\]]+)\]\s*$', re.MULTILINE)
NOTE_CITED = re.compile(r"\[Note:\s+([^\]]+?)\]")
NOTE_IN_FILE = re.compile(r"\[Note:\s+([^\]]+?)\]\s+in\s+(?:``)?([\w/.]+\.py)")


def _sources() -> dict[Path, str]:
    """The package's modules and the autoload module, comment markers of wrapped lines removed."""
    paths = [*_modules(), REPO / "ds_patrickstar_autoload.py"]
    return {p: re.sub(r"\n\s*#", "\n", p.read_text()) for p in paths}


def _note_name(text: str) -> str:
    return " ".join(text.split())


def note_headers(sources: dict[Path, str]) -> dict[str, list[Path]]:
    """Note name -> the modules with a line ``[Note: name]`` of its own (a Note's header)."""
    headers: dict[str, list[Path]] = {}
    for path, text in sources.items():
        for match in NOTE_HEADER.finditer(text):
            headers.setdefault(match.group(1), []).append(path)
    return headers


def test_every_cited_note_is_defined_once():
    sources = _sources()
    headers = note_headers(sources)
    cited = Counter(_note_name(m.group(1)) for text in sources.values() for m in NOTE_CITED.finditer(text))
    wrong = {name: [str(p.relative_to(REPO)) for p in headers.get(name, [])] for name in cited}
    assert {name: found for name, found in wrong.items() if len(found) != 1} == {}


def test_a_note_cited_in_a_module_is_defined_there():
    sources = _sources()
    headers = note_headers(sources)
    wrong = []
    for path, text in sources.items():
        for match in NOTE_IN_FILE.finditer(text):
            name, module = _note_name(match.group(1)), match.group(2)
            if not any(str(p).endswith("/" + module) for p in headers.get(name, [])):
                wrong.append(f"{path.relative_to(REPO)}: [Note: {name}] in {module}")
    assert not wrong, wrong


# ---- import circles -----------------------------------------------------------------------------
def _module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts) if path.suffix else list(path.relative_to(REPO).parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _resolve(name: str, known: set[str]) -> str | None:
    """The module ``name`` means: itself, else its package (``from pkg import name`` of a non-module)."""
    while name and name not in known:
        name = name.rpartition(".")[0]
    return name or None


def import_graph() -> dict[str, set[str]]:
    """Module -> the project modules it imports, at any depth of the file (function-level and
    ``TYPE_CHECKING`` imports included: a circle through them is still a circle of the design).
    Importing ``a.b`` also runs ``a/__init__``; that implicit edge is not counted."""
    files = {_module_name(p): p for p in [*_modules(), REPO / "ds_patrickstar_autoload.py"]}
    known = set(files)
    graph: dict[str, set[str]] = {}
    for name, path in files.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        targets = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                    module = ".".join(base + ([node.module] if node.module else []))
                else:
                    module = node.module or ""
                targets.update(f"{module}.{alias.name}" for alias in node.names)
        graph[name] = {t for t in (_resolve(t, known) for t in targets) if t is not None and t != name}
    return graph


def find_circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    circles: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for target in sorted(graph.get(node, ())):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return circles


def test_the_circle_finder_finds_a_circle():
    assert find_circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert find_circles({"a": {"b"}, "b": set()}) == []


def test_the_import_graph_sees_the_imports_it_must():
    graph = import_graph()
    assert "ds_patrickstar.memory.pending" in graph["ds_patrickstar.memory.host_pool"]
    assert "ds_patrickstar_autoload" in graph["ds_patrickstar.integration.hf_eval"]


def test_no_import_circles():
    assert find_circles(import_graph()) == []
