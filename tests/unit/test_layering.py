"""The import graph of the product packages: no module imports itself back through others
(function-level and TYPE_CHECKING imports count), no subpackage of cluster/, kvstore/ or workers/
imports itself back through another, nothing below workers/engine imports it, and the ingress
loads no torch, numba or xgrammar."""
import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("cluster", "workers", "kernels", "kvstore")
BELOW_ENGINE = tuple(f"kvmesh.workers.{p}" for p in ("model", "checkpoint", "sampling", "spec", "reuse", "parallel",
                                                      "request", "engine_config"))


def modules(root: Path = ROOT) -> dict[str, Path]:
    out = {}
    for top in PACKAGES:
        for path in sorted((root / top).rglob("*.py")):
            name = ".".join(("kvmesh",) + path.relative_to(root).with_suffix("").parts)
            out[name.removesuffix(".__init__")] = path
    return out


def imported(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """Every known module `name` imports anywhere in its file (a package's own parent and
    children excluded: importing a submodule runs its package's __init__, not a ring)."""
    is_pkg = path.name == "__init__.py"
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = name.split(".")
                keep = len(parts) - node.level + int(is_pkg)
                base = ".".join(parts[:keep] + ([base] if base else []))
            names = [base] + [f"{base}.{a.name}" for a in node.names]
        else:
            continue
        found |= {n for n in names if n in known}
    return {n for n in found if n != name and not name.startswith(n + ".") and not n.startswith(name + ".")}


def import_graph(root: Path = ROOT) -> dict[str, set[str]]:
    known = modules(root)
    return {name: imported(name, path, known) for name, path in known.items()}


def package_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """The module graph folded onto subpackages: `kvmesh.cluster.serve.pools` counts as `kvmesh.cluster.serve`;
    a module directly in a top package (`kvmesh.cluster.app`) stays itself."""
    def unit(name: str) -> str:
        parts = name.split(".")
        return ".".join(parts[:3]) if len(parts) > 3 or name in subpackages else name
    subpackages = {n for n in graph if len(n.split(".")) == 3 and n.split(".")[1] in PACKAGES
                   and any(m.startswith(n + ".") for m in graph)}
    out: dict[str, set[str]] = {}
    for name, targets in graph.items():
        out.setdefault(unit(name), set()).update(unit(t) for t in targets)
    return {u: targets - {u} for u, targets in out.items()}


def rings(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan, iterative)."""
    index, low, stack, on_stack, out, counter = {}, {}, [], set(), [], [0]
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter[0]
        counter[0] += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = counter[0]
                    counter[0] += 1
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    out.append(sorted(comp))
    return out


@pytest.fixture(scope="module")
def graph():
    return import_graph()


def test_no_module_imports_itself_back_through_others(graph):
    assert rings(graph) == []


def test_no_subpackage_imports_itself_back_through_another(graph):
    assert rings(package_graph(graph)) == []


def test_nothing_below_the_engine_imports_it(graph):
    bad = sorted((m, t) for m, targets in graph.items() for t in targets
                 if m.startswith(BELOW_ENGINE) and (t == "kvmesh.workers.engine" or t.startswith("kvmesh.workers.engine.")))
    assert bad == []


def test_workers_keeps_at_most_twelve_modules_at_its_top():
    top = [p.name for p in (ROOT / "workers").glob("*.py")]
    assert len(top) <= 12, top


@pytest.mark.parametrize("package", ["cluster", "kvstore"])
def test_a_package_is_cut_into_subpackages(package):
    """At most 8 modules directly in it (its __init__ included), at least 3 subpackages."""
    top = [p.name for p in (ROOT / package).glob("*.py")]
    subpackages = [p.parent.name for p in (ROOT / package).glob("*/__init__.py")]
    assert len(top) <= 8 and len(subpackages) >= 3, (top, subpackages)


@pytest.mark.parametrize("package", ["cluster", "cluster/openai", "cluster/chat", "cluster/serve", "cluster/cli",
                                     "kvstore", "kvstore/device", "kvstore/store", "kvstore/index",
                                     "kvstore/transfer", "kvstore/policy", "workers/engine"])
def test_a_package_file_map_names_each_of_its_modules_and_subpackages(package):
    """The docstring of these packages' __init__ is their file map: a reader finds every file there."""
    root = ROOT / package
    doc = ast.get_docstring(ast.parse((root / "__init__.py").read_text())) or ""
    parts = [p.name for p in root.glob("*.py") if p.name not in ("__init__.py", "__main__.py")]
    parts += [p.name + "/" for p in root.iterdir() if (p / "__init__.py").exists()]
    missing = [name for name in parts if name not in doc]
    assert not missing, f"{package}/__init__.py's file map does not name {missing}"


def tree(root: Path, files: dict[str, str]) -> dict[str, set[str]]:
    """The four packages under `root`, then `files` ({path: source}; their folders become
    packages), and the import graph of it all."""
    for path in list(PACKAGES) + [str(Path(f).parent) for f in files]:
        (root / path).mkdir(parents=True, exist_ok=True)
        (root / path / "__init__.py").touch()
    for path, source in files.items():
        (root / path).write_text(source)
    return import_graph(root)


def test_the_checker_finds_a_ring_between_subpackages(tmp_path):
    """The checker itself: openai -> chat and chat -> openai through two different modules is no
    module ring, but it is a subpackage ring."""
    g = tree(tmp_path, {"cluster/openai/ingress.py": "from kvmesh.cluster.chat.template import render\n",
                        "cluster/chat/template.py": "def render():\n    from ..openai import protocol\n",
                        "cluster/openai/protocol.py": ""})
    assert rings(g) == []
    assert rings(package_graph(g)) == [["kvmesh.cluster.chat", "kvmesh.cluster.openai"]]


def test_the_checker_finds_a_ring_between_kvstore_subpackages(tmp_path):
    """The checker itself, on kvstore's cut: store -> index is allowed, and an index module that
    reaches back into the store (a relative import inside a function) closes a subpackage ring."""
    g = tree(tmp_path, {"kvstore/store/object_store.py": "from kvmesh.kvstore.index.embedded import X\n",
                        "kvstore/index/embedded.py": "X = 1\n",
                        "kvstore/index/redis_index.py": "def f():\n    from ..store import objects\n",
                        "kvstore/store/objects.py": ""})
    assert rings(g) == []
    assert rings(package_graph(g)) == [["kvmesh.kvstore.index", "kvmesh.kvstore.store"]]


def test_the_checker_finds_a_ring_through_a_function_level_import(tmp_path):
    """The checker itself: a ring closed only inside a function, and an engine import hidden
    under TYPE_CHECKING, are both found."""
    pkg = tmp_path / "workers"
    (pkg / "engine").mkdir(parents=True)
    (pkg / "model").mkdir()
    for d in (pkg, pkg / "engine", pkg / "model"):
        (d / "__init__.py").write_text("")
    (pkg / "engine" / "loop.py").write_text("from kvmesh.workers.model.net import Net\n")
    (pkg / "model" / "net.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from kvmesh.workers.engine import loop\n"
        "def f():\n    from ..engine.loop import x\n")
    for top in PACKAGES[:1] + PACKAGES[2:]:
        (tmp_path / top).mkdir()
    g = import_graph(tmp_path)
    assert rings(g) == [["kvmesh.workers.engine.loop", "kvmesh.workers.model.net"]]
    assert "kvmesh.workers.engine" in g["kvmesh.workers.model.net"] and "kvmesh.workers.engine.loop" in g["kvmesh.workers.model.net"]


@pytest.mark.slow       # a subprocess importing Ray Serve and FastAPI
def test_the_ingress_loads_no_torch_and_no_numba():
    """The ingress process (tokenize, render, route, stream) starts without the engine's heavy
    imports: each Serve ingress replica would pay ~3 s of a core for them (docs/testing.md)."""
    import subprocess
    import sys
    code = ("import sys, kvmesh.cluster.openai.ingress, kvmesh.cluster.serve.dispatch, kvmesh.cluster.config; "
            "print(sorted(m for m in ('torch', 'numba', 'xgrammar') if m in sys.modules))")
    run = subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).resolve().parents[2],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.strip().splitlines()[-1] == "[]", run.stdout
