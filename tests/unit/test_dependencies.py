"""Every third-party package src/kvtier imports is declared in pyproject.toml.

An import that runs when its module is imported (at module level, outside `TYPE_CHECKING`) in
the core package needs a `[project] dependencies` entry; the engine adapters under
`integrations/` and imports inside functions may also come from an optional extra, or from the
engine that loads the adapter (SGLang loads `integrations/sglang.py` itself).
"""

from __future__ import annotations

import ast
import importlib.metadata
import re
import sys
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PACKAGE = REPO / "src" / "kvtier"
#: packages of the engine that imports the adapter; never kvtier's to install
HOST_ENGINES = {"sglang"}


def _dist_name(requirement: str) -> str:
    return re.sub(r"[-_.]+", "-", re.split(r"[\s<>=!~;\[]", requirement, maxsplit=1)[0]).lower()


def _deferred(node: ast.AST) -> bool:
    """Code that does not run when its module is imported: a body of a function, or of an
    `if TYPE_CHECKING:`."""
    if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
        return True
    return isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)


def _imports(path: Path) -> list[tuple[str, bool]]:
    """(top-level module, imported when the module is) of every absolute import in `path`."""
    tree = ast.parse(path.read_text(), str(path))
    found: list[tuple[str, bool]] = []

    def visit(node: ast.AST, eager: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.Import):
                found.extend((a.name.split(".")[0], eager) for a in child.names)
            elif isinstance(child, ast.ImportFrom) and child.level == 0 and child.module:
                found.append((child.module.split(".")[0], eager))
            else:
                visit(child, eager and not _deferred(child))

    visit(tree, True)
    return found


def test_every_third_party_import_is_declared() -> None:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    required = {_dist_name(r) for r in project["dependencies"]}
    extras = {_dist_name(r) for reqs in project["optional-dependencies"].values() for r in reqs}
    dists = importlib.metadata.packages_distributions()
    missing = []
    for path in sorted(PACKAGE.rglob("*.py")):
        adapter = "integrations" in path.relative_to(PACKAGE).parts
        for module, eager in _imports(path):
            if module in sys.stdlib_module_names or module == "kvtier" or module in HOST_ENGINES:
                continue
            names = {_dist_name(d) for d in dists.get(module, [module])}
            allowed = required if eager and not adapter else required | extras
            if not names & allowed:
                missing.append(f"{path.relative_to(REPO)}: {module} ({', '.join(sorted(names))})")
    assert not missing, "imported but not declared in pyproject.toml:\n" + "\n".join(missing)
