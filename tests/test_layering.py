"""The import directions the README promises, checked on the source (no module is imported).

    specdec/      the library: imports neither drafters/ nor experiments/
    drafters/     drafters built on specdec: never imports experiments/
    experiments/  configs, runs, reports and the CLI: may import both
and none of the three imports the developer code around them (benchmarks/, tools/, tests/).

Every import counts: module-level and inside functions (lazy ones), `import a.b`, `from a.b import c`, relative
imports (resolved against the importing module), those under `if TYPE_CHECKING:` and
`importlib.import_module("a.b")` / `__import__("a.b")` with a literal name. `test_no_import_cycles` builds the
graph of these imports among the project's modules and fails on every strongly connected component of more than one
module, naming the imports (file:line) that close it.

An edge goes to the most specific project module an import names: `from specdec.train import checkpoint` is an
edge to specdec.train.checkpoint, `from drafters import register` one to drafters (its __init__). The package
__init__s that Python runs on the way (specdec/, specdec/train/) are not edges: counting them would make every
package whose __init__ imports its own submodules a cycle with them.
"""

from __future__ import annotations

import ast
import textwrap
from pathlib import Path
from typing import NamedTuple

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("specdec", "drafters", "experiments")
# importer package -> the top-level packages it must not import
DEVELOPER = ("benchmarks", "tools", "tests")
FORBIDDEN = {"specdec": ("drafters", "experiments", *DEVELOPER), "drafters": ("experiments", *DEVELOPER),
             "experiments": DEVELOPER}


class Import(NamedTuple):
    module: str  # the importing module, e.g. "specdec.train.checkpoint"
    where: str  # "specdec/train/checkpoint.py:153"
    name: str  # the imported name, absolute, e.g. "specdec.export.load_export" or "drafters.dflash"


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imported_names(tree: ast.AST, module: str, is_package: bool) -> list[tuple[int, str]]:
    """(line, absolute dotted name) of every import in `tree`, at any depth."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: from the module's package, one level up per extra dot
                base = module.split(".") if is_package else module.split(".")[:-1]
                base = base[:len(base) - (node.level - 1)]
                prefix = ".".join(base + ([node.module] if node.module else []))
            else:
                prefix = node.module or ""
            out += [(node.lineno, f"{prefix}.{alias.name}" if alias.name != "*" else prefix) for alias in node.names]
        elif (isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant)
              and isinstance(node.args[0].value, str)
              and ((isinstance(node.func, ast.Attribute) and node.func.attr == "import_module")
                   or (isinstance(node.func, ast.Name) and node.func.id in ("import_module", "__import__")))):
            out.append((node.lineno, node.args[0].value))
    return out


def collect_imports(root: Path, packages=PACKAGES) -> tuple[set[str], list[Import]]:
    """The project's modules under `root`/`packages` and every import they make."""
    modules, imports = set(), []
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            module = module_name(path, root)
            modules.add(module)
            tree = ast.parse(path.read_text(), filename=str(path))
            where = path.relative_to(root).as_posix()
            imports += [Import(module, f"{where}:{line}", name)
                        for line, name in _imported_names(tree, module, path.name == "__init__.py")]
    return modules, imports


def layering_violations(root: Path, packages=PACKAGES, forbidden=FORBIDDEN) -> list[str]:
    _, imports = collect_imports(root, packages)
    bad = []
    for imp in imports:
        importer, imported = imp.module.split(".")[0], imp.name.split(".")[0]
        if imported in forbidden.get(importer, ()):
            bad.append(f"{imp.where}: {importer}/ imports {imp.name} ({importer}/ must not import {imported}/)")
    return bad


def resolve(name: str, modules: set[str]) -> str | None:
    """The most specific project module `name` names (a module, or an attribute of one), None if none."""
    parts = name.split(".")
    for n in range(len(parts), 0, -1):
        candidate = ".".join(parts[:n])
        if candidate in modules:
            return candidate
    return None


def import_cycles(root: Path, packages=PACKAGES) -> list[list[str]]:
    """Each strongly connected component (> 1 module) of the project's import graph, as its sorted modules
    followed by the imports inside it ("    file:line  a -> b")."""
    modules, imports = collect_imports(root, packages)
    graph: dict[str, dict[str, list[str]]] = {m: {} for m in modules}
    for imp in imports:
        target = resolve(imp.name, modules)
        wheres = graph[imp.module].setdefault(target, []) if target not in (None, imp.module) else None
        if wheres is not None and imp.where not in wheres:  # `from a import b, c` is one import
            wheres.append(imp.where)
    components = []
    for scc in _strongly_connected(graph):
        if len(scc) > 1:
            members = sorted(scc)
            edges = [f"    {where}  {a} -> {b}" for a in members for b, wheres in sorted(graph[a].items())
                     if b in scc for where in wheres]
            components.append(members + edges)
    return sorted(components)


def _strongly_connected(graph: dict[str, dict[str, list[str]]]) -> list[set[str]]:
    """Tarjan's algorithm, iterative (no recursion limit on long chains)."""
    index, low, on_stack, stack, out, counter = {}, {}, set(), [], [], [0]
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter[0]
        counter[0] += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter[0]
                    counter[0] += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                scc = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    scc.add(member)
                    if member == node:
                        break
                out.append(scc)
    return out


def test_import_directions():
    bad = layering_violations(ROOT)
    assert not bad, ("imports against the layering (specdec <- drafters <- experiments, none of developer code):\n"
                     + "\n".join(bad))


def test_no_import_cycles():
    cycles = import_cycles(ROOT)
    assert not cycles, ("import cycles among the project's modules (cut one import of each):\n"
                        + "\n".join("\n".join(c) for c in cycles))


def _write(root: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))


def test_checker_reports_a_forbidden_import_and_a_cycle(tmp_path):
    """Negative control: the checker finds what it is for, lazy and relative imports included."""
    _write(tmp_path, {
        "specdec/__init__.py": "",
        "specdec/lazy.py": """\
            import json


            def f():
                from drafters import thing  # forbidden, and only inside a function
                return thing
            """,
        "specdec/sub/__init__.py": "",
        "specdec/sub/a.py": "from specdec.sub import b\n",
        "specdec/sub/b.py": "def g():\n    from . import a\n",  # relative and lazy: closes a <-> b
        "specdec/ok.py": "from specdec.sub import a\nimport numpy\n",  # into the cycle, not part of it
        "drafters/__init__.py": "import importlib\nimportlib.import_module('experiments.run')\n",
        "experiments/__init__.py": "",
        "experiments/run.py": "import specdec.ok\n",  # an allowed direction
    })
    bad = layering_violations(tmp_path)
    assert len(bad) == 2, bad
    assert bad[0].startswith("specdec/lazy.py:5: specdec/ imports drafters.thing")
    assert bad[1].startswith("drafters/__init__.py:2: drafters/ imports experiments.run")
    cycles = import_cycles(tmp_path)
    assert cycles == [["specdec.sub.a", "specdec.sub.b",
                       "    specdec/sub/a.py:1  specdec.sub.a -> specdec.sub.b",
                       "    specdec/sub/b.py:2  specdec.sub.b -> specdec.sub.a"]], cycles
    # a three-module cycle through a package __init__ is one component
    _write(tmp_path, {"experiments/__init__.py": "from experiments import run\n",
                      "experiments/report.py": "import experiments\n",
                      "experiments/run.py": "from experiments.report import x\n"})
    assert [c[:3] for c in import_cycles(tmp_path)] == [["experiments", "experiments.report", "experiments.run"],
                                                        ["specdec.sub.a", "specdec.sub.b",
                                                         "    specdec/sub/a.py:1  specdec.sub.a -> specdec.sub.b"]]
    assert not layering_violations(tmp_path, forbidden={})
