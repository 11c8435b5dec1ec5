"""The two layers: the teaching core imports nothing of the product layer at module level, and
`import nanosft.sft` loads no FSDP, tensor-parallel, memory-ledger, Hub, CLI or demo module.

Compared: the module-level imports of every core module, read with ast (imports inside functions
are the product layer's seams and allowed); the modules a fresh interpreter holds after importing
nanosft.sft. Hermetic, CPU, a few seconds. Run: python -m pytest -q tests/test_layers.py
"""

import ast
import os
import subprocess
import sys

import nanosft

PACKAGE = os.path.dirname(nanosft.__file__)
CORE = ["adapter_files", "args", "collator", "configuration", "data", "distributed", "generation",
        "loop", "lora", "loss", "masking", "model", "nf4", "optim", "peft", "prompt_learning",
        "reference", "sft", "tokenizer", "trainer", "trainer_callback", "trainer_pt_utils",
        "trainer_utils"]
PRODUCT = ["cli", "families", "fast", "io", "memory", "monitoring", "parallel"]


def module_level_imports(path):
    tree = ast.parse(open(path, encoding="utf-8").read())
    names = []
    for node in tree.body:  # module level only: not inside functions or classes
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names += [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
    return names


def test_core_modules_import_no_product_module_at_module_level():
    assert sorted(p[:-3] for p in os.listdir(PACKAGE) if p.endswith(".py")
                  and p not in ("__init__.py", "__main__.py")) == CORE
    offending = []
    for name in CORE:
        for imported in module_level_imports(os.path.join(PACKAGE, f"{name}.py")):
            if any(imported == f"nanosft.{p}" or imported.startswith(f"nanosft.{p}.")
                   for p in PRODUCT):
                offending.append(f"nanosft/{name}.py imports {imported}")
    assert offending == []


def test_the_check_sees_a_core_to_product_import(tmp_path):
    # negative control: the reader of imports finds one written at module level
    path = tmp_path / "bad.py"
    path.write_text("import torch\nfrom nanosft.parallel import fsdp\n")
    assert "nanosft.parallel.fsdp" in module_level_imports(path)


def test_import_sft_loads_no_product_module():
    # nor does a default SFTConfig (FSDP off: nanosft.parallel.fsdp stays unimported)
    code = ("import sys, nanosft.sft; nanosft.sft.SFTConfig(use_cpu=True); "
            "print('\\n'.join(m for m in sys.modules if m.startswith('nanosft')))")
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            check=True).stdout.split()
    product = [m for m in loaded if "." in m and m.split(".")[1] in PRODUCT]
    assert "nanosft.sft" in loaded and "nanosft.trainer" in loaded
    assert product == []
