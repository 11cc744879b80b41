"""The package layering of docs/design.md, read from the source: absolute
imports for kernels and checkpoints, and no import cycles between packages."""
import ast
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SOURCES = {"hybridspec": REPO / "hybridspec", "hybridspec.kernels": REPO / "kernels",
           "hybridspec.checkpoints": REPO / "checkpoints"}


def modules() -> dict[str, Path]:
    """Every module of the package by dotted name (the links in hybridspec/ not followed twice)."""
    found = {}
    for package, root in SOURCES.items():
        for path in root.rglob("*.py"):
            if package == "hybridspec" and path.relative_to(root).parts[0] in ("kernels", "checkpoints"):
                continue
            parts = path.relative_to(root).with_suffix("").parts
            name = ".".join((package, *parts)).removesuffix(".__init__")
            found[name] = path
    return found


def imports(name: str, path: Path) -> list[tuple[str, int]]:
    """(imported module, line) of every import at run time (TYPE_CHECKING blocks left out)."""
    tree = ast.parse(path.read_text())
    skip = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
            for n in ast.walk(node)}
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = []
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            out += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            out.append((base, node.lineno))
    return out


def unit(module: str) -> str:
    """The layer a module belongs to: hybridspec.<package> or a top-level hybridspec module."""
    parts = module.split(".")
    return ".".join(parts[:2])


def test_kernels_and_checkpoints_are_imported_by_their_absolute_names():
    bad = []
    for name, path in modules().items():
        source = path.read_text()
        for line_no, line in enumerate(source.splitlines(), 1):
            stripped = line.strip()
            if stripped.startswith(("from ..kernels", "from .kernels", "from ..checkpoints", "from .checkpoints",
                                    "import kernels", "from kernels", "from checkpoints", "import checkpoints")):
                bad.append(f"{path.relative_to(REPO)}:{line_no}: {stripped}")
    assert not bad, bad


def test_no_import_cycles_between_packages():
    graph: dict[str, set[str]] = {}
    for name, path in modules().items():
        for target, _ in imports(name, path):
            # `import hybridspec as hs` (the front door) in a CLI or bench module is not a layer edge
            if target.startswith("hybridspec.") and unit(target) != unit(name):
                graph.setdefault(unit(name), set()).add(unit(target))

    def reaches(start: str, goal: str, seen: set[str]) -> bool:
        for nxt in graph.get(start, ()):
            if nxt == goal or (nxt not in seen and reaches(nxt, goal, seen | {nxt})):
                return True
        return False

    cycles = sorted(u for u in graph if reaches(u, u, {u}))
    assert not cycles, {u: sorted(graph[u]) for u in cycles}


STATE_STORAGE = {"hybridspec.cache.state_pool", "hybridspec.cache.state_specs"}


def test_checkpoints_reach_models_only_through_the_recurrent_layer_protocol():
    for name, path in modules().items():
        if name.startswith("hybridspec.checkpoints"):
            imported = {t for t, _ in imports(name, path)}
            assert not {unit(t) for t in imported} & {"hybridspec.models", "hybridspec.spec", "hybridspec.engine"}, name
            # of the storage layer, only the state pool and the state specs: a model's cache comes from `new_cache`
            assert {t for t in imported if unit(t) == "hybridspec.cache"} <= STATE_STORAGE, name
            assert ".mixer" not in path.read_text(), name
    policy = modules()["hybridspec.checkpoints.policy"]
    assert not any("auto" in t for t, _ in imports("hybridspec.checkpoints.policy", policy))


def test_the_top_level_kernels_folder_never_shadows_the_kernels_distribution():
    """transformers (5.25+) imports the `kernels` distribution at import time when it
    is installed. Run from a checkout, the repository's top-level kernels/ comes first
    on sys.path, so it must not be a regular package: without an __init__.py it is only a
    namespace portion, and an installed `kernels` wins (hybridspec.kernels still imports)."""
    import subprocess
    import sys

    assert not (REPO / "kernels" / "__init__.py").exists()
    probe = ("import importlib.util, hybridspec.kernels.cpu.native; spec = importlib.util.find_spec('kernels'); "
             "print(spec.origin if spec else None)")
    origin = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, check=True)
    found = origin.stdout.strip()  # None: a namespace portion (no distribution installed)
    assert not found.startswith(str(REPO / "kernels")), found
    if found not in ("None", ""):
        assert "site-packages" in found or "dist-packages" in found, found


def test_the_package_map_of_the_design_document_is_the_tree():
    """docs/design.md's package map is `tools/package_map.py`'s output: a module added,
    moved, renamed or removed (or a docstring's first lines changed) fails here until
    `python tools/package_map.py --write` is run."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("package_map", REPO / "tools" / "package_map.py")
    package_map = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(package_map)
    written = package_map.written_block(package_map.DESIGN.read_text())
    assert written, "docs/design.md has no package map"
    assert written == package_map.block(), "docs/design.md's package map is stale: run python tools/package_map.py --write"
    modules_on_disk = {p.name for p in modules().values() if p.name != "__init__.py"}
    assert all(name in written for name in modules_on_disk)
