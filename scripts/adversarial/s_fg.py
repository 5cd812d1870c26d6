import sys; sys.path.insert(0, __import__("os").path.dirname(__file__))
from sweep import *
from concurrent.futures import ThreadPoolExecutor
golden()
C = []
for args in (["run", "stage-OK", "--n", "999"], ["run", "stage-OK", "--where", "n=999"], ["run", "stage-OK", "--shard", "3/3"],
             ["run", "stage-OK", "--shard", "0/2"], ["run", "stage-OK", "--shard", "2/1"], ["run", "stage-OK", "--arch", "sm_90a"],
             ["run", "stage-OK", "--n", "16", "--where", "n=32"], ["run", "--all", "--n", "999"], ["compile", "stage-OK", "--n", "999"],
             ["compile", "stage-OK"], ["bench", "stage-OK"], ["run", "stage-ZZ"], ["run", "stage-OK", "--n", ""], ["run", "stage-OK", "--n", "16,999"],
             ["run", "stage-BAD", "--mode", "wrong"], ["run", "stage-BAD", "--mode", "unwritten"], ["run", "stage-BAD", "--mode", "raise"],
             ["run", "stage-BAD", "--mode", "zero_inputs"], ["run", "stage-OK", "--timeout", "0"], ["run", "stage-OK", "--gpus", "0"],
             ["gate", "--no-run", "--target", "nope"], ["run", "stage-OK", "--dry-run", "1"], ["run", "stage-OK", "--where", "zz=1"],
             ["run", "stage-OK", "--where", "n>999"], ["baseline", "accept", "stage-OK", "--n", "999"], ["baseline", "drop", "stage-OK", "--n", "999"],
             ["run", "stage-OK", "--workers", "0"], ["history", "stage-OK", "--n", "999"]):
    C.append(("cmd", None, args))
# kernels
KM = {
 "return_early": "    def __call__(self, a, b, out):\n        return\n",
 "nan_out": "    def __call__(self, a, b, out):\n        out.fill_(float('nan'))\n",
 "inf_out": "    def __call__(self, a, b, out):\n        out.copy_(a + b); out[0] = float('inf')\n",
 "half_out": "    def __call__(self, a, b, out):\n        out[: out.numel()//2].copy_((a+b)[: out.numel()//2])\n",
 "last_elem": "    def __call__(self, a, b, out):\n        out.copy_(a + b); out[-1] = float('nan')\n",
 "zero_inputs": "    def __call__(self, a, b, out):\n        a.zero_(); b.zero_(); out.zero_()\n",
 "copy_input": "    def __call__(self, a, b, out):\n        b.copy_(a); out.copy_(a + b)\n",
 "inplace_input_restore": "    def __call__(self, a, b, out):\n        a.add_(b); out.copy_(a); a.sub_(b)\n",
 "neg_zero": "    def __call__(self, a, b, out):\n        out.copy_(a + b); a.mul_(-1); a.mul_(-1)\n",
 "scaled": "    def __call__(self, a, b, out):\n        out.copy_((a + b) * 2)\n",
 "swap_data": "    def __call__(self, a, b, out):\n        a.data = a.data.clone() * 0; out.copy_(a + b)\n",
 "set_out": "    def __call__(self, a, b, out):\n        out.set_((a + b).contiguous())\n",
 "resize_out": "    def __call__(self, a, b, out):\n        out.resize_(0)\n",
 "monkey_torch": "    def __call__(self, a, b, out):\n        import torch; torch.nn.functional.cosine_similarity = lambda *x, **k: torch.tensor(1.0); out.zero_()\n",
 "monkey_harness": "    def __call__(self, a, b, out):\n        import sys\n        for m in list(sys.modules.values()):\n            if getattr(m, '__name__', '').startswith('harness.'):\n                for k in ('judge', 'cosine', 'compare'):\n                    if hasattr(m, k): setattr(m, k, lambda *x, **kw: ('pass', None) if k=='judge' else 1.0)\n        out.zero_()\n",
 "exit0": "    def __call__(self, a, b, out):\n        import os; os._exit(0)\n",
 "sysexit0": "    def __call__(self, a, b, out):\n        raise SystemExit(0)\n",
 "kbint": "    def __call__(self, a, b, out):\n        raise KeyboardInterrupt\n",
 "print_fake": "    def __call__(self, a, b, out):\n        import sys, json; print(json.dumps({'status':'pass','metrics':{}})); sys.stdout.flush(); out.zero_()\n",
 "write_records": "    def __call__(self, a, b, out):\n        import os\n        p = os.environ.get('DSV4_LAB_ROOT', '.') + '/results/records/OK.jsonl'\n        open(p, 'w').write('')\n        out.copy_(a + b)\n",
 "close_fds": "    def __call__(self, a, b, out):\n        import os\n        for fd in range(3, 200):\n            try: os.close(fd)\n            except OSError: pass\n        out.copy_(a + b)\n",
 "fork_child": "    def __call__(self, a, b, out):\n        import os\n        if os.fork() == 0:\n            import time; time.sleep(30); os._exit(0)\n        out.copy_(a + b)\n",
 "rewrite_oracle": "    def __call__(self, a, b, out):\n        import oracles.add as o; o.reference = lambda inputs, case: {'out': inputs['a'].double()*0}; out.zero_()\n",
 "patch_pristine": "    def __call__(self, a, b, out):\n        import sys\n        for n, m in list(sys.modules.items()):\n            if n.startswith('harness'):\n                for k in dir(m):\n                    if 'pristine' in k.lower() or 'unchanged' in k.lower() or 'written' in k.lower():\n                        try: setattr(m, k, lambda *x, **kw: None)\n                        except Exception: pass\n        a.zero_(); b.zero_(); out.zero_()\n",
}
for k, body in KM.items(): C.append(("kern", k, body))
def one(item):
    i, (kind, name, x) = item
    lab, cache = fresh("f%d" % i)
    if kind == "cmd":
        args = x
    else:
        p = lab / "stages/fake/cpu.py"
        t = p.read_text()
        t = t.replace("    def __call__(self, a, b, out):\n        out.copy_(a + b)\n", x, 1)
        p.write_text(t)
        args = ["run", "stage-OK"]
    rc, out, err = cli(lab, cache, args, timeout=60)
    probs, _ = judge(name or " ".join(args), args, rc, out, err, want_fail=True)
    okzero = kind == "cmd" and args[:2] in (["baseline", "drop"],) or args == ["compile", "stage-OK"] or args == ["run", "stage-OK", "--n", "16,999"]
    if okzero and "EXIT0" in probs: probs.remove("EXIT0")
    if kind == "kern" and name in ("inplace_input_restore", "neg_zero", "fork_child", "close_fds", "write_records") and "EXIT0" in probs: probs.remove("EXIT0"); probs.append("(exit0-ok?)")
    if kind == "kern":
        rc2, o2, e2 = cli(lab, cache, ["gate", "--no-run"])
        if rc2 == 0 and name not in ("inplace_input_restore", "neg_zero", "fork_child", "close_fds"): probs.append("GATE0")
        out += "\nGATE rc=%s %s" % (rc2, (e2 or o2).strip().splitlines()[-1:] )
    return (name or " ".join(args), args, rc, out, err, probs)
items = list(enumerate(C))
flt = sys.argv[1] if len(sys.argv) > 1 else ""
items = [it for it in items if flt in str(it[1][1]) + " ".join(it[1][2] if isinstance(it[1][2], list) else [])]
with ThreadPoolExecutor(3) as ex:
    for l in ex.map(one, items): report(*l)
print("total", len(items))
