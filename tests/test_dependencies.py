"""Every third-party package that Octavo's code imports is declared in pyproject.toml.

A package that only arrives as a dependency of another one (psutil through accelerate, say) can
vanish when that other package changes its own requirements, and a fresh install then breaks at
import time. The check reads the imports from the source with `ast` (including imports inside
functions), maps each module to the distribution that provides it in this environment, and compares
with the requirements written in pyproject.toml.
"""

from __future__ import annotations

import ast
import importlib.metadata
import re
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# The library may use the core dependencies, plus triton and ray behind their availability checks (imported
# only where a GPU backend or the Ray executor is asked for).
LIBRARY_EXTRAS = ("triton", "ray")
# Tests, benchmarks and scripts may also use the dev extra.
TOOLING_EXTRAS = ("triton", "dev")


def imported_modules(directory: Path) -> dict[str, set[str]]:
    """Top-level names of the absolute imports in every .py file under `directory` -> files importing them."""
    found: dict[str, set[str]] = {}
    for path in sorted(directory.rglob("*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            for name in names:
                found.setdefault(name.split(".")[0], set()).add(str(path.relative_to(ROOT)))
    return found


def third_party(modules: dict[str, set[str]]) -> dict[str, set[str]]:
    local = {"octavo", "tests", "__future__"} | {path.stem for path in ROOT.rglob("*.py")}
    return {name: files for name, files in modules.items()
            if name not in sys.stdlib_module_names and name not in local}


def requirement_name(requirement: str) -> str:
    """The normalized distribution name of a PEP 508 requirement string."""
    name = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", requirement).group(1)
    return re.sub(r"[-_.]+", "-", name).lower()


def declared(extras: tuple[str, ...]) -> set[str]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    requirements = list(project["dependencies"])
    for extra in extras:
        requirements += project["optional-dependencies"][extra]
    return {requirement_name(requirement) for requirement in requirements}


def undeclared(directories: list[str], extras: tuple[str, ...]) -> list[str]:
    distributions = importlib.metadata.packages_distributions()
    allowed = declared(extras)
    problems = []
    for directory in directories:
        for module, files in sorted(third_party(imported_modules(ROOT / directory)).items()):
            providers = {requirement_name(name) for name in distributions.get(module, [])}
            if not providers:
                problems.append(f"{module} (imported by {sorted(files)[0]}) is not installed")
            elif not providers & allowed:
                problems.append(f"{module} (imported by {sorted(files)[0]}) comes from {sorted(providers)}, "
                                "which pyproject.toml does not declare")
    return problems


def test_requirement_name_normalizes_like_pip():
    assert requirement_name("Prometheus_Client>=0.20") == "prometheus-client"
    assert requirement_name("huggingface-hub>=0.20; python_version>'3'") == "huggingface-hub"


def test_finds_imports_inside_functions(tmp_path):
    assert "psutil" in third_party(imported_modules(ROOT / "octavo"))
    assert "onnx" in third_party(imported_modules(ROOT / "octavo"))


def test_library_imports_only_declared_packages():
    assert undeclared(["octavo"], LIBRARY_EXTRAS) == []


@pytest.mark.parametrize("directory", ["tests", "benchmarks", "examples", "scripts"])
def test_tooling_imports_only_declared_packages(directory):
    if not (ROOT / directory).is_dir():
        pytest.fail(f"{directory}/ is missing from the repository")
    assert undeclared([directory], TOOLING_EXTRAS) == []
