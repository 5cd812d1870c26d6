"""What the source hash of a Python file covers: its code without comments, trailing spaces and
blank lines. Kept free of the lab's other modules so any Python can run it (the cross-version
test does)."""

from __future__ import annotations

import io
import tokenize


def code_text(data: bytes) -> bytes:
    """A Python file's code without comments, trailing spaces and blank lines (what a .py file's hash
        covers).  Comments are found by the tokenizer and cut from the source text itself, so the
        result does not depend on the Python version's token stream.  ValueError when the file does
        not tokenize."""
    try:
        encoding, _ = tokenize.detect_encoding(io.BytesIO(data).readline)
        lines = data.decode(encoding).splitlines()
        cuts: dict[int, int] = {}
        for tok in tokenize.tokenize(io.BytesIO(data).readline):
            if tok.type == tokenize.COMMENT:
                cuts[tok.start[0]] = min(cuts.get(tok.start[0], tok.start[1]), tok.start[1])
    except (tokenize.TokenError, SyntaxError, UnicodeDecodeError, LookupError) as exc:
        raise ValueError(str(exc)) from None
    kept = []
    for row, line in enumerate(lines, 1):
        line = line[: cuts[row]] if row in cuts else line
        line = line.rstrip()
        if line:
            kept.append(line)
    return "\n".join(kept).encode("utf-8", "surrogatepass")
