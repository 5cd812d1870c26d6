"""Adversarial sweep over a fake lab. Usage: python3 sweep.py CLASS [filter]"""
import os, shutil, subprocess, sys, json, re, time
from pathlib import Path
WT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(WT))
from tests.conftest import make_fake_lab
BASE = Path(os.environ.get("ADV_DIR", "/tmp/adv1")) / "golden"
def golden():
    if (BASE / "done").exists(): return
    shutil.rmtree(BASE, ignore_errors=True)
    lab = make_fake_lab(BASE / "lab")
    env = {**os.environ, "DSV4_LAB_ROOT": str(lab), "DSV4_LAB_CACHE": str(BASE / "cache"), "PYTHONPATH": str(WT)}
    for a in (["run", "stage-OK"], ["baseline", "accept", "stage-OK"]):
        subprocess.run([sys.executable, "-m", "cli", *a], env=env, cwd=lab, check=True, capture_output=True)
    subprocess.run(["git", "add", "-A"], cwd=lab, check=True)
    subprocess.run(["git", "-c", "user.email=t@t", "-c", "user.name=t", "commit", "-qm", "r"], cwd=lab, check=True)
    (BASE / "done").write_text("")

def fresh(i):
    d = Path(os.environ.get("ADV_DIR", "/tmp/adv1")) / "w" / str(i)
    shutil.rmtree(d, ignore_errors=True); d.parent.mkdir(parents=True, exist_ok=True)
    shutil.copytree(BASE / "lab", d / "lab", symlinks=True)
    shutil.copytree(BASE / "cache", d / "cache", symlinks=True)
    return d / "lab", d / "cache"

def cli(lab, cache, args, timeout=60, extra=None):
    env = {**os.environ, "DSV4_LAB_ROOT": str(lab), "DSV4_LAB_CACHE": str(cache), "PYTHONPATH": str(WT),
           "XDG_CONFIG_HOME": str(cache.parent / "xdg"), "COLUMNS": "200", **(extra or {})}
    try:
        p = subprocess.run([sys.executable, "-m", "cli", *args], env=env, cwd=lab, capture_output=True, text=True, timeout=timeout)
        return p.returncode, p.stdout, p.stderr
    except subprocess.TimeoutExpired as e:
        return "TIMEOUT", "", ""

def snapshot(lab):
    out = {}
    for p in sorted((lab / "results").rglob("*")) if (lab / "results").is_dir() else []:
        if p.is_file() and not p.is_symlink() and p.suffix in (".jsonl", ".yaml"):
            out[str(p.relative_to(lab))] = p.read_bytes()
    return out

def judge(name, cmds, rc, out, err, want_fail=True, before=None, after=None):
    probs = []
    text = out + err
    if rc == "TIMEOUT": probs.append("TIMEOUT")
    if "Traceback" in text: probs.append("TRACEBACK")
    if "bug in the lab" in text or "internal error" in text: probs.append("INTERNAL")
    if want_fail and rc == 0: probs.append("EXIT0")
    if want_fail == "2" and rc not in (2,): probs.append(f"rc={rc}!=2")
    if before is not None and after is not None:
        for k, v in before.items():
            if k in after and not after[k].startswith(v[: len(v)]) and "baselines" not in k:
                probs.append(f"LOST {k}")
            if k not in after and "baselines" not in k:
                probs.append(f"GONE {k}")
    errlines = [l for l in err.strip().splitlines() if l.strip()]
    return probs, errlines

RESULTS = []
def report(name, args, rc, out, err, probs):
    tag = "FAIL " + ",".join(probs) if probs else "ok"
    last = (err.strip() or out.strip()).splitlines()
    print(f"[{tag}] {name} :: {' '.join(args)} rc={rc} :: {(last[-1] if last else '')[:220]}", flush=True)
    if probs and os.environ.get("V"): print(out[-2000:], err[-3000:])
