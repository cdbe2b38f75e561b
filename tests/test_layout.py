"""The package layout: backends register themselves, the registry names none, no import cycles,
one feature table behind refusals, the CLI and the README."""

from __future__ import annotations

import ast
import dataclasses
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from ringjax.core import features
from ringjax.dispatch import registry
from ringjax.options import AttentionOptions

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "ringjax"
BACKENDS = sorted(p.name for p in (PACKAGE / "backends").iterdir() if (p / "__init__.py").exists())


def _modules() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
        out[name.removesuffix(".__init__")] = path
    return out


def _imports(path: Path, modules) -> set[str]:
    """ringjax modules `path` imports anywhere in its body (lazy imports inside functions too)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("ringjax"):
            for alias in node.names:
                sub = f"{node.module}.{alias.name}"
                out.add(sub if sub in modules else node.module)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.startswith("ringjax"))
    return {m for m in out if m in modules}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on_stack, out = {}, {}, [], set(), []

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
                out.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    return out


def test_no_import_cycles():
    modules = _modules()
    # the package's own __init__ (the public names) imports the pipeline; nothing below imports it back
    graph = {name: _imports(path, modules) - {"ringjax"} for name, path in modules.items()}
    assert _cycles(graph) == []


def test_registry_names_no_backend():
    source = (PACKAGE / "dispatch" / "registry.py").read_text()
    for name in BACKENDS + ["pallas_gpu", "mosaic", "triton"]:
        assert name not in source, f"dispatch/registry.py names {name!r}"


def test_backends_only_depend_on_the_core():
    modules = _modules()
    for name, path in modules.items():
        if not name.startswith("ringjax.backends."):
            continue
        own = ".".join(name.split(".")[:3])
        for dep in _imports(path, modules):
            other_backend = dep.startswith("ringjax.backends.") and not dep.startswith(own)
            pipeline = dep.split(".")[1] in ("api", "strategies", "layers", "dilated", "packed")
            assert not other_backend and not pipeline, f"{name} imports {dep}"


@pytest.mark.parametrize("backend", BACKENDS)
def test_every_backend_has_the_same_files(backend):
    files = {p.name for p in (PACKAGE / "backends" / backend).glob("*.py")}
    assert {"__init__.py", "implementation.py", "config.py", "kernels.py"} <= files


def test_every_backend_registers_itself_with_a_feature_table():
    regs = registry.registrations("ring_attention")
    targets = {r.target.split(".")[2] for r in regs if r.target.startswith("ringjax.backends.")}
    assert targets == set(BACKENDS)
    assert all(isinstance(r.support, features.Support) for r in regs)


def test_every_option_is_covered_by_the_feature_table():
    covered = set(features.COMMON_FIELDS)
    for f in features.FEATURES:
        covered.update(f.fields)
    assert {f.name for f in dataclasses.fields(AttentionOptions)} == covered


def test_readme_feature_table_is_the_generated_one():
    text = (ROOT / "README.md").read_text()
    begin, end = "<!-- features:begin -->\n", "\n<!-- features:end -->"
    assert begin in text and end in text, "README lacks the feature table markers"
    shown = text[text.index(begin) + len(begin):text.index(end)]
    assert shown == registry.feature_table(), "README's table differs: python -m ringjax implementations --markdown"


def test_cli_prints_the_feature_table():
    child = subprocess.run([sys.executable, "-m", "ringjax", "implementations", "--markdown"], capture_output=True,
                           text=True, timeout=120, check=True)
    assert child.stdout.strip() == registry.feature_table()


def test_refusals_come_from_the_feature_table():
    problem = registry.Problem(opts=AttentionOptions(has_alibi=True), batch=1, seq=128, heads=2, kv_heads=1,
                               head_dim=64, dtype="bfloat16", platform="gpu")
    for reg in registry.registrations("ring_attention"):
        why = reg.support.refusal(reg.name, problem)
        assert (why is None) == ("alibi_slopes" in reg.support.features), (reg.name, why)
        if why:
            assert "ALiBi (`alibi_slopes`) is not implemented" in why


def test_former_triton_name_still_works_with_a_warning():
    problem = registry.Problem(opts=AttentionOptions(), batch=1, seq=64, heads=2, kv_heads=1, head_dim=32,
                               dtype="float32", platform="cpu")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        reg, _ = registry.choose("ring_attention", "pallas_gpu_interpret", problem)
    assert reg.name == "pallas_triton_interpret"
    assert any(issubclass(w.category, DeprecationWarning) and "pallas_triton" in str(w.message) for w in caught)


def test_importing_ringjax_loads_no_kernel_code():
    code = ("import sys, ringjax, ringjax.flax, ringjax.equinox; "
            "from ringjax.dispatch import registry; registry.registrations('ring_attention'); "
            "bad = [m for m in sys.modules if m.startswith('jax.experimental.pallas') "
            "or m.endswith(('.implementation', '.kernels', '.fused_ring'))]; "
            "print(bad); assert not bad")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
