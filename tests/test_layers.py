"""The package's layers: every import runs down the order README "Package layout" writes, and no
set of modules imports itself round a circle; `import nanosft.sft` loads no product module.

Compared: every import of every module under nanosft/ (module level, inside functions and classes,
relative ones, `importlib.import_module` with a literal name, and the lazy top-level names of
nanosft/__init__.py), read with ast, against the layer block of README.md; and the modules a fresh
interpreter holds after importing nanosft.sft. Negative controls show each check catching what it
is for. Hermetic, CPU, a few seconds. Run: python -m pytest -q tests/test_layers.py
"""

import ast
import os
import re
import subprocess
import sys

import nanosft

PACKAGE = os.path.dirname(nanosft.__file__)
README = os.path.join(os.path.dirname(PACKAGE), "README.md")
PRODUCT = ["cli", "families", "fast", "io", "memory", "monitoring", "parallel", "run"]


def read_layers(readme=README):
    """[(layer name, [module or package names])], top first, from README's layer block."""
    text = open(readme, encoding="utf-8").read()
    block = re.search(r"<!-- layers:.*?-->\n```text\n(.*?)```", text, re.S)
    assert block, f"{readme}: no layer block (a ```text block after '<!-- layers:')"
    layers = []
    for line in block.group(1).splitlines():
        name, _, modules = line.partition(":")
        layers.append((name.strip(), [m.strip() for m in modules.split(",")]))
    return layers


def module_name(path, root):
    """nanosft/run/checkpoint.py -> nanosft.run.checkpoint; a package's __init__ -> the package."""
    name = os.path.relpath(path, os.path.dirname(root))[:-3].replace(os.sep, ".")
    return name.removesuffix(".__init__")


def package_modules(root=PACKAGE):
    """{module name: path} for every .py file of the package."""
    return {module_name(os.path.join(d, f), root): os.path.join(d, f)
            for d, _, files in os.walk(root) for f in files if f.endswith(".py")}


def imported_names(path, name, is_package):
    """Every nanosft module name `path` imports, wherever the import statement stands."""
    tree = ast.parse(open(path, encoding="utf-8").read())
    base = name if is_package else name.rpartition(".")[0]
    found = []
    for node in ast.walk(tree):  # the whole tree: functions and classes too
        if isinstance(node, ast.Import):
            found += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if node.level:  # from . import x / from .y import z
                parent = base.split(".")[: len(base.split(".")) - node.level + 1]
                module = ".".join(parent + ([module] if module else []))
            found += [f"{module}.{alias.name}" for alias in node.names]  # a submodule or a name
        elif (isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant)
              and getattr(node.func, "attr", getattr(node.func, "id", None)) == "import_module"):
            found.append(node.args[0].value)
        elif isinstance(node, ast.Dict) and isinstance(node.values and node.values[0],
                                                        ast.Constant):
            # nanosft/__init__.py's lazy names: {"Trainer": "nanosft.trainer", ...}
            found += [v.value for v in node.values if isinstance(v, ast.Constant)
                      and isinstance(v.value, str) and v.value.startswith("nanosft.")]
    return [n for n in found if isinstance(n, str) and n.split(".")[0] == "nanosft"]


def import_graph(root=PACKAGE):
    """{module: set of modules it imports}; `from pkg import name` counts the submodule pkg.name
    when there is one, else pkg; importing a submodule runs its packages' __init__ too (all but
    nanosft's own, which imports nothing until a name is asked for); a module importing itself
    is dropped."""
    modules = package_modules(root)
    graph = {}
    for name, path in modules.items():
        targets = set()
        for imported in imported_names(path, name, path.endswith("__init__.py")):
            while imported not in modules and "." in imported:
                imported = imported.rpartition(".")[0]
            parents = imported.split(".")
            targets |= {".".join(parents[:i]) for i in range(2, len(parents) + 1)}
        graph[name] = {t for t in targets if t in modules and t != name
                       and not name.startswith(t + ".")}
    return graph


def circles(graph):
    """The strongly connected sets of more than one module (Tarjan), each sorted."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10 * len(graph)))
    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def layer_of(module, layers):
    """The index (0 = top) of the layer naming `module` or its nearest enclosing package."""
    best = None
    for i, (_, names) in enumerate(layers):
        for n in names:
            if module == n or module.startswith(n + "."):
                if best is None or len(n) > len(best[1]):
                    best = (i, n)
    return None if best is None else best[0]


def upward_arrows(graph, layers):
    """'a (layer) -> b (higher layer)' for each import that runs up."""
    arrows = []
    for a in sorted(graph):
        for b in sorted(graph[a]):
            la, lb = layer_of(a, layers), layer_of(b, layers)
            if la is not None and lb is not None and lb < la:
                arrows.append(f"{a} ({layers[la][0]}) -> {b} ({layers[lb][0]})")
    return arrows


def test_every_module_stands_in_one_layer():
    layers = read_layers()
    named = [n for _, names in layers for n in names]
    assert len(named) == len(set(named)), "a module is named in two layers"
    assert [m for m in package_modules() if layer_of(m, layers) is None] == []


def test_no_import_circle():
    assert circles(import_graph()) == []


def test_every_import_runs_down_the_layers():
    assert upward_arrows(import_graph(), read_layers()) == []


def test_the_model_never_imports_distribution():
    # torchtitan's rule: a parallelize step applies TP / FSDP to the model, never the model itself
    graph, layers = import_graph(), read_layers()
    model_code = [m for m in graph if m in ("nanosft.model", "nanosft.configuration")
                  or m.startswith("nanosft.families.") and m != "nanosft.families.auto"]
    assert [m for m in model_code if any(t.startswith("nanosft.parallel") for t in graph[m])] == []
    assert layer_of("nanosft.parallel", layers) < layer_of("nanosft.families.qwen3", layers)


# ----------------------------------------------------------------------------- negative controls
def write_package(tmp_path, files):
    root = tmp_path / "nanosft"
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return str(root)


def test_the_reader_finds_imports_inside_functions_and_import_module(tmp_path):
    root = write_package(tmp_path, {
        "__init__.py": '_LAZY = {"Trainer": "nanosft.trainer"}\n',
        "trainer.py": "def f():\n    from nanosft.run import checkpoint\n",
        "run/__init__.py": "",
        "run/checkpoint.py": ("import importlib\n\nclass C:\n    def g(self):\n"
                              "        importlib.import_module('nanosft.trainer')\n"),
        "run/preflight.py": "from . import checkpoint\nfrom .. import trainer\n",
    })
    graph = import_graph(root)
    assert graph["nanosft"] == {"nanosft.trainer"}
    assert graph["nanosft.trainer"] == {"nanosft.run", "nanosft.run.checkpoint"}
    assert graph["nanosft.run.checkpoint"] == {"nanosft.trainer"}
    assert graph["nanosft.run.preflight"] == {"nanosft.run.checkpoint", "nanosft.trainer"}
    assert circles(graph) == [["nanosft.run.checkpoint", "nanosft.trainer"]]


def test_the_check_sees_an_upward_arrow(tmp_path):
    root = write_package(tmp_path, {
        "__init__.py": "",
        "trainer_callback.py": "def callbacks():\n    import nanosft.monitoring.callbacks\n",
        "monitoring/__init__.py": "",
        "monitoring/callbacks.py": "from nanosft.trainer_callback import TrainerCallback\n",
    })
    layers = [("reporting", ["nanosft.monitoring"]), ("set-up", ["nanosft.trainer_callback"]),
              ("top", ["nanosft"])]
    arrows = upward_arrows(import_graph(root), layers)
    assert arrows == ["nanosft.trainer_callback (set-up) -> nanosft.monitoring (reporting)",
                      "nanosft.trainer_callback (set-up) -> nanosft.monitoring.callbacks "
                      "(reporting)"]


def test_the_readme_block_is_what_the_test_reads(tmp_path):
    readme = tmp_path / "README.md"
    readme.write_text("x\n<!-- layers: top first -->\n```text\ntop: nanosft.cli\n"
                      "low: nanosft.io, nanosft.masking\n```\n")
    assert read_layers(str(readme)) == [("top", ["nanosft.cli"]),
                                        ("low", ["nanosft.io", "nanosft.masking"])]
    layers = read_layers(str(readme))
    assert layer_of("nanosft.io.hub", layers) == 1 and layer_of("nanosft.sft", layers) is None


# ------------------------------------------------------------------------ what nanosft.sft loads
def test_import_sft_loads_no_product_module():
    # nor does a default SFTConfig (FSDP off: nanosft.parallel.fsdp stays unimported)
    code = ("import sys, nanosft.sft; nanosft.sft.SFTConfig(use_cpu=True); "
            "print('\\n'.join(m for m in sys.modules if m.startswith('nanosft')))")
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            check=True).stdout.split()
    product = [m for m in loaded if "." in m and m.split(".")[1] in PRODUCT]
    assert "nanosft.sft" in loaded and "nanosft.trainer" in loaded
    assert product == []
