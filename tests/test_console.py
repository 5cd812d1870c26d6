"""Text from records is shown as text, never markup or control sequences."""

from rich.console import Console

from harness.core.console import printable
from harness.notebook.recordview import case_line
from harness.notebook.records import Record


def render(markup: str) -> str:
    console = Console(width=300, no_color=True, record=True, file=open("/dev/null", "w"))
    console.print(markup, highlight=False)
    return console.export_text()


def test_printable_escapes_control_characters():
    assert printable("a\x1b[2Jb\rc\x07") == "a\\x1b[2Jb\\rc\\x07"
    assert printable("x" * 50, 10) == "x" * 9 + "…"
    assert printable("tab\there ü µs") == "tab\\there ü µs"


def test_case_line_shows_record_text_literally():
    rec = Record(id="R.1", run="R", t="2026-01-01T00:00:00Z", stage="A", arch="sm_90a",
                 case={"n": "[/x]", "flag": True}, status="crash",
                 error="bad shape [m, n] [/red]\x1b[2J\nsecond line")
    text = render(case_line(rec))  # rich would raise MarkupError
    assert "n=[/x],flag=true" in text and "bad shape [m, n] [/red]\\x1b[2J" in text
    assert "\x1b" not in text and "second line" not in text


def test_case_line_with_empty_error_and_odd_timing():
    rec = Record(id="R.1", run="R", t="t", stage="A", arch="cpu", case={"n": 4}, status="fail", error="",
                 timing={"us": 2.5, "peer_us": None})
    assert "2.50 µs" in render(case_line(rec))
