"""The package's import graph, function-level imports included: no cycle among modules or
subpackages, every arrow down the layers, every module imports on its own, and the config
modules stay leaves (no model, data, TFDS or even JAX behind `config` and `presets`)."""
import ast
import pathlib
import re
import subprocess
import sys

import pytest
import tomllib

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "stablerl_jax"
# Package -> source directory.
SOURCES = {"stablerl_jax": PACKAGE}


def _modules() -> dict[str, pathlib.Path]:
    out = {}
    for package, src in SOURCES.items():
        for path in sorted(src.rglob("*.py")):
            parts = (*package.split("."), *path.relative_to(src).with_suffix("").parts)
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            out.setdefault(name, path)
    return out


def test_pyproject_installs_every_package_from_its_source():
    setup = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    packages = {n for n, p in _modules().items() if p.name == "__init__.py"}
    assert sorted(setup["packages"]) == sorted(packages)
    assert "package-dir" not in setup
    # No symbolic link in the package: every tool that reads the tree sees every module.
    assert [p for p in PACKAGE.rglob("*") if p.is_symlink()] == []


def _import_nodes(path: pathlib.Path):
    """(node, deferred?) of every import statement in the file: at module level, or inside
    a function or an `if` block (deferred: it runs later, but still draws an arrow)."""
    tree = ast.parse(path.read_text())
    top = {id(n) for n in tree.body}
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node, id(node) not in top


def _targets(node, modules, name) -> set[str]:
    if isinstance(node, ast.Import):
        targets = [a.name for a in node.names]
    elif node.module and not node.level:
        targets = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
    else:
        return set()
    return {t for t in targets if t in modules and t != name}


def _imports(name: str, path: pathlib.Path, modules) -> set[str]:
    """Package modules that `name` imports, function-level imports included."""
    return set().union(*(_targets(n, modules, name) for n, _ in _import_nodes(path)))


def test_no_import_cycles():
    modules = _modules()
    graph = {m: _imports(m, p, modules) for m, p in modules.items()}
    state = {}  # 1: on the current path, 2: done

    def visit(m, path):
        state[m] = 1
        for dep in sorted(graph[m]):
            if state.get(dep) == 1:
                cycle = path[path.index(dep):] + [dep]
                raise AssertionError("import cycle: " + " -> ".join(cycle))
            if dep not in state:
                visit(dep, path + [dep])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])



def _unit(name: str) -> str:
    """The subpackage a module belongs to (config, model, rl, ...), or the root module."""
    parts = name.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def test_no_circle_among_the_subpackages():
    """Two subpackages never import each other, through any chain of modules: the map's
    arrows between subpackages form no circle either."""
    modules = _modules()
    graph = {}
    for m, p in modules.items():
        for d in _imports(m, p, modules):
            if _unit(d) != _unit(m):
                graph.setdefault(_unit(m), set()).add(_unit(d))
    reach = {u: set(v) for u, v in graph.items()}
    changed = True
    while changed:
        changed = False
        for u, r in reach.items():
            more = set().union(*(reach.get(v, set()) for v in r)) - r
            if more:
                r |= more
                changed = True
    circles = sorted(f"{u} <-> {v}" for u in reach for v in reach[u] if u < v
                     and u in reach.get(v, ()))
    assert not circles, circles


def test_a_deferred_import_of_the_package_is_for_typing_only():
    """A package import inside a function or an `if` block hides an arrow from a reader:
    only `if TYPE_CHECKING:` imports (annotations, no arrow at run time) are deferred."""
    modules = _modules()
    found = []
    for m, p in modules.items():
        tree = ast.parse(p.read_text())
        typing_only = {n.lineno for b in ast.walk(tree) if isinstance(b, ast.If)
                       and ast.unparse(b.test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING")
                       for n in b.body}
        found += [f"{p.relative_to(ROOT)}:{n.lineno}" for n, deferred in _import_nodes(p)
                  if deferred and n.lineno not in typing_only and _targets(n, modules, m)]
    assert not found, "deferred package imports: " + ", ".join(found)


# The layers, lowest first: a module imports (at module level or inside a function) only
# from its own layer or a lower one, so the arrows of the package map (docs/architecture.md)
# point one way. The tables of names (the kernels' `*_impls`, the loss table) import
# nothing of the package's upper layers, so the config validates names against them from
# the bottom layer.
LAYERS = (
    ("stablerl_jax.__init__", "stablerl_jax.sharding", "stablerl_jax.slices",
     "stablerl_jax.packing", "stablerl_jax.input_checks", "stablerl_jax.moved",
     "stablerl_jax.distributed", "stablerl_jax.kernels.__init__", "stablerl_jax.kernels.*_impls",
     "stablerl_jax.config.loss_table"),
    ("stablerl_jax.config", "stablerl_jax.presets"),
    ("stablerl_jax.kernels", "stablerl_jax.data"),
    ("stablerl_jax.model",),
    ("stablerl_jax.method",),
    ("stablerl_jax.sampling", "stablerl_jax.runs"),
    ("stablerl_jax.interop",),
    ("stablerl_jax.pod",),
    ("stablerl_jax.rl",),
)


def _layer(name: str, path: pathlib.Path) -> int:
    """The first layer holding `name`: a module, its package, or a pattern of file names."""
    for i, layer in enumerate(LAYERS):
        for entry in layer:
            package, _, leaf = entry.rpartition(".")
            if leaf == "__init__" and (name == package and path.name == "__init__.py"):
                return i
            if "*" in leaf and name.startswith(package + ".") and path.match(leaf + ".py"):
                return i
            if name == entry or name.startswith(entry + "."):
                return i
    raise AssertionError(f"{name} is in no layer of LAYERS")


def test_imports_point_down_the_layers():
    modules = _modules()
    wrong = [f"{m} (layer {_layer(m, p)}) imports {d} (layer {_layer(d, modules[d])})"
             for m, p in modules.items() for d in sorted(_imports(m, p, modules))
             if _layer(d, modules[d]) > _layer(m, p)]
    assert not wrong, "\n".join(wrong)


def test_every_subpackage_opens_with_a_map_of_its_files():
    """Each subpackage's __init__ docstring names every module in it (a kernel's
    X_pallas.py and X_impls.py are named by its op X)."""
    for init in sorted(PACKAGE.glob("*/__init__.py")):
        doc = ast.get_docstring(ast.parse(init.read_text())) or ""
        missing = [p.stem for p in init.parent.glob("*.py")
                   if p.name != "__init__.py" and p.name not in doc
                   and re.sub(r"_(pallas|impls)$", "", p.stem) not in doc.split()]
        assert not missing, f"{init.parent.name}/__init__.py does not name {missing}"

@pytest.mark.integration
def test_each_module_imports_on_its_own_and_config_is_a_leaf():
    names = sorted(_modules())
    script = f"""
import importlib, sys
# The config modules first, in a fresh interpreter: nothing heavy behind them.
import stablerl_jax.config, stablerl_jax.presets
heavy = [m for m in sys.modules if m.split(".")[0] in ("jax", "tensorflow_datasets",
         "sentencepiece") or m.startswith(("stablerl_jax.model", "stablerl_jax.data",
         "stablerl_jax.sampling.rollout", "stablerl_jax.rl"))]
assert not heavy, f"config imports {{sorted(heavy)[:5]}}"
import tensorflow_datasets as tfds
for name in {names!r}:
    for m in [m for m in sys.modules if m == "stablerl_jax" or m.startswith("stablerl_jax.")]:
        del sys.modules[m]
    # Re-importing a TFDS builder module would register its builder twice.
    with tfds.core.registered.skip_registration():
        importlib.import_module(name)
print("ok", len({names!r}))
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=300, cwd=PACKAGE.parent)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.startswith("ok")


def test_an_old_module_name_warns_and_gives_the_new_module(monkeypatch):
    import importlib

    from stablerl_jax.rl import step_fns
    monkeypatch.delitem(sys.modules, "stablerl_jax.rl.steps", raising=False)
    with pytest.warns(DeprecationWarning, match="stablerl_jax.rl.step_fns"):
        steps = importlib.import_module("stablerl_jax.rl.steps")
    assert steps is step_fns
