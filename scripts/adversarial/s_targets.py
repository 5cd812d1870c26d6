import sys, os; sys.path.insert(0, os.path.dirname(__file__))
from sweep import *
from concurrent.futures import ThreadPoolExecutor
golden()
T = "version: 1\ntargets:\n  box:\n    ssh: user@host\n    workdir: ~/w\n    python: python3\n"
V = {
 "ok": T, "password_key": T + "    password: hunter2\n", "secret_in_python": T.replace("python: python3", "python: PASSWORD=x python3"),
 "sshpass": T.replace("python: python3", "python: sshpass -p x python3"), "token_gh": T.replace("python3", "python3 # ghp_" + "a" * 30),
 "stricthk": T + "    ssh_options: {StrictHostKeyChecking: 'no'}\n", "stricthk_case": T + "    ssh_options: {stricthostkeychecking: 'no'}\n",
 "ukh": T + "    ssh_options: {UserKnownHostsFile: /dev/null}\n", "proxycmd": T + "    ssh_options: {ProxyCommand: 'nc %h %p'}\n",
 "unknown_opt": T + "    ssh_options: {LogLevel: QUIET}\n", "opt_injection": T + "    ssh_options: {ConnectTimeout: '10 -oProxyCommand=x'}\n",
 "opt_newline": T + "    ssh_options: {ProxyJump: \"a\\nProxyCommand x\"}\n", "opt_eq": T + "    ssh_options: {'ProxyJump=x -oProxyCommand': y}\n",
 "opt_list": T + "    ssh_options: [ConnectTimeout]\n", "opt_identityfile_cmd": T + "    ssh_options: {IdentityFile: '$(touch /tmp/x)'}\n",
 "opt_int_neg": T + "    ssh_options: {ConnectTimeout: -1}\n", "opt_int_huge": T + "    ssh_options: {ConnectTimeout: 99999999999999999999}\n",
 "ssh_dash": T.replace("ssh: user@host", "ssh: -oProxyCommand=x"), "ssh_space": T.replace("ssh: user@host", "ssh: 'host; rm -rf /'"),
 "ssh_int": T.replace("ssh: user@host", "ssh: 5"), "workdir_rel": T.replace("workdir: ~/w", "workdir: work"), "workdir_root": T.replace("workdir: ~/w", "workdir: /"),
 "workdir_dotdot": T.replace("workdir: ~/w", "workdir: ~/../../etc"), "workdir_semicolon": T.replace("workdir: ~/w", "workdir: '~/w; rm -rf ~'"),
 "workdir_dollar": T.replace("workdir: ~/w", "workdir: '$(id)'"), "workdir_empty": T.replace("workdir: ~/w", "workdir: ''"), "workdir_tilde_user": T.replace("workdir: ~/w", "workdir: ~root/w"),
 "workdir_home": T.replace("workdir: ~/w", "workdir: ~"), "workdir_newline": T.replace("workdir: ~/w", "workdir: \"~/w\\nx\""),
 "python_empty": T.replace("python: python3", "python: ''"), "python_newline": T.replace("python: python3", "python: \"python3\\nrm -rf ~\""),
 "port_str": T + "    port: abc\n", "port_zero": T + "    port: 0\n", "port_huge": T + "    port: 70000\n", "port_bool": T + "    port: true\n",
 "gpus_neg": T + "    gpus: [-1]\n", "gpus_dup": T + "    gpus: [0, 0]\n", "gpus_str": T + "    gpus: all\n", "gpus_huge": T + "    gpus: [" + ",".join(map(str, range(5000))) + "]\n",
 "unknown_key": T + "    colour: red\n", "dup_key": T + "    ssh: other\n", "dup_target": T + "  box:\n    ssh: a\n    workdir: ~/w\n    python: p\n",
 "name_bad": T.replace("  box:", "  'b ox;':"), "name_long": T.replace("  box:", "  " + "b" * 100 + ":"), "proof_in_lab": T + "proof_target: box\n",
 "missing_req": "version: 1\ntargets:\n  box:\n    ssh: h\n", "targets_list": "version: 1\ntargets: [box]\n", "empty": "", "null": "~\n", "version_2": T.replace("version: 1", "version: 2"),
 "tag": T.replace("python3", "!!python/object/apply:os.system ['touch /tmp/adv1/pwned3']"), "bom": "\ufeff" + T, "tabs": T.replace("    ssh:", "\tssh:"),
 "anchor": T + "  box2: *x\n", "merge": T.replace("  box:\n", "  base: &b {ssh: h, workdir: ~/w, python: p}\n  box:\n    <<: *b\n"),
 "fifo": "FIFO", "devzero": "DEVZERO", "dir": "DIR",
}
U = {"user_proof_unknown": "version: 1\nproof_target: nope\n", "user_proof_int": "version: 1\nproof_target: 5\n", "user_proof_ok": "version: 1\nproof_target: box\n",
     "user_secret": "version: 1\ntargets:\n  box:\n    ssh: h\n    workdir: ~/w\n    python: p\n    token: abc\n", "user_bad": "x: [\n", "user_fifo": "FIFO"}
def one(item):
    i, (name, text) = item
    lab, cache = fresh("t%d" % i)
    p = lab / "targets.yaml"
    if name.startswith("user_"):
        p.write_text(T); p = cache.parent / "xdg" / "dsv4-lab" / "targets.yaml"; p.parent.mkdir(parents=True, exist_ok=True)
    if text == "FIFO": os.mkfifo(p)
    elif text == "DEVZERO": p.symlink_to("/dev/zero")
    elif text == "DIR": p.mkdir()
    else: p.write_text(text)
    res = []
    for args in (["targets", "list"], ["gate", "--no-run"]):
        rc, out, err = cli(lab, cache, args, timeout=30)
        probs, _ = judge(name, args, rc, out, err, want_fail=False)
        bad = name not in ("ok", "merge", "bom", "user_proof_ok", "workdir_home", "gpus_dup")
        if bad and args[0] == "targets" and rc == 0: probs.append("EXIT0")
        res.append((name, args, rc, out, err, probs))
    return res
items = list(enumerate(list(V.items()) + list(U.items())))
with ThreadPoolExecutor(3) as ex:
    for ls in ex.map(one, items):
        for l in ls: report(*l)
print("total", len(items))
