import sys; sys.path.insert(0, __import__("os").path.dirname(__file__))
from sweep import *
from concurrent.futures import ThreadPoolExecutor
golden()
ORIG = (BASE / "lab" / "stages.yaml").read_text()
OKB = ORIG.split("  BAD:")[0]
V = {}
def sub(name, old, new, text=None):
    t = text or ORIG
    assert old in t, name
    V[name] = t.replace(old, new, 1)
V["empty"] = ""
V["only_comment"] = "# nothing\n"
V["bom"] = "\ufeff" + ORIG
V["bom_utf16"] = None  # bytes below
V["tabs"] = ORIG.replace("    title: out = a + b", "\ttitle: out = a + b")
V["null_doc"] = "null\n"
V["list_top"] = "- 1\n- 2\n"
V["scalar_top"] = "hello\n"
V["two_docs"] = ORIG + "---\nversion: 1\n"
V["version_2"] = ORIG.replace("version: 1", "version: 2")
V["version_str"] = ORIG.replace("version: 1", "version: '1'")
V["version_float"] = ORIG.replace("version: 1", "version: 1.0")
V["version_true"] = ORIG.replace("version: 1", "version: true")
V["no_version"] = ORIG.replace("version: 1\n", "")
V["no_stages"] = "version: 1\n"
V["stages_null"] = "version: 1\nstages:\n"
V["stages_empty"] = "version: 1\nstages: {}\n"
V["stages_list"] = "version: 1\nstages: [OK]\n"
V["dup_stage"] = OKB + OKB.split("stages:\n")[1]
V["dup_key_title"] = ORIG.replace("    title: out = a + b, correct\n", "    title: out = a + b, correct\n    title: again\n")
V["dup_top"] = ORIG + "version: 1\n"
V["unknown_key"] = ORIG.replace("    timeout_s: 20\n", "    timeout_s: 20\n    colour: red\n")
V["unknown_top"] = ORIG + "extra: 1\n"
V["bad_id_lower"] = ORIG.replace("  OK:\n", "  ok:\n")
V["bad_id_unicode"] = ORIG.replace("  OK:\n", "  ÖK:\n")
V["bad_id_stage"] = ORIG.replace("  OK:\n", "  stage-ok:\n")
V["id_normalise_clash"] = ORIG.replace("  BAD:\n", "  stage-OK:\n")
V["id_int"] = ORIG.replace("  OK:\n", "  1:\n")
V["id_null"] = ORIG.replace("  OK:\n", "  ~:\n")
V["id_long"] = ORIG.replace("  OK:\n", "  " + "A" * 5000 + ":\n")
V["title_multiline"] = ORIG.replace("title: out = a + b, correct", "title: \"a\\nb\"")
V["title_list"] = ORIG.replace("title: out = a + b, correct", "title: [a]")
V["title_empty"] = ORIG.replace("title: out = a + b, correct", "title: ''")
V["title_ctrl"] = ORIG.replace("title: out = a + b, correct", "title: \"a\\x1b[31mred\"")
V["title_huge"] = ORIG.replace("title: out = a + b, correct", "title: " + "x" * 200000)
V["title_rtl"] = ORIG.replace("title: out = a + b, correct", "title: \"\\u202e evil\"")
V["dir_missing"] = ORIG.replace("dir: stages/fake\n    kernels: {cpu: {module: stages.fake.cpu, entry: Add}}", "dir: stages/nope\n    kernels: {cpu: {module: stages.fake.cpu, entry: Add}}")
V["dir_abs"] = ORIG.replace("dir: stages/fake", "dir: /etc", 1)
V["dir_dotdot"] = ORIG.replace("dir: stages/fake", "dir: ../..", 1)
V["dir_file"] = ORIG.replace("dir: stages/fake", "dir: stages/fake/cpu.py", 1)
V["dir_int"] = ORIG.replace("dir: stages/fake", "dir: 5", 1)
V["dir_dot"] = ORIG.replace("dir: stages/fake", "dir: .", 1)
V["dir_empty"] = ORIG.replace("dir: stages/fake", "dir: ''", 1)
V["kernels_empty"] = ORIG.replace("kernels: {cpu: {module: stages.fake.cpu, entry: Add}}", "kernels: {}")
V["kernels_list"] = ORIG.replace("kernels: {cpu: {module: stages.fake.cpu, entry: Add}}", "kernels: [cpu]")
V["kernel_arch_bad"] = ORIG.replace("kernels: {cpu: {module", "kernels: {sm80: {module", 1)
V["kernel_module_missing"] = ORIG.replace("module: stages.fake.cpu, entry: Add", "module: stages.fake.nope, entry: Add")
V["kernel_entry_missing"] = ORIG.replace("entry: Add", "entry: Nope")
V["kernel_module_os"] = ORIG.replace("module: stages.fake.cpu, entry: Add", "module: os, entry: system")
V["kernel_module_dotdot"] = ORIG.replace("module: stages.fake.cpu, entry: Add", "module: ..etc, entry: Add")
V["kernel_module_slash"] = ORIG.replace("module: stages.fake.cpu, entry: Add", "module: stages/fake/cpu.py, entry: Add")
V["kernel_module_int"] = ORIG.replace("module: stages.fake.cpu, entry: Add", "module: 7, entry: Add")
V["kernel_entry_list"] = ORIG.replace("entry: Add", "entry: [Add]")
V["kernel_entry_dotted"] = ORIG.replace("entry: Add", "entry: Add.__init__")
V["kernel_extra_key"] = ORIG.replace("entry: Add", "entry: Add, x: 1")
V["kernel_no_module"] = ORIG.replace("{cpu: {module: stages.fake.cpu, entry: Add}}", "{cpu: {entry: Add}}")
V["kernel_str"] = ORIG.replace("{cpu: {module: stages.fake.cpu, entry: Add}}", "{cpu: stages.fake.cpu}")
V["tensors_nocolon"] = ORIG.replace("tensors: oracles.add:tensors", "tensors: oracles.add.tensors", 1)
V["tensors_missing_fn"] = ORIG.replace("tensors: oracles.add:tensors", "tensors: oracles.add:nope", 1)
V["tensors_missing_mod"] = ORIG.replace("tensors: oracles.add:tensors", "tensors: oracles.nope:tensors", 1)
V["tensors_builtin"] = ORIG.replace("tensors: oracles.add:tensors", "tensors: builtins:eval", 1)
V["tensors_two_colon"] = ORIG.replace("tensors: oracles.add:tensors", "tensors: oracles.add:ten:sors", 1)
V["oracle_os"] = ORIG.replace("oracle: oracles.add:reference", "oracle: os:system", 1)
V["oracle_subprocess"] = ORIG.replace("oracle: oracles.add:reference", "oracle: subprocess:run", 1)
V["oracle_dunder"] = ORIG.replace("oracle: oracles.add:reference", "oracle: oracles.add:__builtins__", 1)
V["oracle_attr_not_fn"] = ORIG.replace("oracle: oracles.add:reference", "oracle: oracles.add:TensorSpec", 1)
V["flops_bad"] = ORIG.replace("    oracle: oracles.add:reference\n", "    oracle: oracles.add:reference\n    flops: oracles.add:nope\n", 1)
V["flops_returns_wrong"] = ORIG.replace("    oracle: oracles.add:reference\n", "    oracle: oracles.add:reference\n    flops: oracles.add:tensors\n", 1)
V["matrix_empty"] = ORIG.replace("matrix: {n: [16, 32]}", "matrix: {}")
V["matrix_null"] = ORIG.replace("matrix: {n: [16, 32]}", "matrix:")
V["matrix_list"] = ORIG.replace("matrix: {n: [16, 32]}", "matrix: [16, 32]")
V["axis_empty_list"] = ORIG.replace("matrix: {n: [16, 32]}", "matrix: {n: []}")
V["axis_scalar"] = ORIG.replace("matrix: {n: [16, 32]}", "matrix: {n: 16}")
V["axis_dup_values"] = ORIG.replace("matrix: {n: [16, 32]}", "matrix: {n: [16, 16]}")
V["axis_dup_int_float"] = ORIG.replace("matrix: {n: [16, 32]}", "matrix: {n: [16, 16.0]}")
V["axis_dup_bool_int"] = ORIG.replace("matrix: {n: [16, 32]}", "matrix: {n: [1, true]}")
V["axis_nan"] = ORIG.replace("matrix: {n: [16, 32]}", "matrix: {n: [.nan]}")
V["axis_inf"] = ORIG.replace("matrix: {n: [16, 32]}", "matrix: {n: [.inf]}")
V["axis_huge_int"] = ORIG.replace("matrix: {n: [16, 32]}", "matrix: {n: [" + "9" * 5000 + "]}")
V["axis_big_int"] = ORIG.replace("matrix: {n: [16, 32]}", "matrix: {n: [1000000000000]}")
V["axis_neg"] = ORIG.replace("matrix: {n: [16, 32]}", "matrix: {n: [-16]}")
V["axis_zero"] = ORIG.replace("matrix: {n: [16, 32]}", "matrix: {n: [0]}")
V["axis_float"] = ORIG.replace("matrix: {n: [16, 32]}", "matrix: {n: [16.5]}")
V["axis_nested"] = ORIG.replace("matrix: {n: [16, 32]}", "matrix: {n: [[16]]}")
V["axis_map_value"] = ORIG.replace("matrix: {n: [16, 32]}", "matrix: {n: [{a: 1}]}")
V["axis_null_value"] = ORIG.replace("matrix: {n: [16, 32]}", "matrix: {n: [~]}")
V["axis_name_option"] = ORIG.replace("matrix: {n: [16, 32]}", "matrix: {n: [16], arch: [1]}")
V["axis_name_bad"] = ORIG.replace("matrix: {n: [16, 32]}", "matrix: {n: [16], 'a-b': [1]}")
V["axis_name_unicode"] = ORIG.replace("matrix: {n: [16, 32]}", "matrix: {n: [16], 'ñ': [1]}")
V["axis_name_int"] = ORIG.replace("matrix: {n: [16, 32]}", "matrix: {n: [16], 5: [1]}")
V["axis_word_weird"] = ORIG.replace("matrix: {n: [16, 32]}", "matrix: {n: [16], w: ['a=b,c']}")
V["axis_word_empty"] = ORIG.replace("matrix: {n: [16, 32]}", "matrix: {n: [16], w: ['']}")
V["explosion"] = ORIG.replace("matrix: {n: [16, 32]}", "matrix: {n: [16], " + ", ".join(f"x{i}: [{', '.join(str(j) for j in range(10))}]" for i in range(8)) + "}")
V["explosion_edge"] = ORIG.replace("matrix: {n: [16, 32]}", "matrix: {n: [16], a: [" + ",".join(str(i) for i in range(1000)) + "], b: [" + ",".join(str(i) for i in range(101)) + "]}")
V["explosion_axes_many"] = ORIG.replace("matrix: {n: [16, 32]}", "matrix: {n: [16], " + ", ".join(f"x{i}: [1]" for i in range(3000)) + "}")
V["explosion_values_many"] = ORIG.replace("matrix: {n: [16, 32]}", "matrix: {n: [" + ",".join(str(i + 1) for i in range(200000)) + "]}")
V["kp_unknown"] = ORIG.replace("    kernel_params: [n, mode]\n", "    kernel_params: [n, mode, zz]\n")
V["kp_dup"] = ORIG.replace("    kernel_params: [n, mode]\n", "    kernel_params: [n, n, mode]\n")
V["kp_str"] = ORIG.replace("    kernel_params: [n, mode]\n", "    kernel_params: n\n")
V["kp_empty"] = ORIG.replace("    kernel_params: [n, mode]\n", "    kernel_params: []\n")
for tol, nm in [("{}", "tol_empty_bounds"), ("{out: {}}", "tol_out_empty"), ("{out: {cosine_min: -1}}", "tol_cos_neg"),
                ("{out: {cosine_min: 0}}", "tol_cos_zero"), ("{out: {cosine_min: 1.5}}", "tol_cos_big"),
                ("{out: {cosine_min: .nan}}", "tol_cos_nan"), ("{out: {cosine_min: .inf}}", "tol_cos_inf"),
                ("{out: {rel_l2_max: 1e300}}", "tol_rel_huge"), ("{out: {rel_l2_max: -1}}", "tol_rel_neg"),
                ("{out: {rel_l2_max: 0.9}}", "tol_rel_loose"), ("{out: {max_abs_max: 1e9}}", "tol_maxabs_only"),
                ("{out: {cosine_min: 0.5}}", "tol_cos_loose"), ("{out: {cosine_min: '0.99'}}", "tol_cos_str"),
                ("{out: {cosine_min: true}}", "tol_cos_bool"), ("{out: {cosine_min: 0.99, bogus: 1}}", "tol_unknown_bound"),
                ("{OUT: {cosine_min: 0.99}}", "tol_wrong_name"), ("{out: {cosine_min: 0.99}, extra: {cosine_min: 0.99}}", "tol_extra_out"),
                ("{out: 0.99}", "tol_scalar"), ("[out]", "tol_list"), ("{out: {cosine_min: 0.99, max_abs_max: .nan}}", "tol_maxabs_nan"),
                ("{out: {cosine_min: 0.99, max_abs_max: -1}}", "tol_maxabs_neg"), ("{out: {cosine_min: 1e-400}}", "tol_cos_underflow"),
                ("{out: {cosine_min: 0x1}}", "tol_cos_hex"), ("{out: {cosine_min: 1_0}}", "tol_cos_underscore"),
                ("{out: {rel_l2_max: 0.5, cosine_min: 0.1}}", "tol_mixed"), ("{out: {cosine_min: 0.9999, cosine_min: 0.1}}", "tol_dup_bound")]:
    V[nm] = ORIG.replace("tolerances: {out: {cosine_min: 0.9999, rel_l2_max: 1.0e-6}}", "tolerances: " + tol)
V["no_tolerances"] = ORIG.replace("    tolerances: {out: {cosine_min: 0.9999, rel_l2_max: 1.0e-6}}\n", "")
for v, nm in [("0", "to_zero"), ("-1", "to_neg"), (".nan", "to_nan"), (".inf", "to_inf"), ("1e300", "to_huge"), ("'20'", "to_str"),
              ("true", "to_bool"), ("100000000", "to_year"), ("1e-300", "to_tiny"), ("[20]", "to_list")]:
    V[nm] = ORIG.replace("timeout_s: 20", "timeout_s: " + v)
V["anchor_alias"] = ORIG.replace("tolerances: {out: {cosine_min: 0.9999, rel_l2_max: 1.0e-6}}", "tolerances: &t {out: {cosine_min: 0.9999, rel_l2_max: 1.0e-6}}", 1).replace("tolerances: {out: {cosine_min: 0.9999}}", "tolerances: *t")
V["merge_key"] = ORIG.replace("    tolerances: {out: {cosine_min: 0.9999}}\n", "    <<: {tolerances: {out: {cosine_min: 0.9999}}}\n")
V["alias_undefined"] = ORIG.replace("tolerances: {out: {cosine_min: 0.9999}}", "tolerances: *nope")
V["python_object"] = ORIG.replace("timeout_s: 20", "timeout_s: !!python/object/apply:os.system ['echo PWNED > /tmp/adv1/pwned']")
V["python_name"] = ORIG.replace("timeout_s: 20", "timeout_s: !!python/name:os.system")
V["custom_tag"] = ORIG.replace("timeout_s: 20", "timeout_s: !foo 20")
V["binary_tag"] = ORIG.replace("timeout_s: 20", "timeout_s: !!binary aGVsbG8=")
V["set_tag"] = ORIG.replace("matrix: {n: [16, 32]}", "matrix: {n: !!set {16, 32}}")
V["omap"] = ORIG.replace("matrix: {n: [16, 32]}", "matrix: !!omap [n: [16, 32]]")
V["timestamp"] = ORIG.replace("matrix: {n: [16, 32]}", "matrix: {n: [16], d: [2001-01-01]}")
V["float_tag_on_int"] = ORIG.replace("matrix: {n: [16, 32]}", "matrix: {n: [!!float 16]}")
V["str_tag_int"] = ORIG.replace("matrix: {n: [16, 32]}", "matrix: {n: [!!str 16]}")
V["deep_nest"] = ORIG + "x: " + "[" * 200 + "]" * 200 + "\n"
V["deep_nest_map"] = ORIG + "x: " + "{a: " * 200 + "1" + "}" * 200 + "\n"
V["billion_laughs"] = "a: &a [x,x,x,x,x,x,x,x,x]\n" + "".join(f"{chr(98+i)}: &{chr(98+i)} [" + ",".join(["*" + chr(97+i)] * 9) + "]\n" for i in range(8)) + ORIG
V["invalid_utf8"] = None
V["nul_byte"] = ORIG.replace("correct", "cor\x00rect")
V["unterminated"] = ORIG.replace("matrix: {n: [16, 32]}", "matrix: {n: [16, 32}")
V["bad_indent"] = ORIG.replace("    dir: stages/fake\n    kernels: {cpu: {module: stages.fake.cpu, entry: Add}}", "    dir: stages/fake\n      kernels: {cpu: {module: stages.fake.cpu, entry: Add}}", 1)
V["crlf"] = ORIG.replace("\n", "\r\n")
V["cr_only"] = ORIG.replace("\n", "\r")
V["huge_file"] = ORIG + "# " + "x" * (40 * 1024 * 1024) + "\n"
V["bench_bad"] = ORIG.replace("timeout_s: 20", "timeout_s: 20\n    bench: {matrix: {n: [1e30]}}")
V["bench_peers_bad"] = ORIG.replace("timeout_s: 20", "timeout_s: 20\n    bench: {matrix: {n: [16]}, peers: [evil]}")
V["bench_many"] = ORIG.replace("timeout_s: 20", "timeout_s: 20\n    bench: {matrix: {n: [" + ",".join(str(i+1) for i in range(100)) + "]}}")
V["bench_row_axis_bad"] = ORIG.replace("timeout_s: 20", "timeout_s: 20\n    bench: {matrix: {n: [16]}, row_axis: zz}")
V["bench_check_rows_neg"] = ORIG.replace("timeout_s: 20", "timeout_s: 20\n    bench: {matrix: {n: [16]}, check_rows: -5}")
V["bench_check_rows_zero"] = ORIG.replace("timeout_s: 20", "timeout_s: 20\n    bench: {matrix: {n: [16]}, check_rows: 0}")
V["bench_case_bad"] = ORIG.replace("timeout_s: 20", "timeout_s: 20\n    bench: {case: {n: 999}}")
V["bench_peak_bad"] = ORIG.replace("timeout_s: 20", "timeout_s: 20\n    bench: {matrix: {n: [16]}, peak: fp4}")
V["bench_scalar"] = ORIG.replace("timeout_s: 20", "timeout_s: 20\n    bench: 7")
V["stages_yaml_dir"] = "DIR"
V["stages_yaml_symlink_devzero"] = "DEVZERO"
V["stages_yaml_fifo"] = "FIFO"
V["stages_yaml_missing"] = "MISSING"
V["stages_yaml_symlink_out"] = "SYMOUT"

flt = sys.argv[1] if len(sys.argv) > 1 else ""
def one(item):
    i, (name, text) = item
    lab, cache = fresh("s%d" % i)
    p = lab / "stages.yaml"
    if name == "bom_utf16": p.write_bytes(ORIG.encode("utf-16"))
    elif name == "invalid_utf8": p.write_bytes(ORIG.encode().replace(b"correct", b"corr\xff\xfeect"))
    elif text == "DIR": p.unlink(); p.mkdir()
    elif text == "DEVZERO": p.unlink(); p.symlink_to("/dev/zero")
    elif text == "FIFO": p.unlink(); os.mkfifo(p)
    elif text == "MISSING": p.unlink()
    elif text == "SYMOUT": Path(str(lab)+"_o.yaml").write_text(ORIG); p.unlink(); p.symlink_to(str(lab)+"_o.yaml")
    else: p.write_text(text, newline="")
    before = snapshot(lab)
    lines = []
    for args in (["check"], ["gate", "--no-run"], ["run", "stage-OK"]):
        rc, out, err = cli(lab, cache, args, timeout=90)
        probs, _ = judge(name, args, rc, out, err, want_fail=(name not in OKISH))
        if args[0] == "run" and rc == 2 and "Traceback" not in out + err: pass
        after = snapshot(lab)
        for k, v in before.items():
            if k.startswith("results/records") and (k not in after or not after[k].startswith(v)): probs.append("LOST " + k)
        lines.append((name, args, rc, out, err, probs))
        if name not in OKISH and rc == 2 and args[0] == "check": break
    return lines
OKISH = {"bom", "crlf", "anchor_alias", "merge_key", "only_comment_", "tol_mixed", "tol_cos_hex", "tol_cos_underscore", "kp_str_", "stages_yaml_symlink_out", "to_year", "tol_maxabs_neg_"}
items = [(i, kv) for i, kv in enumerate(V.items()) if flt in kv[0]]
with ThreadPoolExecutor(3) as ex:
    for lines in ex.map(one, items):
        for l in lines: report(l[0], l[1], l[2], l[3], l[4], l[5])
print("total variants", len(items))
