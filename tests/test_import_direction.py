"""Imports go one way: every module of the octavo package imports only from the layers below it.

Each module's source is parsed (ast) and every import is collected, including
imports inside functions and under `if TYPE_CHECKING:`; relative imports are
resolved against the module's package. The layers and what each may import
are the table below (docs/architecture.md, "Layers"). A module of no listed
layer fails the test, so a new top-level module has to be classified here.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import octavo

PACKAGE_DIR = Path(octavo.__file__).resolve().parent

# Top-level modules with no octavo imports but each other: anyone may import them. The package's version
# string is one too: `from octavo import __version__` reads a constant of the package root, which Python
# has imported before any of its modules anyway.
LEAVES = {"octavo.config", "octavo.errors", "octavo.cache_dir", "octavo.version", "octavo.__version__"}
# Modules that tie the layers together (anything but serve, commands and cli, unless they are one themselves).
TIES = {"octavo", "octavo.compiler", "octavo.compile_cache", "octavo.llm", "octavo.bench", "octavo.eval",
        "octavo.parallel", "octavo.commands", "octavo.cli"}
# layer -> the layers its modules may import (besides their own layer and the leaves).
ALLOWED = {
    "octavo.ir": set(),
    "octavo.frontend": {"octavo.ir"},
    "octavo.passes": {"octavo.ir"},
    "octavo.codegen": {"octavo.ir"},
    "octavo.runtime": {"octavo.ir", "octavo.codegen"},
    "octavo.serve": {"octavo.ir", "octavo.codegen", "octavo.runtime"},
}
# Modules that a layer allowed above still may not import: the runtime reads artifacts through
# octavo.ir.artifact_format, never through the codegen writer.
FORBIDDEN = {"octavo.runtime": {"octavo.codegen.artifact"}, "octavo.serve": {"octavo.codegen.artifact"}}
# Only these may import the user-facing layers (cli, commands, serve); the layers themselves may import within.
TOP = {"octavo.cli", "octavo.commands", "octavo.serve"}
TOP_IMPORTERS = {"octavo.cli", "octavo.commands"}


def module_name(path: Path) -> str:
    parts = ["octavo", *path.relative_to(PACKAGE_DIR).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(path: Path, name: str) -> list[tuple[int, str]]:
    """(line, module) of every octavo import in the file, `from a import b` giving `a.b` when b is a module."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            found += [(node.lineno, _submodule_or_base(base, alias.name)) for alias in node.names]
    octavo_imports = {(line, module) for line, module in found if module == "octavo" or module.startswith("octavo.")}
    return sorted(octavo_imports)


def _submodule_or_base(base: str, name: str) -> str:
    candidate = f"{base}.{name}"
    if candidate in LEAVES:
        return candidate
    relative = Path(*candidate.split(".")[1:]) if candidate.startswith("octavo.") else None
    if relative is not None and ((PACKAGE_DIR / relative).with_suffix(".py").is_file()
                                 or (PACKAGE_DIR / relative / "__init__.py").is_file()):
        return candidate
    return base


def owner(module: str, groups) -> str | None:
    """The entry of `groups` that `module` is or lies under (the longest one)."""
    matches = [group for group in groups if module == group or module.startswith(group + ".")]
    return max(matches, key=len, default=None)


def layer_of(module: str) -> str | None:
    if module in LEAVES:
        return "leaf"
    tie = owner(module, TIES - {"octavo"})
    if tie is not None or module == "octavo":
        return "tie"
    return owner(module, ALLOWED)


def violation(importer: str, imported: str) -> str | None:
    """Why `importer` may not import `imported`, or None when it may."""
    layer, target_layer = layer_of(importer), layer_of(imported)
    if target_layer is None:
        return f"{imported} belongs to no layer of the table"
    top = owner(imported, TOP)
    if top is not None and owner(importer, TOP_IMPORTERS) is None and owner(importer, {top}) is None:
        return f"only cli and commands may import {top}"
    if target_layer == "leaf" or layer == "tie":
        return None
    if layer == "leaf":
        return "a leaf module may import only other leaves"
    if target_layer == "tie":
        return f"{imported} ties layers together and sits above {layer}"
    if target_layer != layer and target_layer not in ALLOWED[layer]:
        return f"{layer} may import only {', '.join(sorted(ALLOWED[layer])) or 'itself'} (and the leaves)"
    if owner(imported, FORBIDDEN.get(layer, set())) is not None:
        return f"{layer} may not import {imported}"
    return None


def all_modules() -> list[tuple[str, Path]]:
    return sorted((module_name(path), path) for path in PACKAGE_DIR.rglob("*.py"))


def test_every_module_belongs_to_a_layer():
    unclassified = [name for name, _ in all_modules() if layer_of(name) is None]
    assert not unclassified, f"modules outside the layer table: {unclassified}"


def test_every_import_goes_downward():
    problems = []
    for name, path in all_modules():
        for line, imported in imported_modules(path, name):
            reason = violation(name, imported)
            if reason is not None:
                problems.append(f"{name} (line {line}) imports {imported}: {reason}")
    assert not problems, "imports against the layer order:\n" + "\n".join(problems)


# Cycles left inside the pass layer: a pass module registers itself in passes.registry, which imports
# every pass module (all_passes) when a pipeline is first looked up; quantization schemes and their passes
# name each other the same way. Cycles anywhere else fail the test.
CYCLES_ALLOWED_WITHIN = "octavo.passes"


def import_graph():
    """Module -> the octavo modules it imports (an import of a name inside a module counts as the module)."""
    import networkx

    modules = dict(all_modules())
    graph = networkx.DiGraph()
    for name, path in modules.items():
        graph.add_node(name)
        for _, imported in imported_modules(path, name):
            while imported not in modules and "." in imported:
                imported = imported.rpartition(".")[0]
            if imported in modules and imported != name:
                graph.add_edge(name, imported)
    return graph


def test_no_import_cycles():
    import networkx

    cycles = [sorted(component) for component in networkx.strongly_connected_components(import_graph())
              if len(component) > 1
              and not all(owner(module, {CYCLES_ALLOWED_WITHIN}) for module in component)]
    assert not cycles, "modules that import each other (directly or around a circle):\n" + "\n".join(
        ", ".join(cycle) for cycle in cycles)


@pytest.mark.parametrize(("importer", "imported", "expected"), [
    ("octavo.passes.match_attention", "octavo.frontend.architectures", "octavo.passes may import only octavo.ir"),
    ("octavo.ir.graph", "octavo.passes.context", "octavo.ir may import only itself"),
    ("octavo.runtime.loader", "octavo.codegen.artifact", "may not import octavo.codegen.artifact"),
    ("octavo.runtime.engine", "octavo.llm", "ties layers together"),
    ("octavo.config", "octavo.ir.graph", "a leaf module may import only other leaves"),
    ("octavo.codegen.lowering", "octavo.runtime.engine", "octavo.codegen may import only octavo.ir"),
])
def test_the_rule_rejects_imports_against_the_order(importer, imported, expected):
    assert expected in violation(importer, imported)


@pytest.mark.parametrize(("importer", "imported"), [
    ("octavo.passes.fuse_rope", "octavo.ir.graph_inputs"),
    ("octavo.runtime.loader", "octavo.ir.artifact_format"),
    ("octavo.runtime.executor", "octavo.codegen.lowering"),
    ("octavo.serve.app", "octavo.runtime.engine"),
    ("octavo.commands.compile_command", "octavo.compiler"),
    ("octavo.cli", "octavo.serve.app"),
    ("octavo.passes.context", "octavo.config"),
    ("octavo.frontend.trace", "octavo.errors"),
])
def test_the_rule_accepts_downward_imports(importer, imported):
    assert violation(importer, imported) is None


def test_imports_inside_functions_and_relative_imports_are_seen(tmp_path, monkeypatch):
    package = tmp_path / "octavo"
    (package / "passes").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "passes" / "__init__.py").write_text("")
    (package / "passes" / "helper.py").write_text("")
    source = package / "passes" / "example.py"
    source.write_text("import torch\n"
                      "from . import helper\n"
                      "def late():\n"
                      "    from octavo.frontend.trace import TOKEN_INPUTS\n"
                      "    from ..runtime import engine\n")
    monkeypatch.setitem(globals(), "PACKAGE_DIR", package)
    assert imported_modules(source, "octavo.passes.example") == [
        (2, "octavo.passes.helper"), (4, "octavo.frontend.trace"), (5, "octavo.runtime")]
