"""Each package imports at run time only the workspace packages it declares as dependencies.

`pip install gla-fused` must give a working `fused_chunk_simple_gla` with nothing else installed
by hand: a `gla_*` import in a package's source that its pyproject.toml does not declare (directly
or through a dependency) would fail on such an install. `nox -s tests-<package>` installs exactly
these dependencies plus gla-ref and runs the package's tests, public functions included.
"""

from __future__ import annotations

import ast
import pathlib
import re
import tomllib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGES = ("gla-core", "gla-ref", "gla-simple", "gla-fused", "gla-kda")


def _names(requirements) -> set[str]:
    return {re.split(r"[=<>!~ \[;]", requirement, maxsplit=1)[0] for requirement in requirements} & set(PACKAGES)


def _project(package: str) -> dict:
    return tomllib.loads((ROOT / "packages" / package / "pyproject.toml").read_text())["project"]


def _declared(package: str) -> set[str]:
    return _names(_project(package)["dependencies"])


def _optional(package: str) -> set[str]:
    extras = _project(package).get("optional-dependencies", {})
    return set().union(*(_names(requirements) for name, requirements in extras.items() if name != "test"))


def _runtime_closure(package: str) -> set[str]:
    needed, pending = set(), [package]
    while pending:
        name = pending.pop()
        if name not in needed:
            needed.add(name)
            pending.extend(_declared(name))
    return needed


def _imported_packages(package: str, *, module_level: bool) -> dict[str, str]:
    """Workspace packages imported by the source of `package` at module level (or inside
    functions): {distribution: first file importing it}."""
    modules = {name.replace("-", "_"): name for name in PACKAGES}
    found: dict[str, str] = {}
    for path in sorted((ROOT / "packages" / package / "src").rglob("*.py")):
        tree = ast.parse(path.read_text())
        functions = [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)]
        lazy = {id(n) for f in functions for n in ast.walk(f)}
        for node in ast.walk(tree):
            if (id(node) in lazy) == module_level:
                continue
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            for name in names:
                top = name.split(".")[0]
                if top in modules:
                    found.setdefault(modules[top], str(path.relative_to(ROOT)))
    return found


@pytest.mark.parametrize("package", PACKAGES)
def test_source_imports_only_declared_runtime_dependencies(package):
    allowed = _runtime_closure(package)
    eager = _imported_packages(package, module_level=True)
    undeclared = {name: where for name, where in eager.items() if name not in allowed}
    assert not undeclared, f"{package} imports {undeclared} but declares only {sorted(allowed)}"
    lazy = _imported_packages(package, module_level=False)  # inside functions: an optional extra will do
    undeclared = {name: where for name, where in lazy.items() if name not in allowed | _optional(package)}
    assert not undeclared, f"{package} imports {undeclared} in functions, declared in no dependency or extra"


# The gla-core modules a sibling package's source may import: the public API, the errors and the plugin kit.
GLA_CORE_SURFACE = {"gla_core", "gla_core.errors", "gla_core.kit"}


def _gla_core_modules_imported(path: pathlib.Path) -> set[str]:
    """The gla_core modules `path` imports, `from gla_core import name` counted as `gla_core.name`
    when `name` is a module of gla_core."""
    package_dir = ROOT / "packages" / "gla-core" / "src" / "gla_core"
    submodules = {p.stem for p in package_dir.glob("*.py")} | {p.name for p in package_dir.iterdir() if p.is_dir()}
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.split(".")[0] == "gla_core")
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] == "gla_core":
            found.add(node.module)
            if node.module == "gla_core":
                found.update(f"gla_core.{a.name}" for a in node.names if a.name in submodules - {"__init__"})
    return found


@pytest.mark.parametrize("package", [p for p in PACKAGES if p != "gla-core"])
def test_siblings_build_on_gla_core_through_its_public_surface(package):
    """Plugins import gla_core, gla_core.errors and gla_core.kit only: the modules behind the kit may move."""
    outside = {}
    for path in sorted((ROOT / "packages" / package / "src").rglob("*.py")):
        for module in _gla_core_modules_imported(path) - GLA_CORE_SURFACE:
            outside.setdefault(module, str(path.relative_to(ROOT)))
    assert not outside, f"{package} imports gla_core internals (use gla_core.kit): {outside}"


def test_nox_installs_runtime_dependencies_plus_the_oracle():
    path = ROOT / "noxfile.py"
    noxfile = {"__file__": str(path), "__name__": "noxfile"}
    exec(compile(path.read_text(), str(path), "exec"), noxfile)
    for package in PACKAGES:
        assert set(noxfile["TEST_DEPENDENCIES"][package]) == _runtime_closure(package) | {"gla-ref"}, package


def test_fla_named_functions_fall_back_only_to_installed_packages():
    """The implementations an FLA-named function may pick come from its package's runtime closure."""
    import gla_core
    from gla_fused import functions as fused_functions
    from gla_kda import api as kda_functions
    from gla_simple import functions as simple_functions

    families = {
        ("gla-fused", "simple_gla"): fused_functions.FAMILY,
        ("gla-simple", "simple_gla"): simple_functions.CHUNK_FAMILY,
        ("gla-kda", "kda"): kda_functions.CHUNK_FAMILY,
    }
    for (package, op), family in families.items():
        providers = {impl.name: impl.package for impl in gla_core.implementations(op)}
        needed = {providers[name] for name in family}
        assert needed <= _runtime_closure(package), f"{package}: {family} come from {needed}"
