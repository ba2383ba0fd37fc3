"""The package's dependencies point one way: formats, CLI and the front ends
build on the core; the core never reaches back to them, and the kernels
depend on nothing of ours. Read from the source's import statements (lazy
imports inside functions included)."""
import ast
import os

ROOT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "brisklm")

CORE = {"model", "generate", "steps", "sampling", "speculative", "quantize", "gptq", "modes", "errors", "tp"}
FUSION = {"fusion"}  # the GPU kernels applied to a built model: above the core, below the front ends
FRONT = {"api", "loading", "cli", "repl", "bench", "chat", "console", "constrain", "evaluate", "harness", "memory", "tokenizer",
         "presets", "server", "__init__", "__main__"}


def module_name(path: str) -> str:
    rel = os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".")
    return rel[:-len(".__init__")] if rel.endswith(".__init__") else rel


def imports_of(path: str, name: str) -> set[str]:
    """brisklm modules that `name` (at `path`) imports, as dotted names under brisklm."""
    package = name.split(".")[:-1] if not path.endswith("__init__.py") else name.split(".")
    found = set()
    for node in ast.walk(ast.parse(open(path).read())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[:len(package) - node.level + 1] if node.level > 1 else package
                target = ".".join([*base, *(node.module.split(".") if node.module else [])])
            elif node.module and node.module.startswith("brisklm"):
                target = node.module[len("brisklm."):] if node.module != "brisklm" else ""
            else:
                continue
            for alias in node.names:  # `from .kernels import gemv` names a module
                sub = f"{target}.{alias.name}" if target else alias.name
                found.add(sub if os.path.exists(os.path.join(ROOT, *sub.split(".")) + ".py") else target)
        elif isinstance(node, ast.Import):
            found |= {a.name[len("brisklm."):] for a in node.names if a.name.startswith("brisklm.")}
    return {f for f in found if f}


def graph() -> dict[str, set[str]]:
    out = {}
    for folder, _, files in os.walk(ROOT):
        for f in files:
            if f.endswith(".py"):
                path = os.path.join(folder, f)
                out[module_name(path)] = imports_of(path, module_name(path))
    return out


def test_every_module_is_placed_in_a_layer():
    g = graph()
    assert {"kernels.gemv", "kernels.matmul", "model", "quantize"} <= g["fusion"]  # (the reading sees imports)
    assert "checkpoints.native" in g["cli"] and "fusion" in g["loading"]  # (lazy ones too)
    top = {m.split(".")[0] for m in g}
    assert top <= CORE | FUSION | FRONT | {"kernels", "checkpoints"}, top - CORE - FUSION - FRONT


def test_the_kernels_import_nothing_of_ours_but_each_other():
    for name, deps in graph().items():
        if name.startswith("kernels"):
            assert all(d.startswith("kernels") for d in deps), (name, deps)


def test_the_core_never_imports_kernels_formats_or_front_ends():
    for name, deps in graph().items():
        if name in CORE:
            bad = {d for d in deps if d.split(".")[0] in FRONT | FUSION | {"checkpoints", "kernels"}}
            assert not bad, (name, bad)


def test_the_model_knows_the_quantized_formats_only_through_their_registry():
    assert not graph()["model"] & {"quantize", "gptq", "modes"}


def test_the_checkpoint_readers_do_not_import_the_front_ends():
    for name, deps in graph().items():
        if name.startswith("checkpoints"):
            bad = {d for d in deps if d.split(".")[0] in FRONT - {"tokenizer"}}
            assert not bad, (name, bad)
