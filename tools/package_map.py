"""The package map of docs/design.md, made from the tree: every package with the
first sentence of its `__init__` docstring, then every module with the start of
its own docstring. `tests/test_layering.py` checks that the map in design.md is
this script's output, so a module added, moved or removed shows up there.

    python tools/package_map.py            # print the map
    python tools/package_map.py --write    # replace the map in docs/design.md
"""
from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DESIGN = REPO / "docs" / "design.md"
BEGIN, END = "<!-- package map: python tools/package_map.py --write -->", "<!-- end of package map -->"
# the folders of the package, by dotted name; kernels/ and checkpoints/ sit at the top of the repository
ROOTS = {"hybridspec": REPO / "hybridspec", "hybridspec.kernels": REPO / "kernels",
         "hybridspec.checkpoints": REPO / "checkpoints"}
WIDTH = 112  # a line of the map at most


def summary(path: Path, width: int) -> str:
    """The first paragraph of the module's docstring on one line, cut at a word before `width`."""
    doc = ast.get_docstring(ast.parse(path.read_text())) or ""
    text = " ".join(doc.strip().split("\n\n")[0].split())
    if len(text) <= width:
        return text
    return text[: text.rfind(" ", 0, width - 3)].rstrip(",;:") + " …"


def packages() -> dict[str, Path]:
    """Every package folder by dotted name, the links in hybridspec/ not followed twice."""
    found = {}
    for name, root in ROOTS.items():
        for folder in sorted([root, *(p for p in root.rglob("*") if p.is_dir())]):
            rel = folder.relative_to(root).parts
            if "__pycache__" in rel or "assets" in rel or (name == "hybridspec" and rel[:1] in (("kernels",), ("checkpoints",))):
                continue
            if any(folder.glob("*.py")):
                found[".".join((name, *rel))] = folder
    return dict(sorted(found.items()))


def package_map() -> str:
    lines = []
    for name, folder in packages().items():
        init = folder / "__init__.py"
        where = folder.relative_to(REPO).as_posix() + "/"
        head = f"{where:28s}" + (summary(init, WIDTH - 28) if init.exists() else "(namespace package)")
        lines.append(head)
        for module in sorted(folder.glob("*.py")):
            if module.name == "__init__.py":
                continue
            lines.append(f"    {module.name:24s}" + summary(module, WIDTH - 28))
    return "\n".join(lines)


def block() -> str:
    return f"{BEGIN}\n```\n{package_map()}\n```\n{END}"


def written_block(text: str) -> str:
    match = re.search(re.escape(BEGIN) + ".*?" + re.escape(END), text, flags=re.S)
    return match.group(0) if match else ""


def main(argv: list[str]) -> int:
    if argv == ["--write"]:
        text = DESIGN.read_text()
        old = written_block(text)
        if not old:
            print(f"{DESIGN}: no package map between {BEGIN!r} and {END!r}", file=sys.stderr)
            return 1
        DESIGN.write_text(text.replace(old, block()))
        return 0
    print(package_map())
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
