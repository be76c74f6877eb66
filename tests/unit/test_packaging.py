"""What pyproject.toml installs: one top-level name, `kvmesh`, holding every package folder of the
four parts, and no import anywhere in the project of the bare folder names (`kernels` is Hugging
Face's package; `cluster`, `workers` and `kvstore` would be anyone's). The install itself, in a fresh
venv beside the newest transformers and HF's `kernels`, is tests/integration/test_clean_install.py."""
import ast
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PARTS = ("cluster", "workers", "kernels", "kvstore")
PROJECT_DIRS = PARTS + ("kvmesh", "tests", "bench", "scripts")


def setuptools_config() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]


def test_every_package_folder_installs_under_kvmesh():
    config = setuptools_config()
    assert config["package-dir"] == {"kvmesh": "kvmesh", **{f"kvmesh.{p}": p for p in PARTS}}
    folders = {"kvmesh"} | {"kvmesh." + ".".join(init.parent.relative_to(ROOT).parts)
                            for part in PARTS for init in (ROOT / part).rglob("__init__.py")}
    assert sorted(config["packages"]) == sorted(folders)
    assert {name.split(".")[0] for name in config["packages"]} == {"kvmesh"}


def test_the_console_script_and_the_default_model_are_kvmeshs():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert project["project"]["scripts"] == {"kvmesh": "kvmesh.cluster.cli:main"}
    assert list(setuptools_config()["package-data"]) == ["kvmesh.workers.checkpoint"]


def test_nothing_imports_a_part_by_its_bare_folder_name():
    bare = []
    for top in PROJECT_DIRS:
        for path in (ROOT / top).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                    [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else []
                bare += [f"{path.relative_to(ROOT)}:{node.lineno} {n}" for n in names if n.split(".")[0] in PARTS]
    assert bare == []
