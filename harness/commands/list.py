"""`dsv4-lab list`: the stages, their archs and matrix sizes, and whether each arch runs here."""

from __future__ import annotations

from harness.commands.base import Command, spec_here


def list_stages() -> None:
    """Stages, their archs, matrix sizes, and whether each arch can run here."""
    from rich.markup import escape
    from rich.table import Table

    from harness.core.environment import gpu_capabilities
    from harness.spec.matrix import count
    from harness.execution.report import make_console

    spec = spec_here()
    caps = gpu_capabilities()
    runnable = {"cpu"} | {a for _, a in caps.values() if a}
    gpus = ", ".join(sorted({n for n, _ in caps.values()})) or "no GPU"
    table = Table(title=f"dsv4-lab stages — this machine: {gpus}")
    for col in ("stage", "title", "axes", "cases", "archs"):
        table.add_column(col)
    for st in spec.stages.values():
        n = count(st)
        axes = " × ".join(f"{k}{{{','.join(map(str, v))}}}" for k, v in st.matrix.items())
        if st.suite is not None:  # a suite stage: its listed cases, not a product (docs/SUITES.md)
            axes = f"suite: listed cases over {', '.join(st.matrix)}"
        elif st.cases is not None:  # a matrix with `more:`: a union of products
            axes = f"{axes} (the matrix and its more: products)"
        archs = ", ".join(f"{a} ({'runs here' if a in runnable else 'compile only'})" for a in st.kernels)
        table.add_row(escape(st.name), escape(st.title), escape(axes), str(n), escape(archs))
    make_console().print(table)


COMMANDS = [Command("list", list_stages)]
