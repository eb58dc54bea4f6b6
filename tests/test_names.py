"""Every name a function of `afd_ray` reads is defined: a parameter, a local, an
enclosing function's, a module-level name or a builtin.

Python finds an undefined name only when the line runs. A refactor left one in the
FFN server's EP path (`moe`, 2026-12-03), which only an EP=2 layout reaches: in the
suite only the chaos module's scale to 2A:2F, after 20 minutes. `symtable` (the
compiler's own scopes) finds it at once.
"""

from __future__ import annotations

import builtins
import symtable
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "afd_ray"


def undefined_names(source: str, filename: str) -> list[tuple[str, int, str]]:
    """(scope, line, name) of each name read in `source` that no scope defines."""
    top = symtable.symtable(source, filename, "exec")
    module = {s.get_name() for s in top.get_symbols() if s.is_assigned() or s.is_imported() or s.is_namespace()}
    found = []

    def walk(table: symtable.SymbolTable) -> None:
        for symbol in table.get_symbols():
            name = symbol.get_name()
            if (
                symbol.is_referenced() and symbol.is_global() and not symbol.is_declared_global()
                and name not in module and not hasattr(builtins, name) and name not in ("__file__", "__name__")
            ):  # fmt: skip
                found.append((table.get_name(), table.get_lineno(), name))
        for child in table.get_children():
            walk(child)

    walk(top)
    return found


def test_the_check_finds_an_undefined_name() -> None:
    source = "import torch\n\ndef f(stack):\n    return torch.zeros(moe[0])\n"
    assert undefined_names(source, "f.py") == [("f", 3, "moe")]


def test_no_function_of_the_package_reads_an_undefined_name() -> None:
    found = {
        str(path.relative_to(PACKAGE.parent)): names
        for path in sorted(PACKAGE.rglob("*.py"))
        if (names := undefined_names(path.read_text(), str(path)))
    }
    assert found == {}
