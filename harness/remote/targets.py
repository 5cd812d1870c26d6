"""SSH targets: the targets files and their validation.

`targets.yaml` at the lab root and the user's `$XDG_CONFIG_HOME/dsv4-lab/targets.yaml` (a user
entry replaces the lab's of the same name), validated like stages.yaml: every problem is one
`TargetError` line, `targets.yaml:LINE: targets.NAME.key: problem — fix`.  The user's file may
name `proof_target: NAME` (where `gate` proves stale cases without --target).  A key or value
that looks like a secret is refused."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, replace
from pathlib import Path

from yaml.nodes import MappingNode, Node, ScalarNode, SequenceNode

from harness.core.yamlnodes import TOP, NodeContext, is_empty, kind as _kind, mapping as _mapping, read_file
from harness.core.yamlnodes import scalar as _scalar


class TargetError(Exception):
    """A problem with targets or a target's configuration, phrased as one line."""


TARGETS_NAME = "targets.yaml"
SCHEMA_VERSION = 1


PROOF_KEY = "proof_target"  # user file only: the target `dsv4-lab gate` proves stale cases on
TARGET_KEYS = {"kind", "ssh", "port", "workdir", "python", "gpus", "ssh_options"}
TARGET_REQUIRED = {"ssh", "workdir", "python"}
# `kind: slurm`: a cluster reached through its scheduler (harness/remote/slurm_run.py).
SLURM_KEYS = {"kind", "login", "port", "ssh_options", "partition", "account", "gpus_per_task", "time", "tasks",
              "python", "workdir", "sbatch_options"}
SLURM_REQUIRED = {"login", "partition", "python", "workdir"}
# sbatch options a slurm target may add (each becomes one `#SBATCH --NAME=VALUE` line); the ones the
# lab sets itself (array, partition, account, gres, time, output, job-name, requeue) are not here.
SBATCH_OPTIONS = ("qos", "constraint", "reservation", "mem", "mem-per-gpu", "mem-per-cpu", "cpus-per-task",
                  "cpus-per-gpu", "exclude", "nodelist", "gres-flags", "comment", "licenses", "nice", "exclusive")
_SBATCH_VALUE = re.compile(r"^[A-Za-z0-9_.,:=@%+/\[\]|&!-]{1,200}$")
_SLURM_TIME = re.compile(r"^(\d{1,5}|\d{1,5}:\d\d|\d{1,4}:\d\d:\d\d|\d{1,3}-\d{1,2}(:\d\d){0,2})$")
_SLURM_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")

# ssh -o options a target may set; anything else belongs in ~/.ssh/config.
SSH_OPTIONS = {name.lower(): name for name in (
    "ConnectTimeout", "ConnectionAttempts", "ServerAliveInterval", "ServerAliveCountMax", "TCPKeepAlive",
    "Compression", "IdentityFile", "IdentitiesOnly", "CertificateFile", "ProxyJump", "User",
    "AddressFamily", "ControlMaster", "ControlPath", "ControlPersist", "IPQoS",
)}
INT_SSH_OPTIONS = {"connecttimeout", "connectionattempts", "serveraliveinterval", "serveralivecountmax"}
_HOSTKEY_WHY = ("host-key checking stays on and uses your own known_hosts — add the host's key once "
                "(ssh HOST, then verify the fingerprint) instead")
_PASSWORD_WHY = ("the lab runs ssh with BatchMode=yes and never types passwords — use an ssh key "
                 "(ssh-keygen, ssh-copy-id HOST) loaded in ssh-agent (ssh-add)")
_COMMAND_WHY = "it runs local commands — if you need it, put it in ~/.ssh/config for that host"
REFUSED_SSH_OPTIONS = {
    "stricthostkeychecking": _HOSTKEY_WHY, "userknownhostsfile": _HOSTKEY_WHY,
    "globalknownhostsfile": _HOSTKEY_WHY, "knownhostscommand": _HOSTKEY_WHY,
    "updatehostkeys": _HOSTKEY_WHY, "checkhostip": _HOSTKEY_WHY, "verifyhostkeydns": _HOSTKEY_WHY,
    "passwordauthentication": _PASSWORD_WHY, "kbdinteractiveauthentication": _PASSWORD_WHY,
    "challengeresponseauthentication": _PASSWORD_WHY, "preferredauthentications": _PASSWORD_WHY,
    "numberofpasswordprompts": _PASSWORD_WHY, "batchmode": _PASSWORD_WHY,
    "proxycommand": _COMMAND_WHY, "localcommand": _COMMAND_WHY, "permitlocalcommand": _COMMAND_WHY,
    "remotecommand": _COMMAND_WHY,
}

# Secrets: key names, and values that carry one (never echoed back in an error).
_SECRET_KEY_WORDS = ("password", "passwd", "passphrase", "secret", "token", "apikey", "privatekey",
                     "credential", "sshpass")
_SECRET_VALUE = re.compile(
    r"(?i)(\bsshpass\b|(password|passwd|passphrase|secret|token|api[_-]?key)\s*[=:]|--password\b"
    r"|-----BEGIN|\bghp_[A-Za-z0-9]{20,}|\bgithub_pat_|\bglpat-|\bhf_[A-Za-z0-9]{20,}"
    r"|\bAKIA[0-9A-Z]{16}\b|\bsk-[A-Za-z0-9]{20,}|\bxox[baprs]-|://[^/@\s:]+:[^/@\s]+@)"
)
_SECRET_WHY = ("looks like a secret — targets files hold no secrets: use an ssh key (ssh-keygen, "
               "ssh-copy-id HOST) loaded in ssh-agent (ssh-add), and remove it from this file")

_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
_SSH_RE = re.compile(r"^(?:[A-Za-z0-9._%+-]+@)?[A-Za-z0-9._-]+$")


# ---------------------------------------------------------------------------------------
# The targets files.


@dataclass(frozen=True)
class Target:
    """One SSH target, as declared (validated)."""

    name: str
    ssh: str  # an alias from the ssh config, or user@host
    workdir: str  # remote work folder: absolute or ~/... (a relative one is read as ~/...: the remote home's)
    python: str  # a python path, or a command such as `source ~/venv/bin/activate && python`
    port: int | None = None
    gpus: tuple[int, ...] = ()
    ssh_options: tuple[tuple[str, str], ...] = ()
    declared: str = ""  # "targets.yaml:12"
    overrides: str | None = None  # where the lab entry it replaces was declared

    @property
    def where(self) -> str:
        """The ssh destination as messages show it: `host` or `host port 2222`."""
        return self.ssh + (f" port {self.port}" if self.port else "")


@dataclass(frozen=True)
class SlurmTarget:
    """One Slurm target (`kind: slurm`), as declared (validated): runs go through its scheduler."""

    name: str
    login: str  # "local" (the lab runs on a login node) or an ssh alias / user@host
    partition: str
    workdir: str  # a folder the login and the compute nodes share: the tree and the run folders go there
    python: str  # the python (or activation command) on the compute nodes
    account: str | None = None
    gpus_per_task: int = 1
    time: str = "1:00:00"  # sbatch --time of each array task
    tasks: int = 1  # array size when `run` gives no --gpus
    sbatch_options: tuple[tuple[str, str], ...] = ()
    port: int | None = None
    ssh_options: tuple[tuple[str, str], ...] = ()
    declared: str = ""
    overrides: str | None = None

    @property
    def local(self) -> bool:
        return self.login == "local"

    @property
    def where(self) -> str:
        part = f"partition {self.partition}" + (f", account {self.account}" if self.account else "")
        return f"slurm {part} via " + ("this machine" if self.local else self.login + (
            f" port {self.port}" if self.port else ""))

    def login_target(self) -> Target:
        """The login host as an SSH target (only when `login` is not `local`)."""
        return Target(name=self.name, ssh=self.login, workdir=self.workdir, python=self.python, port=self.port,
                      ssh_options=self.ssh_options, declared=self.declared, overrides=self.overrides)


AnyTarget = Target | SlurmTarget


def lab_targets_file(root: Path) -> Path:
    return root / TARGETS_NAME


def user_targets_file() -> Path:
    """$XDG_CONFIG_HOME/dsv4-lab/targets.yaml (XDG_CONFIG_HOME only when absolute), else
    ~/.config/dsv4-lab/targets.yaml."""
    xdg = os.environ.get("XDG_CONFIG_HOME", "")
    base = Path(xdg) if xdg and os.path.isabs(xdg) else Path.home() / ".config"
    return base / "dsv4-lab" / TARGETS_NAME


def _display(path: Path, root: Path | None) -> str:
    """How a targets file is named in messages: `targets.yaml` for the lab's, ~/... for a user's."""
    if root is not None and path == lab_targets_file(root):
        return TARGETS_NAME
    home = str(Path.home())
    text = str(path)
    return "~" + text[len(home):] if home != "/" and text.startswith(home + os.sep) else text


def user_targets_shown(root: Path | None = None) -> str:
    """The user's targets file as messages name it (~/.config/dsv4-lab/targets.yaml)."""
    return _display(user_targets_file(), root)


def _string(ctx: NodeContext, node: Node, key: str, what: str) -> str:
    value = _scalar(node) if isinstance(node, ScalarNode) else None
    if not isinstance(value, str) or not value.strip():
        raise ctx.fail(node, key, f"expected {what}, got {_kind(node)} — give {what}")
    if any(ord(c) < 0x20 for c in value):
        raise ctx.fail(node, key, "contains a newline or control character — write it on one line")
    return value.strip()


def _is_secret_key(name: str) -> bool:
    flat = re.sub(r"[^a-z]", "", name.lower())
    return flat in ("pass", "pw", "pwd") or any(w in flat for w in _SECRET_KEY_WORDS)


def _refuse_secrets(ctx: NodeContext, node: Node, key: str, check_keys: bool = True,
                    seen: set[tuple[int, bool]] | None = None) -> None:
    """Refuse any key named like a secret and any scalar carrying one; each node scanned once (linear)."""
    seen = set() if seen is None else seen
    if (id(node), check_keys) in seen:
        return
    seen.add((id(node), check_keys))
    if isinstance(node, MappingNode):
        for k, v in node.value:
            name = str(_scalar(k))
            path = f"{key}.{name}" if key else name
            if check_keys and _is_secret_key(name):
                raise ctx.fail(k, path, _SECRET_WHY)
            # ssh option names (PasswordAuthentication...) get their own message later.
            _refuse_secrets(ctx, v, path, not path.endswith(".ssh_options"), seen)
    elif isinstance(node, SequenceNode):
        for item in node.value:
            _refuse_secrets(ctx, item, key, True, seen)
    elif isinstance(node, ScalarNode) and isinstance(node.value, str) and _SECRET_VALUE.search(node.value):
        raise ctx.fail(node, key, _SECRET_WHY)


def _parse_ssh(ctx: NodeContext, node: Node, key: str) -> str:
    text = _string(ctx, node, key, "an ssh alias or user@host")
    if "://" in text or re.search(r":\d+$", text):
        raise ctx.fail(node, key, "give an alias or user@host — put the port in `port`")
    if ":" in text.split("@")[0] and "@" in text:
        raise ctx.fail(node, key, _SECRET_WHY)
    if text.startswith("-") or not _SSH_RE.match(text):
        raise ctx.fail(node, key, f"{text!r} is not an ssh alias or user@host — use a Host alias from ~/.ssh/config")
    return text


def _parse_workdir(ctx: NodeContext, node: Node, key: str) -> str:
    text = _string(ctx, node, key, "a remote folder path")
    if text.startswith("~") and not (text == "~" or text.startswith("~/")):
        raise ctx.fail(node, key, "~user paths are not supported — write the absolute path or ~/...")
    if text.startswith("-"):
        raise ctx.fail(node, key, "starts with '-' — write it as ./" + text)
    if ".." in text.split("/"):
        raise ctx.fail(node, key, "contains '..' — name the folder itself")
    if not text.startswith(("/", "~")):  # relative: to the remote home, the folder ssh starts in
        while text.startswith("./"):
            text = text[2:].lstrip("/")
        text = "~" if text in ("", ".") else "~/" + text
    return text.rstrip("/") or "/"


def _parse_int(ctx: NodeContext, node: Node, key: str, lo: int, hi: int, what: str) -> int:
    value = _scalar(node) if isinstance(node, ScalarNode) else None
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise ctx.fail(node, key, f"expected {what} ({lo}–{hi}), got {_kind(node)} — fix the number")
    return value


def _parse_gpus(ctx: NodeContext, node: Node, key: str) -> tuple[int, ...]:
    if not isinstance(node, SequenceNode) or not node.value:
        raise ctx.fail(node, key, f"expected a list of GPU indices like [0, 1], got {_kind(node)} — fix the list")
    gpus = tuple(_parse_int(ctx, n, key, 0, 1023, "a GPU index") for n in node.value)
    if len(set(gpus)) != len(gpus):
        raise ctx.fail(node, key, "repeated GPU index — list each GPU once")
    return gpus


def _parse_ssh_options(ctx: NodeContext, node: Node, key: str) -> tuple[tuple[str, str], ...]:
    out = []
    for knode, vnode in _mapping(ctx, node, key):
        name = str(_scalar(knode))
        ok = f"{key}.{name}"
        low = name.lower()
        if low in REFUSED_SSH_OPTIONS:
            raise ctx.fail(knode, ok, f"refused — {REFUSED_SSH_OPTIONS[low]}")
        if low not in SSH_OPTIONS:
            raise ctx.fail(knode, ok, f"not an allowed ssh option — allowed: {', '.join(sorted(SSH_OPTIONS.values()))}; "
                                      "anything else belongs in ~/.ssh/config")
        if low in INT_SSH_OPTIONS:
            value = str(_parse_int(ctx, vnode, ok, 1, 3600, "a positive integer"))
        else:
            raw = _scalar(vnode) if isinstance(vnode, ScalarNode) else None
            if isinstance(raw, bool):
                value = "yes" if raw else "no"
            elif isinstance(raw, (int, str)) and str(raw).strip():
                value = str(raw).strip()
            else:
                raise ctx.fail(vnode, ok, f"expected a single value, got {_kind(vnode)} — fix the value")
            if re.search(r"\s", value) or value.startswith("-") or any(ord(c) < 0x20 for c in value):
                raise ctx.fail(vnode, ok, "spaces, control characters or a leading '-' are not allowed — "
                                          "use ~/.ssh/config for this")
        out.append((SSH_OPTIONS[low], value))
    return tuple(out)


def _parse_kind(ctx: NodeContext, fields: dict, key: str) -> str:
    if "kind" not in fields:
        return "ssh"
    value = _string(ctx, fields["kind"][1], f"{key}.kind", "ssh or slurm")
    if value not in ("ssh", "slurm"):
        raise ctx.fail(fields["kind"][1], f"{key}.kind", f"{value!r} is not a target kind — write ssh or slurm")
    return value


def _parse_slurm_word(ctx: NodeContext, node: Node, key: str, what: str) -> str:
    text = _string(ctx, node, key, what)
    if not _SLURM_NAME.fullmatch(text):
        raise ctx.fail(node, key, f"{text!r} is not {what} — letters, digits, - _ . only")
    return text


def _parse_sbatch_options(ctx: NodeContext, node: Node, key: str) -> tuple[tuple[str, str], ...]:
    out = []
    for knode, vnode in _mapping(ctx, node, key):
        name = str(_scalar(knode)).strip().lstrip("-").replace("_", "-").lower()
        ok = f"{key}.{_scalar(knode)}"
        if name not in SBATCH_OPTIONS:
            raise ctx.fail(knode, ok, f"not an allowed sbatch option — allowed: {', '.join(SBATCH_OPTIONS)} "
                                      "(the lab sets array, partition, account, gres, time and output itself)")
        raw = _scalar(vnode) if isinstance(vnode, ScalarNode) else None
        if isinstance(raw, bool) or not isinstance(raw, (int, str)) or not str(raw).strip():
            raise ctx.fail(vnode, ok, f"expected one value, got {_kind(vnode)} — fix the value")
        value = str(raw).strip()
        if not _SBATCH_VALUE.fullmatch(value) or value.startswith("-"):
            raise ctx.fail(vnode, ok, "not a plain sbatch value (spaces, quotes, $, ;, backquotes, a newline or a "
                                      "leading '-' are refused: no shell fragments) — write the value alone")
        out.append((name, value))
    return tuple(out)


def _parse_slurm(ctx: NodeContext, name: str, node: Node, fields: dict) -> SlurmTarget:
    key = f"targets.{name}"
    for fname, (knode, _) in fields.items():
        if fname not in SLURM_KEYS:
            raise ctx.fail(knode, f"{key}.{fname}", f"unknown key of a slurm target — allowed: {', '.join(sorted(SLURM_KEYS))}")
    for fname in sorted(SLURM_REQUIRED - fields.keys()):
        raise ctx.fail(node, f"{key}.{fname}", "missing required key of a slurm target — add it (see the example "
                                               "in targets.yaml)")
    f = {k: v for k, (_, v) in fields.items()}
    login_node = f["login"]
    login = "local" if isinstance(login_node, ScalarNode) and _scalar(login_node) == "local" else \
        _parse_ssh(ctx, login_node, f"{key}.login")
    if login == "local" and ("port" in f or "ssh_options" in f):
        bad = "port" if "port" in f else "ssh_options"
        raise ctx.fail(f[bad], f"{key}.{bad}", "only for a login host reached over ssh — remove it, or set login "
                                               "to the ssh alias of the login node")
    workdir = _parse_workdir(ctx, f["workdir"], f"{key}.workdir")
    time = _string(ctx, f["time"], f"{key}.time", "a Slurm time limit") if "time" in f else "1:00:00"
    if not _SLURM_TIME.fullmatch(str(time)):
        raise ctx.fail(f["time"], f"{key}.time", f"{time!r} is not a Slurm time limit — write minutes, "
                                                 "HH:MM:SS or D-HH:MM:SS, e.g. \"2:00:00\"")
    return SlurmTarget(
        name=name, login=login,
        partition=_parse_slurm_word(ctx, f["partition"], f"{key}.partition", "a partition name"),
        account=_parse_slurm_word(ctx, f["account"], f"{key}.account", "an account name") if "account" in f else None,
        workdir=workdir,
        python=_string(ctx, f["python"], f"{key}.python", "a python path or command"),
        gpus_per_task=_parse_int(ctx, f["gpus_per_task"], f"{key}.gpus_per_task", 0, 64, "GPUs per array task")
        if "gpus_per_task" in f else 1,
        time=str(time),
        tasks=_parse_int(ctx, f["tasks"], f"{key}.tasks", 1, 1000, "array tasks") if "tasks" in f else 1,
        sbatch_options=_parse_sbatch_options(ctx, f["sbatch_options"], f"{key}.sbatch_options")
        if "sbatch_options" in f else (),
        port=_parse_int(ctx, f["port"], f"{key}.port", 1, 65535, "a port") if "port" in f else None,
        ssh_options=_parse_ssh_options(ctx, f["ssh_options"], f"{key}.ssh_options") if "ssh_options" in f else (),
    )


def _parse_target(ctx: NodeContext, name: str, node: Node) -> AnyTarget:
    key = f"targets.{name}"
    pairs = _mapping(ctx, node, key)
    fields = {str(_scalar(k)): (k, v) for k, v in pairs}
    if _parse_kind(ctx, fields, key) == "slurm":
        return _parse_slurm(ctx, name, node, fields)
    for fname, (knode, _) in fields.items():
        if fname not in TARGET_KEYS:
            raise ctx.fail(knode, f"{key}.{fname}", f"unknown key — allowed: {', '.join(sorted(TARGET_KEYS))}")
    for fname in sorted(TARGET_REQUIRED - fields.keys()):
        raise ctx.fail(node, f"{key}.{fname}", "missing required key — add it (see the example in targets.yaml)")
    f = {k: v for k, (_, v) in fields.items()}
    return Target(
        name=name,
        ssh=_parse_ssh(ctx, f["ssh"], f"{key}.ssh"),
        workdir=_parse_workdir(ctx, f["workdir"], f"{key}.workdir"),
        python=_string(ctx, f["python"], f"{key}.python", "a python path or command"),
        port=_parse_int(ctx, f["port"], f"{key}.port", 1, 65535, "a port") if "port" in f else None,
        gpus=_parse_gpus(ctx, f["gpus"], f"{key}.gpus") if "gpus" in f else (),
        ssh_options=_parse_ssh_options(ctx, f["ssh_options"], f"{key}.ssh_options") if "ssh_options" in f else (),
    )


def load_targets_file(path: Path, display: str | None = None) -> dict[str, AnyTarget]:
    """Targets declared in one file ({} when the file is missing or declares none)."""
    return _load_file(path, display, user=False)[0]


def _load_file(path: Path, display: str | None, user: bool) -> tuple[dict[str, AnyTarget], tuple[str, str] | None]:
    """(targets, (proof_target, where declared) or None) of one file. `proof_target` is a
    personal setting: only the user's file may hold it."""
    ctx = NodeContext(display or str(path), TargetError, " — see the example in targets.yaml")
    if not path.exists():
        return {}, None
    doc = read_file(path, ctx)  # bounded: aliases, depth, encoding, tags (harness/core/yamlnodes.py)
    if doc is None:
        return {}, None
    _refuse_secrets(ctx, doc, "")
    top = _mapping(ctx, doc, TOP)
    fields = {str(_scalar(k)): (k, v) for k, v in top}
    for fname, (knode, _) in fields.items():
        if fname == PROOF_KEY and not user:
            raise ctx.fail(knode, fname, f"a personal setting — put it in {_display(user_targets_file(), None)} "
                                         "(each author picks the machine that proves their commits)")
        if fname not in ("version", "targets", PROOF_KEY):
            raise ctx.fail(knode, fname, "unknown key — the file has 'version' and 'targets'"
                           + (f" (and '{PROOF_KEY}')" if user else ""))
    proof = None
    if PROOF_KEY in fields:
        pnode = fields[PROOF_KEY][1]
        name = _string(ctx, pnode, PROOF_KEY, "a target name")
        if not _NAME_RE.fullmatch(name) or name == "local":
            raise ctx.fail(pnode, PROOF_KEY, f"{name!r} is not a target name — name one declared under targets")
        proof = (name, ctx.line(pnode))
    if "version" in fields:
        vnode = fields["version"][1]
        version = _scalar(vnode) if isinstance(vnode, ScalarNode) else None
        if version != SCHEMA_VERSION or isinstance(version, bool):
            raise ctx.fail(vnode, "version", f"unsupported version {version!r} — this lab reads {SCHEMA_VERSION}")
    tnode = fields.get("targets", (None, None))[1]
    if is_empty(tnode):  # `targets:` with every entry commented out, as the shipped example is
        return {}, proof
    targets: dict[str, AnyTarget] = {}
    for knode, vnode in _mapping(ctx, tnode, "targets"):
        name = str(_scalar(knode))
        if not _NAME_RE.fullmatch(name):
            raise ctx.fail(knode, f"targets.{name}", "target names are short words (letters, digits, - _ .) — rename it")
        if name == "local":
            raise ctx.fail(knode, "targets.local", "'local' is this machine and cannot be redefined — pick another name")
        t = _parse_target(ctx, name, vnode)
        targets[name] = replace(t, declared=ctx.line(knode))
    return targets, proof


def load_targets(root: Path) -> dict[str, AnyTarget]:
    """The lab's targets, with the user's entries replacing the lab's of the same name."""
    lab_path, user_path = lab_targets_file(root), user_targets_file()
    merged = dict(load_targets_file(lab_path, _display(lab_path, root)))
    for name, t in _load_file(user_path, _display(user_path, root), user=True)[0].items():
        merged[name] = replace(t, overrides=merged[name].declared if name in merged else None)
    return merged


def proof_target(root: Path) -> str | None:
    """The user's `proof_target: NAME` (where `gate` proves without --target), or None; a name no file
        declares is one TargetError line."""
    user_path = user_targets_file()
    shown = _display(user_path, root)
    _, proof = _load_file(user_path, shown, user=True)
    if proof is None:
        return None
    name, where = proof
    declared = load_targets(root)
    if name not in declared:
        known = ", ".join(sorted(declared)) or "none yet"
        raise TargetError(f"{where}: {PROOF_KEY}: no target {name!r} is declared (declared: {known}) — "
                          f"declare it under targets: in {shown} or {TARGETS_NAME}, or fix the name")
    return name


def resolve_targets(root: Path, spec: str, what: str = "--target") -> list[Target]:
    """`--target a,b` -> the declared targets, in order. Raises TargetError (one line)."""
    names = [n.strip() for n in spec.split(",")]
    if not all(names):
        raise TargetError(f"--target {spec}: empty target name — write e.g. --target b200 or --target a,b")
    if len(set(names)) != len(names):
        raise TargetError(f"--target {spec}: a target is named twice — name each once")
    if "local" in names:
        raise TargetError(f"--target {spec}: 'local' cannot be combined with SSH targets — run it separately")
    declared = load_targets(root)
    out = []
    for n in names:
        if n not in declared:
            known = ", ".join(sorted(declared)) or "none yet"
            raise TargetError(f"{what} {n}: no such target (declared: {known}) — add it to {TARGETS_NAME} "
                              f"or {_display(user_targets_file(), root)}")
        t = declared[n]
        if isinstance(t, SlurmTarget):
            raise TargetError(f"{what} {spec}: {n} is a slurm target ({t.declared}) — it runs alone, through its "
                              f"scheduler: `dsv4-lab run STAGE --target {n}`")
        out.append(t)
    return out


def slurm_target(root: Path, spec: str) -> SlurmTarget | None:
    """The slurm target `spec` names, or None when it names SSH targets (or `local`)."""
    if "," in spec or spec == "local":
        return None
    t = load_targets(root).get(spec.strip())
    return t if isinstance(t, SlurmTarget) else None


# ---------------------------------------------------------------------------------------
# `dsv4-lab targets list` and `dsv4-lab targets check NAME`.


def list_cmd(root: Path) -> int:
    """A table of the declared targets and where each is declared."""
    from rich.markup import escape
    from rich.table import Table

    from harness.core.console import make_console

    targets = load_targets(root)
    console = make_console()
    if not targets:
        console.print(f"no SSH targets declared — add one to {TARGETS_NAME} (see its commented example) or "
                      f"{_display(user_targets_file(), root)}; `local` (this machine) is always there",
                      highlight=False)
        return 0
    table = Table(title="dsv4-lab targets (plus `local`, this machine)")
    for col in ("name", "ssh", "workdir", "python", "gpus", "declared in"):
        table.add_column(col)
    for t in sorted(targets.values(), key=lambda t: t.name):
        declared = t.declared + (f" (overrides {t.overrides})" if t.overrides else "")
        gpus = f"{t.gpus_per_task} per task" if isinstance(t, SlurmTarget) else ",".join(map(str, t.gpus)) or "all"
        table.add_row(*(escape(str(x)) for x in (t.name, t.where, t.workdir, t.python, gpus, declared)))
    console.print(table)
    return 0
