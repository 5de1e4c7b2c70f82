"""specdec's import graph: no circle, and no layer imports one above it (read from the source with ast)."""

import ast
import pathlib
import textwrap

import specdec

# Lower rank imports nothing of a higher one (design: kernels < model < decoding < integrations, cli; testing,
# the embedded pair's loader for the demo, benchmarks and tests, sits on top beside the CLI).
LAYERS = {"kernels": 0, "model": 1, "decoding": 2, "integrations": 3, "cli": 3, "testing": 3}


def module_files(root: pathlib.Path) -> dict[str, pathlib.Path]:
    """Dotted module name -> file, for every .py under the package directory ``root``."""
    modules = {}
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root.parent).with_suffix("").parts
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def import_graph(root: pathlib.Path) -> dict[str, set[str]]:
    """Module -> the package's modules it imports, at module level or deferred inside a function.

    ``from a import b`` is an edge to the module ``a.b`` when there is one, else to ``a``. A module's own
    parent packages are not edges: Python imports them before the module itself, whatever it names.
    """
    modules = module_files(root)
    graph = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        targets = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(anchor + ([base] if base else []))
                targets.update(f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base
                               for alias in node.names)  # fmt: skip
        parents = {name.rsplit(".", depth)[0] for depth in range(1, name.count(".") + 1)}
        graph[name] = {target for target in targets if target in modules and target != name} - parents
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One circle of the graph as [a, b, ..., a], or None (depth-first search, three colours)."""
    state = dict.fromkeys(graph, "new")
    path: list[str] = []

    def visit(node):
        state[node] = "open"
        path.append(node)
        for target in sorted(graph[node]):
            if state[target] == "open":
                return path[path.index(target) :] + [target]
            if state[target] == "new" and (cycle := visit(target)):
                return cycle
        state[node] = "done"
        path.pop()
        return None

    for node in sorted(graph):
        if state[node] == "new" and (cycle := visit(node)):
            return cycle
    return None


def write_package(root: pathlib.Path, files: dict[str, str]) -> pathlib.Path:
    for relative, text in files.items():
        path = root / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    return root / "pkg"


def test_specdec_has_no_import_circle():
    graph = import_graph(pathlib.Path(specdec.__file__).parent)
    assert "specdec.integrations._vllm_verify" in graph["specdec.integrations._vllm_samplers"]
    assert "specdec.kernels.tuning" in graph["specdec.kernels.rms_norm"]  # the graph sees the usual imports
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph))


def test_layers_import_only_the_layers_below():
    graph = import_graph(pathlib.Path(specdec.__file__).parent)
    layer = {name: LAYERS.get(name.split(".")[1]) if "." in name else None for name in graph}
    upward = [f"{a} -> {b}" for a, targets in graph.items() for b in targets
              if layer[a] is not None and layer[b] is not None and layer[b] > layer[a]]  # fmt: skip
    assert upward == []


def test_the_graph_finds_a_circle_through_a_deferred_import(tmp_path):
    """The circle the vLLM plugin had: a module-level import one way, an import inside a function back."""
    files = {
        "pkg/__init__.py": "from pkg import base\n",
        "pkg/base.py": "X = 1\n",
        "pkg/sub/__init__.py": "",
        "pkg/sub/plugin.py": """
            from pkg import base

            def register():
                from pkg.sub import _classes
                return _classes
            """,
        "pkg/sub/_classes.py": "import pkg\nfrom . import plugin\nfrom ..base import X\n",  # pkg: its parent
    }
    graph = import_graph(write_package(tmp_path, files))
    assert graph == {
        "pkg": {"pkg.base"},
        "pkg.base": set(),
        "pkg.sub": set(),
        "pkg.sub.plugin": {"pkg.base", "pkg.sub._classes"},
        "pkg.sub._classes": {"pkg.sub.plugin", "pkg.base"},
    }
    assert find_cycle(graph) == ["pkg.sub._classes", "pkg.sub.plugin", "pkg.sub._classes"]
    graph["pkg.sub._classes"].discard("pkg.sub.plugin")
    assert find_cycle(graph) is None
