"""Record schema round-trip and forgiving reading."""

import json

from harness.notebook.records import Record, RecordWriter, read_records, stage_file, validate


def sample(i: int = 1, status: str = "pass") -> Record:
    return Record(
        id=f"r1.{i}", run="r1", t="2026-11-21T00:00:00Z", stage="A", arch="sm_90a",
        case={"hd": 64, "n": 128, "m": 128}, status=status,
        metrics={"S": {"cosine": 0.9999999, "rel_l2": 1e-7, "max_abs": 1e-5, "nonfinite": 0, "unwritten": 0}},
        timing={"us": 5.2, "tflops": 6.4}, compile={"key": "abc", "s": 1.0, "cached": False, "regs": 90, "spill": 0},
        env={"host": "h", "gpu": "NVIDIA H200", "cc": "9.0", "driver": "580", "cuda": "13.0", "torch": "2.11", "cute": "4.8.1"},
        code={"commit": "abc123", "dirty": False, "src": "0123456789ab"}, gpu=0,
    )


def test_round_trip_and_compactness(tmp_path):
    rec = sample()
    line = rec.to_json()
    assert "\n" not in line and len(line) < 700
    d = json.loads(line)
    assert validate(d) is None
    assert Record.from_dict(d) == rec
    assert d["v"] == 1 and list(d)[0] == "v"


def test_writer_appends_and_reader_skips_corrupt_lines(tmp_path):
    w = RecordWriter(tmp_path)
    w.write(sample(1))
    w.write(sample(2, "fail"))
    w.close()
    path = stage_file(tmp_path, "A")
    with open(path, "a") as fh:
        fh.write('{"v":1,"id":"trunc\n')           # truncated by a crash
        fh.write('{"v":1,"id":"x"}\n')              # parses, not a record
        fh.write("\x00\x01garbage\n")
    w = RecordWriter(tmp_path)
    w.write(sample(3))
    w.close()
    warn: list[str] = []
    recs = read_records(tmp_path, ["A"], warn)
    assert [r.id for r in recs] == ["r1.1", "r1.2", "r1.3"]
    assert len(warn) == 3
    assert all(f"{path}:" in w for w in warn)
    assert any(":3:" in w for w in warn)


def test_validate_rejects_wrong_version_and_status():
    d = json.loads(sample().to_json())
    assert validate({**d, "v": 99})
    assert validate({**d, "status": "great"})
    assert validate([1, 2])


def test_an_append_after_a_truncated_last_line_starts_on_a_fresh_line(tmp_path):
    """A cut-off last line is not glued to the next record."""
    w = RecordWriter(tmp_path)
    w.write(sample(1))
    w.close()
    path = stage_file(tmp_path, "A")
    with open(path, "a") as fh:
        fh.write('{"v":1,"id":"cut-off-by-a-crash"')   # no newline
    w = RecordWriter(tmp_path)
    w.write(sample(2))
    w.close()
    warn: list[str] = []
    assert [r.id for r in read_records(tmp_path, ["A"], warn)] == ["r1.1", "r1.2"]
    assert len(warn) == 1 and ":2:" in warn[0]


BAD_TYPES = [
    ("t", 5), ("code", "abc"), ("metrics", [1, 2]), ("timing", {"tflops": 3.0}), ("timing", {"us": -1}),
    ("timing", {"us": "fast"}), ("case", [1]), ("case", {"hd": [64]}), ("id", 3), ("status", None),
    ("error", 12), ("gpu", "0"), ("gpu", True), ("env", 7), ("compile", "x"), ("v", True), ("stage", ""),
    ("compile", {"regs": "[/x]"}), ("compile", {"spill": -1}), ("compile", {"inv": {"wgmma": 1.5}}),
    ("env", {"gpu": [1]}),
]


def test_reader_skips_records_of_the_wrong_type_with_file_line_warnings(tmp_path):
    path = stage_file(tmp_path, "A")
    path.parent.mkdir(parents=True)
    good = json.loads(sample(1).to_json())
    lines = [json.dumps({**good, key: value}) for key, value in BAD_TYPES]
    lines += [json.dumps({**good, "metrics": {"S": {"cosine": "high"}}}),
              json.dumps({**good, "metrics": {"S": 3}}),
              json.dumps(good).replace("0.9999999", "NaN"),
              json.dumps(good).replace("0.9999999", "Infinity"),
              "[" * 100000,
              json.dumps(good)]
    path.write_text("\n".join(lines) + "\n")
    warn: list[str] = []
    recs = read_records(tmp_path, ["A"], warn)
    assert [r.id for r in recs] == ["r1.1"] and len(recs) == 1
    assert len(warn) == len(lines) - 1, warn
    assert all(w.startswith(f"{path}:") for w in warn)
    assert all(isinstance(r, Record) for r in recs)


def test_unreadable_records_and_runs_files_warn_instead_of_crashing(tmp_path):
    from harness.notebook.records import read_notes, read_runs, runs_file, notes_file

    stage_file(tmp_path, "A").mkdir(parents=True)        # a folder where a file should be
    runs_file(tmp_path).mkdir(parents=True)
    notes_file(tmp_path).write_text(json.dumps({"run": "r1", "t": "x", "text": 5}) + "\n")
    warn: list[str] = []
    assert read_records(tmp_path, ["A"], warn) == [] and read_records(tmp_path, None, warn) == []
    assert read_runs(tmp_path, warn) == {} and read_notes(tmp_path, warn) == {}
    assert any("cannot be read" in w for w in warn) and any("skipped a note" in w for w in warn)


def test_bench_records_are_left_out_of_test_matrix_readers(tmp_path):
    from harness.notebook.records import BENCH_NOTE

    w = RecordWriter(tmp_path)
    w.write(sample(1))
    bench = sample(2)
    bench.note = BENCH_NOTE
    w.write(bench)
    w.close()
    assert [r.id for r in read_records(tmp_path, ["A"])] == ["r1.1"]
    assert [r.id for r in read_records(tmp_path, ["A"], bench=True)] == ["r1.1", "r1.2"]
    assert read_records(tmp_path, ["A"], bench=True)[1].is_bench


def test_a_remote_bench_record_passes_the_strict_check_and_text_in_a_number_does_not():
    """A remote bench record passes the channel's check; a text number or bad line does not."""
    good = {"v": 1, "id": "R.1", "run": "R", "t": "2026-11-27T00:00:00Z", "stage": "E", "arch": "sm_90a",
            "case": {"b": 2}, "status": "pass", "code": {"commit": "abc1234", "dirty": False, "src": "s"},
            "timing": {"us": 20.5, "spread": 0.02, "method": "graph", "gpu_name": "NVIDIA H100 80GB HBM3",
                       "checked": "every row", "roofline": "not calibrated (run dsv4-lab calibrate on this GPU)",
                       "bound_by": "memory", "peer_flashmla_sparse": "unsupported: kv_format simple",
                       "peer_torch_sparse_us": 800.0, "peer_torch_sparse_ratio": 39.0}}
    assert validate(good, strict=True) is None
    for key, value in (("peer_torch_sparse_us", "fast"), ("tflops", "many"), ("peer_us", "fast"),
                       ("method", "graph\x1b[2J"), ("checked", "x" * 400), ("peer_x_ratio", "2")):
        bad = {**good, "timing": {**good["timing"], key: value}}
        assert validate(bad, strict=True) == f"timing.{key} is not a number", key
