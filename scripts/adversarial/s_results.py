import sys, lzma, json; sys.path.insert(0, __import__("os").path.dirname(__file__))
from sweep import *
from concurrent.futures import ThreadPoolExecutor
golden()
G = BASE / "lab"
REC = (G / "results/records/OK.jsonl").read_text()
BL = (G / "results/baselines.yaml").read_text()
L1, L2 = REC.splitlines()
r1 = json.loads(L1)
M = {}  # name -> (mutator(lab), cmds, want)
def w(rel, data, mode="t"):
    def f(lab):
        p = lab / rel; p.parent.mkdir(parents=True, exist_ok=True)
        if p.is_symlink() or p.exists(): p.unlink()
        p.write_bytes(data if isinstance(data, bytes) else data.encode())
    return f
def a(rel, data):
    def f(lab):
        with open(lab / rel, "ab") as fh: fh.write(data if isinstance(data, bytes) else data.encode())
    return f
def sym(rel, target):
    def f(lab):
        p = lab / rel
        if p.exists() or p.is_symlink(): p.unlink() if not p.is_dir() else shutil.rmtree(p)
        p.parent.mkdir(parents=True, exist_ok=True); p.symlink_to(target)
    return f
def fifo(rel):
    def f(lab):
        p = lab / rel
        if p.exists() or p.is_symlink(): p.unlink()
        os.mkfifo(p)
    return f
def mkdir(rel):
    def f(lab):
        p = lab / rel
        if p.exists() or p.is_symlink(): p.unlink()
        p.mkdir()
    return f
def rec(**kw):
    r = dict(r1); r.update(kw); return json.dumps(r)
R = "results/records/OK.jsonl"
B = "results/baselines.yaml"
GATE = [["gate", "--no-run"], ["dashboard"], ["baseline", "show"], ["history", "stage-OK", "--n", "16"]]
ACC = [["baseline", "accept", "stage-OK"]]
# records lines
for nm, line in [("garbage", "not json"), ("truncated", L1[:40]), ("list_line", "[1,2]"), ("null_line", "null"),
                 ("num_line", "5"), ("empty_obj", "{}"), ("status_int", rec(status=5)), ("status_unknown", rec(status="great")),
                 ("metrics_str", rec(metrics="pass")), ("metrics_nan", rec(metrics={"out": {"cosine": float("nan"), "rel_l2": 0, "max_abs": 0}})),
                 ("case_list", rec(case=[1])), ("case_bad_axis", rec(case={"zz": 1})), ("stage_unknown", rec(stage="ZZ")),
                 ("arch_weird", rec(arch="sm_999")), ("id_dup", rec()), ("id_forged_other_run", rec(id="20990101-000000-ffff.1", run="20990101-000000-ffff")),
                 ("v2", rec(v=2)), ("code_missing", {k: v for k, v in r1.items() if k != "code"} and json.dumps({k: v for k, v in r1.items() if k != "code"})),
                 ("t_bad", rec(t="yesterday")), ("huge_line", rec(note="x" * (64 * 1024 * 1024))), ("deep_json", "[" * 100000 + "]" * 100000),
                 ("big_int", rec(case={"n": 10 ** 5000}) if False else '{"v":1,"case":{"n":' + "9" * 5000 + '}}'),
                 ("nul_bytes", "\x00" * 100), ("bad_utf8", b"\xff\xfe{}".decode("latin-1")), ("nan_literal", L1.replace('"cosine":0.9999999999999996', '"cosine":NaN')),
                 ("inf_literal", L1.replace('"cosine":0.9999999999999996', '"cosine":Infinity')),
                 ("dup_json_keys", L1[:-1] + ',"status":"fail"}')]:
    M["rec_" + nm] = (a(R, line + "\n"), GATE + ACC, "any")
M["rec_no_trailing_newline_trunc"] = (a(R, L1[:50]), GATE + ACC + [["run", "stage-OK"]], "any")
M["rec_crlf"] = (w(R, REC.replace("\n", "\r\n")), GATE, "any")
M["rec_all_garbage"] = (w(R, "garbage\n" * 10), GATE, "fail")
M["rec_empty"] = (w(R, ""), GATE, "fail")
M["rec_missing"] = (lambda lab: (lab / R).unlink(), GATE, "fail")
M["records_dir_missing"] = (lambda lab: shutil.rmtree(lab / "results/records"), GATE, "fail")
M["rec_hand_pass_fail"] = (a(R, rec(id=r1["id"][:-1] + "9", status="pass", metrics={"out": {"cosine": 0.1, "rel_l2": 0.9, "max_abs": 5, "nonfinite": 0, "unwritten": 0}}) + "\n"), [["gate", "--no-run"]], "fail")
M["rec_forged_src_pass"] = (a(R, rec(id=r1["id"][:-1] + "8", code={**r1["code"], "src": "000000000000"}) + "\n"), [["gate", "--no-run"]], "any")
M["rec_newer_fail"] = (a(R, rec(id="29990101-000000-aaaa.1", run="29990101-000000-aaaa", t="2999-01-01T00:00:00Z", status="fail") + "\n"), [["gate", "--no-run"]], "fail")
M["rec_symlink_devzero"] = (sym(R, "/dev/zero"), GATE, "fail")
M["rec_symlink_devurandom"] = (sym(R, "/dev/urandom"), GATE, "fail")
M["rec_symlink_outside"] = (sym(R, "/etc/passwd"), GATE, "fail")
M["rec_symlink_loop"] = (sym(R, "OK.jsonl"), GATE, "fail")
M["rec_fifo"] = (fifo(R), GATE + [["run", "stage-OK"]], "fail")
M["rec_dir"] = (mkdir(R), GATE + [["run", "stage-OK"]], "fail")
M["records_is_file"] = (lambda lab: (shutil.rmtree(lab / "results/records"), (lab / "results/records").write_text("x")), GATE + [["run", "stage-OK"]], "fail")
M["results_is_file"] = (lambda lab: (shutil.rmtree(lab / "results"), (lab / "results").write_text("x")), GATE + [["run", "stage-OK"]], "fail")
M["results_symlink_devnull"] = (lambda lab: (shutil.rmtree(lab / "results"), (lab / "results").symlink_to("/dev/null")), GATE, "fail")
M["rec_other_stage_file"] = (w("results/records/ZZ.jsonl", L1 + "\n"), GATE, "any")
M["rec_weird_name"] = (w("results/records/..jsonl", L1 + "\n"), GATE, "any")
M["runs_fifo"] = (fifo("results/runs.jsonl"), GATE + [["run", "stage-OK"]], "any")
M["runs_devzero"] = (sym("results/runs.jsonl", "/dev/zero"), GATE + [["run", "stage-OK"]], "any")
M["runs_garbage"] = (a("results/runs.jsonl", "garbage\n{\"run\":5}\n[]\n"), GATE + [["run", "stage-OK"]], "any")
M["runs_dir"] = (mkdir("results/runs.jsonl"), GATE + [["run", "stage-OK"]], "any")
M["envs_fifo"] = (fifo("results/envs.jsonl.xz"), GATE + [["run", "stage-OK"]], "any")
M["envs_devzero"] = (sym("results/envs.jsonl.xz", "/dev/zero"), GATE + [["run", "stage-OK"]], "any")
M["envs_notxz"] = (w("results/envs.jsonl.xz", "hello"), GATE + [["run", "stage-OK"]], "any")
M["envs_bomb"] = (w("results/envs.jsonl.xz", lzma.compress(b"\n" * (300 * 1024 * 1024), preset=9)), GATE + [["run", "stage-OK"]], "any")
M["envs_bomb_oneline"] = (w("results/envs.jsonl.xz", lzma.compress(b"a" * (300 * 1024 * 1024), preset=9)), GATE, "any")
M["envs_truncated"] = (lambda lab: (lab / "results/envs.jsonl.xz").write_bytes((lab / "results/envs.jsonl.xz").read_bytes()[:30]), GATE + [["run", "stage-OK"]], "any")
M["envs_garbage_json"] = (w("results/envs.jsonl.xz", lzma.compress(b"garbage\n[1]\n{\"id\":5}\n")), GATE + [["run", "stage-OK"]], "any")
M["inv_devzero"] = (sym("results/inventories.jsonl.xz", "/dev/zero"), GATE, "any")
M["inv_bomb"] = (w("results/inventories.jsonl.xz", lzma.compress(b"{}\n" * (100 * 1024 * 1024), preset=9)), GATE, "any")
M["inv_garbage"] = (w("results/inventories.jsonl.xz", lzma.compress(b"[1]\nnull\n{\"k\":[]}\n")), GATE, "any")
M["calib_garbage"] = (w("results/calibration.jsonl", "x\n[1]\n{\"peak\":\"a\"}\n"), GATE, "any")
M["notes_garbage"] = (w("results/notes.jsonl", "x\n[1]\n{\"run\":5,\"text\":[1]}\n"), GATE + [["show", r1["run"]]], "any")
M["notes_fifo"] = (fifo("results/notes.jsonl"), GATE + [["show", r1["run"]]], "any")
# baselines
def bl(text): return w(B, text)
ENT = BL.split("baselines:\n")[1]
for nm, text in [
    ("dup_stage", BL + ENT), ("dup_arch", BL + "    cpu: {}\n"), ("dup_case", BL + "      n=16: {record: x, src: y, metrics: {}}\n"),
    ("dup_top", BL + "version: 1\n"), ("dup_baselines", BL + "baselines: {}\n"),
    ("empty", ""), ("version_only", "version: 1\n"), ("baselines_empty", "version: 1\nbaselines: {}\n"), ("baselines_null", "version: 1\nbaselines:\n"),
    ("baselines_list", "version: 1\nbaselines: [1]\n"), ("version_2", BL.replace("version: 1", "version: 2")), ("version_str", BL.replace("version: 1", "version: x")),
    ("no_version", BL.replace("version: 1\n", "")), ("stage_null", BL.replace("  OK:\n    cpu:", "  OK:\n  OK2:\n    cpu:")),
    ("arch_null", BL.replace("    cpu:\n", "    cpu:\n    sm_90a:\n")), ("case_null", BL.replace("      n=32:\n", "      n=64:\n      n=32:\n")),
    ("metrics_str", BL.replace("metrics: {out: {cosine: 1.0, rel_l2: 2.8457437e-08", "metrics: 'x'\n        m2: {out: {cosine: 1.0, rel_l2: 2.8457437e-08")),
    ("cos_nan", BL.replace("cosine: 1.0", "cosine: .nan", 1)), ("cos_str", BL.replace("cosine: 1.0", "cosine: 'high'", 1)),
    ("cos_big", BL.replace("cosine: 1.0", "cosine: 2", 1)), ("rel_huge", BL.replace("rel_l2: 2.8457437e-08", "rel_l2: 1e300", 1)),
    ("rel_neg", BL.replace("rel_l2: 2.8457437e-08", "rel_l2: -1", 1)), ("maxabs_inf", BL.replace("max_abs: 1.1920929e-07", "max_abs: .inf", 1)),
    ("tol_loose", BL.replace("        src: 8a1c092fb7a8\n", "        src: 8a1c092fb7a8\n        tolerance: {cosine: 2, rel_l2: 1e300}\n", 1)),
    ("tol_loose2", BL.replace("        src: 8a1c092fb7a8\n", "        src: 8a1c092fb7a8\n        tolerances: {out: {cosine_min: -1, rel_l2_max: 1e300}}\n", 1)),
    ("tol_loose3", BL.replace("        src: 8a1c092fb7a8\n", "        src: 8a1c092fb7a8\n        tolerances: {out: {cosine_min: 0.1}}\n", 1)),
    ("unknown_key", BL.replace("        src: 8a1c092fb7a8\n", "        src: 8a1c092fb7a8\n        colour: red\n", 1)),
    ("metrics_empty", BL.replace("metrics: {out: {cosine: 1.0, rel_l2: 2.8457437e-08, max_abs: 1.1920929e-07}}", "metrics: {}", 1)),
    ("metrics_out_empty", BL.replace("metrics: {out: {cosine: 1.0, rel_l2: 2.8457437e-08, max_abs: 1.1920929e-07}}", "metrics: {out: {}}", 1)),
    ("metrics_other_out", BL.replace("metrics: {out: {cosine: 1.0, rel_l2: 2.8457437e-08, max_abs: 1.1920929e-07}}", "metrics: {zz: {cosine: 1.0}}", 1)),
    ("no_metrics", BL.replace("        metrics: {out: {cosine: 1.0, rel_l2: 2.8457437e-08, max_abs: 1.1920929e-07}}\n", "", 1)),
    ("record_forged", BL.replace("record: " + r1["id"], "record: 20990101-000000-ffff.1", 1)),
    ("record_int", BL.replace("record: " + r1["id"], "record: 5", 1)),
    ("src_forged", BL.replace("src: 8a1c092fb7a8", "src: 000000000000", 1)),
    ("kind_bad", BL.replace("        src: 8a1c092fb7a8\n", "        src: 8a1c092fb7a8\n        kind: nonsense\n", 1)),
    ("kind_compile_on_run", BL.replace("        src: 8a1c092fb7a8\n", "        src: 8a1c092fb7a8\n        kind: compile\n", 1)),
    ("case_bad_label", BL.replace("n=16:", "n=999:", 1)), ("case_garbage_label", BL.replace("n=16:", "'!!!':", 1)),
    ("stage_unknown", BL.replace("  OK:\n", "  ZZ:\n", 1)), ("arch_unknown", BL.replace("    cpu:\n", "    sm_999:\n", 1)),
    ("python_tag", BL.replace("version: 1", "version: !!python/object/apply:os.system ['touch /tmp/adv1/pwned2']")),
    ("anchor", BL.replace("metrics: {out: {cosine: 1.0, rel_l2: 2.8457437e-08, max_abs: 1.1920929e-07}}", "metrics: &m {out: {cosine: 1.0, rel_l2: 2.8457437e-08, max_abs: 1.1920929e-07}}", 1).replace("metrics: {out: {cosine: 1.0, rel_l2: 2.087724e-08, max_abs: 1.1920929e-07}}", "metrics: *m")),
    ("merge", BL.replace("      n=32:\n", "      n=32:\n        <<: {record: x}\n")),
    ("bom", "\ufeff" + BL), ("tabs", BL.replace("        record:", "\trecord:", 1)), ("deep", BL + "x: " + "[" * 500 + "]" * 500 + "\n"),
    ("laughs", "a: &a [x,x,x,x,x,x,x,x,x]\n" + "".join(f"{chr(98+i)}: &{chr(98+i)} [" + ",".join(["*" + chr(97+i)] * 9) + "]\n" for i in range(8)) + BL),
    ("huge", BL + "# " + "x" * (80 * 1024 * 1024) + "\n"), ("bad_utf8", None), ("nul", BL.replace("OK", "O\x00K", 1)),
    ("conflict_markers", BL.replace("      n=32:\n", "<<<<<<< HEAD\n      n=32:\n=======\n      n=33:\n>>>>>>> x\n"))]:
    M["bl_" + nm] = (bl(text) if text is not None else w(B, BL.encode().replace(b"OK", b"O\xffK", 1)), GATE + ACC, "fail")
for nm in ("bl_anchor", "bl_bom", "bl_unknown_key_", "bl_stage_unknown", "bl_arch_unknown", "bl_src_forged", "bl_record_forged", "bl_dup_top_"): pass
M["bl_symlink_devzero"] = (sym(B, "/dev/zero"), GATE + ACC, "fail")
M["bl_fifo"] = (fifo(B), GATE + ACC, "fail")
M["bl_dir"] = (mkdir(B), GATE + ACC, "fail")
M["bl_missing"] = (lambda lab: (lab / B).unlink(), [["gate", "--no-run"]], "fail")
M["bl_symlink_outside"] = (lambda lab: (Path(str(lab) + "_b.yaml").write_text(BL), (lab / B).unlink(), (lab / B).symlink_to(str(lab) + "_b.yaml")), GATE + ACC, "any")
M["bl_lock_dir"] = (mkdir("results/.baselines.lock"), ACC, "fail")
M["bl_lock_fifo"] = (fifo("results/.baselines.lock"), ACC, "any")
M["bl_lock_symlink"] = (sym("results/.baselines.lock", "/dev/zero"), ACC, "any")
def cachemut(fn):
    def f(lab):
        c = Path(str(lab).replace("/lab", "/cache")) / "baselines"
        for p in c.glob("*.json"): fn(p)
    return f
M["cache_bl_null"] = (cachemut(lambda p: p.write_text("null")), [["gate", "--no-run"]] + ACC, "any")
M["cache_bl_garbage"] = (cachemut(lambda p: p.write_text("{garbage")), [["gate", "--no-run"]] + ACC, "any")
M["cache_bl_empty_obj"] = (cachemut(lambda p: p.write_text("{}")), [["gate", "--no-run"]] + ACC, "any")
M["cache_bl_wrong"] = (cachemut(lambda p: p.write_text(json.dumps({"version": 1, "baselines": {}}))), [["gate", "--no-run"]] + ACC, "any")
M["cache_bl_loosened"] = (cachemut(lambda p: p.write_text(p.read_text().replace("1.0", "0.0"))), [["gate", "--no-run"]], "any")
M["cache_bl_fifo"] = (cachemut(lambda p: (p.unlink(), os.mkfifo(p))), [["gate", "--no-run"]] + ACC, "any")
M["cache_bl_devzero"] = (cachemut(lambda p: (p.unlink(), p.symlink_to("/dev/zero"))), [["gate", "--no-run"]] + ACC, "any")
M["cache_bl_dir"] = (cachemut(lambda p: (p.unlink(), p.mkdir())), [["gate", "--no-run"]] + ACC, "any")

flt = sys.argv[1] if len(sys.argv) > 1 else ""
OK0 = {"bl_anchor", "bl_bom", "bl_symlink_outside"}
def one(item):
    i, (name, (mut, cmds, want)) = item
    lab, cache = fresh("r%d" % i)
    mut(lab)
    blines = sum(1 for _ in BL.splitlines())
    recs_before = {}
    pr = lab / R
    if pr.is_file() and not pr.is_symlink(): recs_before[R] = pr.read_bytes()
    lines = []
    for args in cmds:
        rc, out, err = cli(lab, cache, args, timeout=60)
        probs, _ = judge(name, args, rc, out, err, want_fail=False)
        if want == "fail" and rc == 0 and name not in OK0 and args[0] in ("gate",): probs.append("EXIT0")
        if args[0] == "baseline" and args[1] == "accept" and rc == 0 and name.startswith("bl_") and name not in OK0: probs.append("ACCEPT0")
        if pr.is_file() and not pr.is_symlink() and R in recs_before and not pr.read_bytes().startswith(recs_before[R]): probs.append("RECLOST")
        # baselines lost: after accept, count of entries with 'record:'
        pb = lab / B
        try:
            if pb.is_file() and args[1:2] == ["accept"]:
                nrec = pb.read_text(errors="replace").count("record:")
                if nrec < 2: probs.append(f"BL_COUNT={nrec}")
        except Exception: pass
        lines.append((name, args, rc, out, err, probs))
    return lines
items = [(i, kv) for i, kv in enumerate(M.items()) if flt in kv[0]]
with ThreadPoolExecutor(3) as ex:
    for lines in ex.map(one, items):
        for l in lines: report(l[0], l[1], l[2], l[3], l[4], l[5])
print("total variants", len(items))
