"""The packages' dependencies point down, in the order docs/developing.md's Layout lists them (every
module checked against it); and within that order, the trainer builds whatever checkpoint tier is
configured through the Checkpointer's hooks and names none."""

import ast
import re
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "ddlscale"


def _imports(path: Path) -> set[str]:
    """Every module ``path`` imports (``from a.b import c`` counts as a.b and a.b.c), at any depth."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def _importing(package: str, forbidden: str) -> dict[str, list[str]]:
    found = {}
    for path in sorted((PACKAGE / package).rglob("*.py")):
        bad = sorted(n for n in _imports(path) if n == forbidden or n.startswith(forbidden + "."))
        if bad:
            found[str(path.relative_to(PACKAGE))] = bad
    return found


def test_the_trainer_imports_nothing_of_gemini():
    assert _importing("trainer", "ddlscale.ckpt.gemini") == {}


def test_the_app_names_no_tier_and_no_tier_infrastructure():
    source = (PACKAGE / "trainer" / "app.py").read_text()
    assert not re.findall(r"gemini|etcd|replica|GeminiCheckpointer|DiskCheckpointer", source, re.IGNORECASE)


def test_the_cluster_imports_nothing_above_it():
    for above in ("ddlscale.ckpt", "ddlscale.trainer", "ddlscale.strategy", "ddlscale.testing"):
        assert _importing("cluster", above) == {}, above


DEVELOPING = PACKAGE.parent / "docs" / "developing.md"


def _documented_layers() -> list[str]:
    """The packages and modules of docs/developing.md's Layout, from the top of the stack down."""
    text = DEVELOPING.read_text()
    block = text[text.index("## Layout"):].split("```")[1]
    return [line.split()[0] for line in block.splitlines() if line.startswith("ddlscale")]


def _layer_of(module: str, layers: list[str]) -> int | None:
    """The index of the documented layer ``module`` belongs to: the longest listed prefix."""
    owners = [i for i, layer in enumerate(layers) if module == layer or module.startswith(layer + ".")]
    return max(owners, key=lambda i: len(layers[i])) if owners else None


def test_every_module_imports_only_the_layers_documented_below_it():
    layers = _documented_layers()
    assert layers[0] == "ddlscale.tools" and "ddlscale.schema" in layers  # the block was found and read
    upward, unplaced = [], []
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        module = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        own = _layer_of(module, layers)
        if own is None:
            unplaced.append(module)
            continue
        for name in _imports(path):
            if not name.startswith("ddlscale."):
                continue
            target = _layer_of(name, layers)
            if target is not None and target < own:
                upward.append(f"{module} imports {name} ({layers[own]} is below {layers[target]})")
    assert upward == []
    # Only the entry points sit outside the documented layers.
    assert set(unplaced) <= {"ddlscale", "ddlscale.__main__", "ddlscale.paths", "ddlscale.conf"}, unplaced


# Python fixes these two names: a package's own module, and what ``python -m package`` runs.
SHARED_BASENAMES = {"__init__.py", "__main__.py"}


def test_no_two_modules_share_a_basename():
    """A module's file name says what it holds, once: no two modules of the package share one (a
    search for ``store.py`` or a traceback's ``config.py`` names one file)."""
    by_name: dict[str, list[str]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.name not in SHARED_BASENAMES:
            by_name.setdefault(path.name, []).append(str(path.relative_to(PACKAGE.parent)))
    assert {name: paths for name, paths in by_name.items() if len(paths) > 1} == {}
