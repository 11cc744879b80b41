"""The backend seam of docs/design.md ("Backends"), read from the source: no
module outside `kernels/` decides which kernel runs. A decision is any of
- a call of a kernel-choice predicate (`use_triton`, `triton_runs_on`,
  `pick`, `takes`, `takes_forward`, `available`, `enabled`, `set_enabled`,
  `applies`, `native_applies`, `takes_greedy`) imported from
  `hybridspec.kernels`, or of one of the unmistakable ones as a method of
  anything (`type(self).native_applies(...)`);
- a call that asks the native path and falls back when it declines
  (`cpu_blocks.mixer_block` / `mlp_block`, `cpu_forward.forward`, ...: any
  function of the native modules `cpu_native`, `cpu_blocks`, `cpu_forward`,
  `dispatch`, `cpu_rows`, `cpu_norm`, `cpu_rope`, `cpu_conv`, `cpu_mamba1`,
  `cpu_mamba2`);
- in a module that imports `hybridspec.kernels`, a device test (`.is_cpu`, a
  comparison with `.device.type` or `torch.device(...).type`);
- a read of a kernel environment variable (`HYBRIDSPEC_KERNELS`,
  `HYBRIDSPEC_CPU_KERNELS`, `HYBRIDSPEC_BACKEND`) or of a kernels module's
  `*_ENV` name.
Models, caches, checkpoints and the speculator call the op objects of the
backend chosen once per (model, device, dtype) (`hybridspec.kernels.backend`)."""
import ast
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
NATIVE_MODULES = {"cpu_native", "cpu_blocks", "cpu_forward", "dispatch", "cpu_rows", "cpu_norm", "cpu_rope",
                  "cpu_conv", "cpu_mamba1", "cpu_mamba2"}
PREDICATES = {"use_triton", "triton_runs_on", "pick", "takes", "takes_forward", "available", "enabled",
              "set_enabled", "applies", "native_applies", "takes_greedy"}
UNMISTAKABLE = {"use_triton", "triton_runs_on", "takes_forward", "native_applies", "takes_greedy", "set_enabled"}
KERNEL_ENVS = {"HYBRIDSPEC_KERNELS", "HYBRIDSPEC_CPU_KERNELS", "HYBRIDSPEC_BACKEND"}


def sources() -> list[Path]:
    """Every module of the package outside kernels/ (checkpoints/ included: it is a top-level folder too)."""
    out = [p for p in (REPO / "hybridspec").rglob("*.py") if "kernels" not in p.relative_to(REPO / "hybridspec").parts
           and "checkpoints" not in p.relative_to(REPO / "hybridspec").parts]
    return sorted(out + list((REPO / "checkpoints").rglob("*.py")))


def kernel_names(tree: ast.AST) -> tuple[set[str], set[str], bool]:
    """(names bound to native kernels modules, names imported from any kernels module, imports kernels at all)."""
    modules, names, any_kernels = set(), set(), False
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("hybridspec.kernels"):
            any_kernels = True
            for alias in node.names:
                bound = alias.asname or alias.name
                if node.module == "hybridspec.kernels" and alias.name in NATIVE_MODULES:
                    modules.add(bound)
                else:
                    names.add(bound)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("hybridspec.kernels"):
                    any_kernels = True
                    if alias.name.rpartition(".")[2] in NATIVE_MODULES and alias.asname:
                        modules.add(alias.asname)
    return modules, names, any_kernels


def is_device_type(node: ast.AST) -> bool:
    return (isinstance(node, ast.Attribute) and node.attr == "type"
            and (isinstance(node.value, ast.Attribute) and node.value.attr == "device"
                 or isinstance(node.value, ast.Call) and ast.unparse(node.value.func).endswith("device")))


def decisions(path: Path) -> list[str]:
    tree = ast.parse(path.read_text())
    modules, names, any_kernels = kernel_names(tree)
    found = []

    def add(node, what):
        found.append(f"{path.relative_to(REPO)}:{node.lineno}: {what}")

    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            func = node.func
            if isinstance(func, ast.Name) and func.id in names and func.id in PREDICATES:
                add(node, func.id)
            elif isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) and func.value.id in modules:
                add(node, ast.unparse(func))
            elif isinstance(func, ast.Attribute) and func.attr in UNMISTAKABLE:  # on any receiver
                add(node, ast.unparse(func))
        elif any_kernels and isinstance(node, ast.Attribute) and node.attr == "is_cpu":
            add(node, ".is_cpu")
        elif any_kernels and isinstance(node, ast.Compare) and any(map(is_device_type, [node.left, *node.comparators])):
            add(node, ast.unparse(node))
        elif isinstance(node, ast.Constant) and node.value in KERNEL_ENVS:
            add(node, f"environment variable {node.value}")
        elif isinstance(node, ast.Attribute) and node.attr.endswith("_ENV") and isinstance(node.value, ast.Name) \
                and node.value.id in modules:
            add(node, ast.unparse(node))
    return found


def test_no_backend_decision_outside_kernels():
    found = [d for path in sources() for d in decisions(path)]
    assert not found, f"{len(found)} backend decisions outside kernels/:\n" + "\n".join(found)
