"""A run over several GPUs says which GPU ran each case."""

import io

from rich.console import Console

from harness.notebook.records import Record
from harness.execution.report import results_table


def _rec(i: int, gpu: int | None) -> Record:
    return Record(
        id=f"r.{i}", run="r", t="2026-11-22T00:00:00Z", stage="A", arch="sm_90a", case={"hd": 64, "n": 128 * i},
        status="pass", metrics={"S": {"cosine": 0.9999999, "rel_l2": 1e-7, "max_abs": 1e-6, "nonfinite": 0,
                                      "unwritten": 0}},
        code={"commit": "x", "dirty": False, "src": "y"}, gpu=gpu,
    )


def _render(records: list[Record]) -> list[str]:
    out = io.StringIO()
    Console(file=out, width=200, color_system=None).print(results_table(records))
    return out.getvalue().splitlines()


def test_gpu_column_only_when_the_run_used_several_gpus():
    lines = _render([_rec(1, 0), _rec(2, 1)])
    header = next(line for line in lines if "stage" in line)
    assert header.rstrip(" ┃│|").endswith("gpu")
    rows = [line for line in lines if "n=128" in line or "n=256" in line]
    assert rows[0].rstrip(" ┃│|").endswith("0") and rows[1].rstrip(" ┃│|").endswith("1")
    one_gpu = _render([_rec(1, 0), _rec(2, 0)])
    assert not any(line.rstrip(" ┃│|").endswith("gpu") for line in one_gpu)
