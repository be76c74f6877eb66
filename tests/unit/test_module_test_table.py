"""docs/testing.md's module -> tests table stays true: every product module under cluster/,
workers/, kvstore/ and kernels/ has a row, every row names a module that exists, and every test
module it names exists in the folder its column says (unit/, else integration/ or gpu/)."""
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("cluster", "workers", "kvstore", "kernels")
ROW = re.compile(r"^\| `((?:cluster|workers|kvstore|kernels)/[\w/]+\.py)` \|(.*)\|(.*)\|$")


def table() -> dict[str, tuple[list[str], list[str]]]:
    rows = {}
    for line in (ROOT / "docs" / "testing.md").read_text().splitlines():
        if match := ROW.match(line):
            module, unit, other = match.groups()
            rows[module] = (re.findall(r"`([\w/]+)`", unit), re.findall(r"`([\w/]+)`", other))
    return rows


def product_modules() -> set[str]:
    """Every module with code of its own; a package's __init__ only where it holds more than
    re-exports (kernels/ picks the ops there, cluster/cli/ builds the parser there)."""
    found = {str(p.relative_to(ROOT)) for top in PACKAGES for p in (ROOT / top).rglob("*.py")}
    return {m for m in found if not m.endswith(("/__init__.py", "/__main__.py"))} | \
        {"kernels/__init__.py", "cluster/cli/__init__.py"}


def test_every_product_module_has_a_row_and_every_row_a_module():
    rows = table()
    assert sorted(product_modules() - rows.keys()) == [], "add these modules to docs/testing.md's table"
    assert sorted(rows.keys() - product_modules()) == [], "these rows name modules that are gone"


def test_every_test_module_named_exists_in_its_column_s_folder():
    missing = []
    for module, (unit, other) in table().items():
        paths = [f"tests/unit/{t}.py" for t in unit]
        paths += [f"tests/{t}.py" if "/" in t else f"tests/integration/{t}.py" for t in other]
        missing += [f"{module}: {p}" for p in paths if not (ROOT / p).is_file()]
    assert missing == []


def test_every_row_names_at_least_one_test_module():
    assert [m for m, (unit, other) in table().items() if not unit and not other] == []
