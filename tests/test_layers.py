"""The packages' dependencies point down (docs: the layers of ARCHITECTURE): the trainer builds whatever
checkpoint tier is configured through the Checkpointer's hooks and names none; the launch modes under
ddlscale.cluster take a tier's services as a callable and import nothing above them."""

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
