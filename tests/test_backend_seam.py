"""The backend seam of docs/design.md ("Backends"), read from the source as an
allow-list: only the files in `ALLOWED` may decide which kernel runs, test a
device or read the environment, each for the rules it names and the reason
beside it. Every other module of hybridspec/, kernels/ and checkpoints/ holds
none of (rule names in brackets)
- [device] a device test: `.type` of a device (`x.device.type`, a variable
  named `device` or `*_device`, `torch.device(...)`), `.is_cuda`, `.is_cpu`,
  `.is_mps`;
- [cuda] anything of `torch.cuda` (`is_available()`, `synchronize`, ...);
- [environ] a read of the environment (`os.environ`, `os.getenv`, either
  imported from `os`) or the name of a kernel environment variable;
- [import] an import from `hybridspec.kernels` other than the seam modules
  and the neutral names of `NEUTRAL` (a native or Triton module reached
  directly is a backend chosen by hand);
- [predicate] a call of a kernel-choice predicate (`PREDICATES`) imported
  from `hybridspec.kernels`, or of an unmistakable one (`UNMISTAKABLE`) as a
  method of anything.
Models, caches, checkpoints and the speculator call the op objects of the
backend chosen once per (model, device, dtype) (`hybridspec.kernels.backend`).
The checker tests itself on probes: each bad snippet must be flagged, each
clean one must pass."""
import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
RULES = ("device", "cuda", "environ", "import", "predicate")
EVERY = frozenset(RULES)

# file or folder (relative to the repository root) -> (rules it may break, why)
ALLOWED: dict[str, tuple[frozenset[str], str]] = {
    "kernels/backend.py": (frozenset({"device", "cuda", "environ", "import", "predicate"}),
                           "the seam: chooses the backend per (model, device, dtype), reads HYBRIDSPEC_BACKEND, "
                           "names a measured device"),
    "kernels/ops.py": (frozenset({"import", "predicate"}),
                       "the seam: the op objects, each implementation declining the calls it cannot take"),
    "kernels/cpu/": (EVERY, "the native backend: its build, its library switch and each kernel's own checks"),
    "kernels/triton/": (EVERY, "the Triton backend: its launchers check CUDA or TRITON_INTERPRET"),
    "kernels/rotary.py": (frozenset({"import", "predicate"}),
                          "the rotation and its native subclass (ops.NativeRotary's), which asks cpu_rope"),
    "kernels/huge_pages.py": (frozenset({"device"}), "huge-page mappings are CPU memory; elsewhere torch's own"),
    "hybridspec/adapters/model_files.py": (frozenset({"device"}), "a file mapped copy-on-write is CPU memory"),
    "hybridspec/cli/args.py": (frozenset({"device", "cuda"}), "--device: refuses a CUDA device the machine lacks"),
    "hybridspec/engine/engine.py": (frozenset({"environ"}), "HYBRIDSPEC_CHECK: the engine's own invariant checks"),
    "hybridspec/engine/cost_cache.py": (frozenset({"environ"}), "HYBRIDSPEC_COST_CACHE, the costs file's own switch"),
    "hybridspec/engine/threads.py": (frozenset({"device"}), "torch's intra-op threads are set for a CPU model only"),
    "hybridspec/models/graphs.py": (frozenset({"cuda", "environ", "import"}),
                                    "CUDA graph capture itself; HYBRIDSPEC_CUDA_GRAPHS, its own switch; refuses the "
                                    "dtypes Triton's attention does not take (paged_attention.SUPPORTED_DTYPES)"),
    "hybridspec/tp/launch.py": (frozenset({"device", "cuda", "environ"}),
                                "torchrun's RANK / WORLD_SIZE / LOCAL_RANK protocol; NCCL on CUDA, gloo elsewhere"),
    "hybridspec/tp/group.py": (frozenset({"cuda"}), "the process group's flag tensor lives on this rank's GPU"),
    "checkpoints/measure.py": (frozenset({"device", "cuda"}), "a clock read waits for CUDA's queued work"),
}

SEAM = {"hybridspec.kernels.backend", "hybridspec.kernels.ops", "hybridspec.kernels.descriptors"}
# modules or names of `hybridspec.kernels` that choose nothing: data layouts, constants, torch forms
NEUTRAL = {
    "hybridspec.kernels.huge_pages",  # state and K/V buffers on huge pages, any backend
    "hybridspec.kernels.slot_plan",  # which ring slots a forward reads and writes
    "hybridspec.kernels.cpu.panels",  # the weights' panel layout, packed and read by torch too
    "hybridspec.kernels.quant",  # GGUF's block formats and the quantized weight type, with their torch forms
    "hybridspec.kernels.rotary.Rotation",  # the torch rotation (a type the attention names)
    "hybridspec.kernels.keyed_random",  # the keyed noise (torch form): one stream per purpose on every backend
    "hybridspec.kernels.reference",  # torch: verification modes, the all-greedy accept, a sequence's pages
}
PREDICATES = {"use_triton", "triton_runs_on", "triton_can_run", "pick", "takes", "takes_forward", "available",
              "enabled", "set_enabled", "applies", "applies_bf16", "native_applies", "takes_greedy", "library",
              "bf16_compute_supported", "choice"}
UNMISTAKABLE = {"use_triton", "triton_runs_on", "triton_can_run", "takes_forward", "native_applies", "takes_greedy",
                "set_enabled", "applies_bf16", "bf16_compute_supported"}
KERNEL_ENVS = {"HYBRIDSPEC_KERNELS", "HYBRIDSPEC_CPU_KERNELS", "HYBRIDSPEC_BACKEND", "TRITON_INTERPRET"}


def sources() -> list[Path]:
    """Every module of the package: hybridspec/ (its links to kernels/ and checkpoints/ not followed), kernels/,
    checkpoints/."""
    inside = [p for p in (REPO / "hybridspec").rglob("*.py")
              if p.relative_to(REPO / "hybridspec").parts[0] not in ("kernels", "checkpoints")]
    return sorted(inside + [p for top in ("kernels", "checkpoints") for p in (REPO / top).rglob("*.py")])


def allowed_rules(relative: str) -> frozenset[str]:
    rules = frozenset()
    for entry, (may, _) in ALLOWED.items():
        if relative == entry or (entry.endswith("/") and relative.startswith(entry)):
            rules |= may
    return rules


def kernels_import_ok(dotted: str) -> bool:
    """Whether importing `dotted` (a module, or module.name) of hybridspec.kernels keeps to the seam."""
    return any(dotted == ok or dotted.startswith(ok + ".") for ok in SEAM | NEUTRAL)


def is_device(node: ast.AST) -> bool:
    """A device: `x.device`, a variable named `device` / `*_device`, a `torch.device(...)` or `device(...)` call."""
    if isinstance(node, ast.Call):
        node = node.func
    return (isinstance(node, ast.Attribute) and node.attr.endswith("device")
            or isinstance(node, ast.Name) and node.id.endswith("device"))


def imported(tree: ast.AST) -> dict[str, str]:
    """Local name -> dotted name of what every import binds."""
    out = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                out[alias.asname or alias.name.partition(".")[0]] = alias.name if alias.asname else \
                    alias.name.partition(".")[0]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            for alias in node.names:
                out[alias.asname or alias.name] = f"{node.module}.{alias.name}"
    return out


def violations(source: str) -> list[tuple[int, str, str]]:
    """(line, rule, what) of every seam rule `source` breaks."""
    tree = ast.parse(source)
    names = imported(tree)
    found = []

    def add(node, rule, what):
        found.append((node.lineno, rule, what))

    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                targets = [f"{node.module}.{alias.name}" for alias in node.names] if node.module else []
            for dotted in targets:
                if dotted in ("os.environ", "os.getenv"):
                    add(node, "environ", dotted)
                elif dotted == "torch.cuda" or dotted.startswith("torch.cuda."):
                    add(node, "cuda", dotted)
                elif (dotted == "hybridspec.kernels" or dotted.startswith("hybridspec.kernels.")) \
                        and not kernels_import_ok(dotted):
                    add(node, "import", dotted)
        elif isinstance(node, ast.Attribute):
            if node.attr in ("is_cuda", "is_cpu", "is_mps"):
                add(node, "device", ast.unparse(node))
            elif node.attr == "type" and is_device(node.value):
                add(node, "device", ast.unparse(node))
            elif node.attr == "cuda" and isinstance(node.value, ast.Name) and names.get(node.value.id) == "torch":
                add(node, "cuda", ast.unparse(node))
            elif node.attr in ("environ", "getenv") and isinstance(node.value, ast.Name) \
                    and names.get(node.value.id) == "os":
                add(node, "environ", ast.unparse(node))
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load) \
                and names.get(node.id) in ("os.environ", "os.getenv", "torch.cuda"):
            add(node, "cuda" if names[node.id] == "torch.cuda" else "environ", node.id)
        elif isinstance(node, ast.Constant) and node.value in KERNEL_ENVS:
            add(node, "environ", f"environment variable {node.value}")
        if isinstance(node, ast.Call):
            func = node.func
            if isinstance(func, ast.Name) and func.id in PREDICATES \
                    and names.get(func.id, "").startswith("hybridspec.kernels"):
                add(node, "predicate", func.id)
            elif isinstance(func, ast.Attribute) and (
                    func.attr in UNMISTAKABLE or func.attr in PREDICATES and isinstance(func.value, ast.Name)
                    and names.get(func.value.id, "").startswith("hybridspec.kernels")):
                add(node, "predicate", ast.unparse(func))
    return found


def seam_breaks(path: Path) -> list[str]:
    relative = path.relative_to(REPO).as_posix()
    may = allowed_rules(relative)
    return [f"{relative}:{line}: [{rule}] {what}" for line, rule, what in violations(path.read_text())
            if rule not in may]


def test_no_backend_decision_outside_the_allow_list():
    found = [b for path in sources() for b in seam_breaks(path)]
    assert not found, f"{len(found)} backend decisions outside the allow-list:\n" + "\n".join(found)


def test_every_allow_list_entry_names_a_file_and_is_needed():
    """An entry for a file that no longer breaks its rules (or is gone) is erosion waiting to happen: drop it."""
    stale = []
    for entry, (may, _) in ALLOWED.items():
        files = [p for p in sources() if p.relative_to(REPO).as_posix().startswith(entry)] if entry.endswith("/") \
            else [REPO / entry] if (REPO / entry).exists() else []
        broken = {rule for p in files for _, rule, _ in violations(p.read_text())}
        if not files or not broken or (not entry.endswith("/") and may - broken):
            stale.append(f"{entry}: may {sorted(may)}, breaks {sorted(broken)}")
    assert not stale, stale


def test_every_neutral_entry_is_imported_where_imports_are_checked():
    """A neutral name nobody outside the allow-list imports any more widens the seam for nothing: drop it."""
    used = {dotted for path in sources() if "import" not in allowed_rules(path.relative_to(REPO).as_posix())
            for dotted in imported(ast.parse(path.read_text())).values()}
    stale = [entry for entry in sorted(NEUTRAL) if not any(d == entry or d.startswith(entry + ".") for d in used)]
    assert not stale, stale


# (probe, the rule it must break)
BAD_PROBES = [
    ("if device.type == 'cuda':\n    pass", "device"),
    ("if x.device.type == 'cpu':\n    pass", "device"),
    ("on_gpu = x.is_cuda", "device"),
    ("if x.is_cpu:\n    pass", "device"),
    ("import torch\nkind = torch.device(d).type", "device"),
    ("import torch\nok = torch.cuda.is_available()", "cuda"),
    ("import torch\ntorch.cuda.synchronize()", "cuda"),
    ("from torch import cuda\ncuda.is_available()", "cuda"),
    ("import os\nname = os.environ.get('HYBRIDSPEC_BACKEND')", "environ"),
    ("import os\nflag = os.getenv('MY_FLAG')", "environ"),
    ("from os import environ\nflag = environ['MY_FLAG']", "environ"),
    ("from hybridspec.kernels.cpu import native as cpu_native", "import"),
    ("from hybridspec.kernels.cpu.native import takes", "import"),
    ("import hybridspec.kernels.triton.mamba2_verify", "import"),
    ("from hybridspec.kernels import cpu", "import"),
    ("from hybridspec.kernels.backend import choice\nname = choice()", "predicate"),
    ("ok = type(self).native_applies(x)", "predicate"),
    ("from hybridspec.kernels import backend\nname = backend.choice()", "predicate"),
]
CLEAN_PROBES = [
    "from hybridspec.kernels import backend as backends\nb = backends.select(device, dtype)\ny = b.linear(x, w)",
    "from hybridspec.kernels.descriptors import NormDesc\nimport torch\nx = torch.zeros(3, device=device)\n"
    "same = x.device == y.device\nkind = x.dtype",
    "from hybridspec.kernels.reference import MODE_GREEDY\nfrom hybridspec.kernels.cpu.panels import PanelWeight",
]


@pytest.mark.parametrize("probe, rule", BAD_PROBES)
def test_checker_flags_each_bad_probe(probe, rule):
    assert rule in {r for _, r, _ in violations(probe)}, probe


@pytest.mark.parametrize("probe", CLEAN_PROBES)
def test_checker_passes_clean_probes(probe):
    assert violations(probe) == []
