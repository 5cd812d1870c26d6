"""A CPU simulator of a kernel's mbarrier protocol, and the facts of the compiled PTX it is
checked against.

A protocol (protocols.py, one per kernel family):
    barriers   name → Barrier(slots, count): `slots` mbarriers initialised with count `count`
    roles      name → a generator of the role's barrier operations in program order for one
               CTA's work (a group of warps running the same code sums its arrivals)
    tx         name → the transaction byte counts its producers announce (expect_tx)

Operations (mbarrier semantics as in the PTX ISA):
    Wait(bar, slot, parity, need)   try_wait.parity until that phase completed; `need` is how
                                    many phases the role means to have completed (its lap): a
                                    wait passing with another number is a protocol error
    Arrive(bar, slot, n, tx)        expect `tx` more bytes, then `n` arrivals (arrive,
                                    arrive.expect_tx, tcgen05.commit)
    Bytes(bar, slot, n)             `n` bytes land (complete_tx of a TMA)

A phase completes when all `count` arrivals came and the byte count is back to 0.  Every role
not blocked steps round robin until all are done; then every barrier must be between phases.
`simulate` returns None, or one line: a deadlock names each blocked role with the barrier, slot
and phase it waits on and the arrivals / bytes it has."""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable, Iterator, NamedTuple


class Wait(NamedTuple):
    bar: str
    slot: int
    parity: int
    need: int


class Arrive(NamedTuple):
    bar: str
    slot: int
    n: int = 1
    tx: int = 0


class Bytes(NamedTuple):
    bar: str
    slot: int
    n: int


Op = Wait | Arrive | Bytes


@dataclass(frozen=True)
class Barrier:
    slots: int
    count: int


@dataclass
class Protocol:
    name: str
    barriers: dict[str, Barrier]
    roles: dict[str, Callable[[], Iterator[Op]]]
    tx: dict[str, set[int]] = field(default_factory=dict)

    def init_counts(self) -> Counter:
        """What the PTX's mbarrier.init instructions must hold: one count per mbarrier."""
        out: Counter = Counter()
        for b in self.barriers.values():
            out[b.count] += b.slots
        return out

    def tx_bytes(self) -> set[int]:
        out: set[int] = set()
        for v in self.tx.values():
            out |= set(v)
        return out


class _State:
    def __init__(self, b: Barrier):
        self.count = b.count
        self.pending = [b.count] * b.slots
        self.tx = [0] * b.slots
        self.phases = [0] * b.slots  # completed phases


class ProtocolError(Exception):
    pass


def _complete(name: str, st: _State, slot: int) -> None:
    if st.pending[slot] < 0:
        raise ProtocolError(f"{name}[{slot}]: {st.count - st.pending[slot]} arrivals in phase {st.phases[slot]} "
                            f"of a barrier initialised with {st.count}")
    if st.pending[slot] == 0 and st.tx[slot] == 0:
        st.phases[slot] += 1
        st.pending[slot] = st.count


def simulate(proto: Protocol, max_steps: int = 10_000_000) -> str | None:
    """None when every role of `proto` runs to its end and every barrier ends between phases;
    otherwise one line: the deadlock (each blocked role and what it waits on) or the error."""
    bars = {k: _State(b) for k, b in proto.barriers.items()}
    roles = {k: f() for k, f in proto.roles.items()}
    blocked: dict[str, Wait | None] = {k: None for k in roles}
    done: set[str] = set()
    steps = 0

    def run_role(name: str) -> bool:
        """Advance `name` until it blocks or ends; True when it made progress."""
        nonlocal steps
        moved = False
        gen = roles[name]
        while True:
            op = blocked[name]
            if op is None:
                try:
                    op = next(gen)
                except StopIteration:
                    done.add(name)
                    return True
            steps += 1
            if steps > max_steps:
                raise ProtocolError(f"more than {max_steps} operations: a role that never ends?")
            if op.bar not in bars:
                raise ProtocolError(f"role {name}: no barrier {op.bar!r}")
            st = bars[op.bar]
            if not 0 <= op.slot < len(st.pending):
                raise ProtocolError(f"role {name}: {op.bar}[{op.slot}] out of its {len(st.pending)} slots")
            if isinstance(op, Wait):
                k = st.phases[op.slot]
                if k > op.need:  # the phase it waits for completed and the barrier went on: the
                    # parity now names a later phase (hardware would hang or pass on the wrong data)
                    raise ProtocolError(f"role {name}: wait on {op.bar}[{op.slot}] for {op.need} completed "
                                        f"phase(s) found {k} (a lapped ring)")
                if k % 2 == op.parity:  # the phase with this parity has not completed
                    blocked[name] = op
                    return moved
                blocked[name] = None
                if k != op.need:
                    raise ProtocolError(f"role {name}: wait on {op.bar}[{op.slot}] parity {op.parity} meant "
                                        f"{op.need} completed phase(s) and passed with {k} (a stale phase)")
            elif isinstance(op, Arrive):
                st.tx[op.slot] += op.tx
                st.pending[op.slot] -= op.n
                _complete(op.bar, st, op.slot)
            else:
                st.tx[op.slot] -= op.n  # may go negative: bytes may land before the phase's
                _complete(op.bar, st, op.slot)  # expect_tx (the pending arrival holds the phase)
            moved = True

    try:
        while len(done) < len(roles):
            progress = False
            for name in roles:
                if name not in done and run_role(name):
                    progress = True
            if not progress:
                waits = []
                for name in roles:
                    if name in done:
                        continue
                    w = blocked[name]
                    st = bars[w.bar]
                    waits.append(f"role {name} waits on {w.bar}[{w.slot}] phase {st.phases[w.slot]} "
                                 f"(parity {w.parity}; {st.count - st.pending[w.slot]} of {st.count} arrivals, "
                                 f"{st.tx[w.slot]} bytes outstanding)")
                return f"{proto.name}: deadlock: " + "; ".join(waits)
    except ProtocolError as exc:
        return f"{proto.name}: {exc}"
    for name, st in bars.items():
        for s in range(len(st.pending)):
            if st.pending[s] != st.count or st.tx[s] != 0:
                return (f"{proto.name}: {name}[{s}] left mid-phase at the end ({st.count - st.pending[s]} of "
                        f"{st.count} arrivals, {st.tx[s]} bytes): an arrival after the CTA's last wait")
    return None


# ---------------------------------------------------------------------------------------
# A ring's pipeline state (cutlass.pipeline.PipelineState): fill g of a ring of `slots`.


def ring(g: int, slots: int) -> tuple[int, int]:
    """(slot, lap) of fill number g."""
    return g % slots, g // slots


def producer_wait(bar: str, g: int, slots: int) -> Wait:
    """The producer's acquire of fill g: its slot's empty barrier has completed `lap` phases
    (the producer's phase starts at 1: every slot starts empty)."""
    slot, lap = ring(g, slots)
    return Wait(bar, slot, (lap % 2) ^ 1, lap)


def consumer_wait(bar: str, g: int, slots: int) -> Wait:
    """The consumer's wait for fill g: its slot's full barrier has completed lap + 1 phases."""
    slot, lap = ring(g, slots)
    return Wait(bar, slot, lap % 2, lap + 1)


# ---------------------------------------------------------------------------------------
# The compiled PTX's facts: barrier-init counts and expect-tx byte counts.

_MOV = re.compile(r"mov\.[bus]32\s+(%r\d+),\s*(-?\d+);")
_SELP = re.compile(r"selp\.[bus]32\s+(%r\d+),\s*(-?\d+|%r\d+),\s*(-?\d+|%r\d+),\s*%p\d+;")
_INIT = re.compile(r"mbarrier\.init\.shared(?:::cta)?\.b64\s+\[[^\]]+\],\s*([^;]+);")
_EXPECT = re.compile(r"mbarrier\.(?:arrive\.)?expect_tx[\w.:]*\s+(?:[^,\[]+,\s*)?\[[^\]]+\],\s*([^;]+);")


def _values(tok: str, movs: dict[str, set[int]], selps: dict[str, tuple[str, str]], depth: int = 0) -> set[int] | None:
    tok = tok.strip()
    if re.fullmatch(r"-?\d+", tok):
        return {int(tok)}
    if depth > 4:
        return None
    got: set[int] = set()
    if tok in movs:
        got |= movs[tok]
    if tok in selps:
        for t in selps[tok]:
            v = _values(t, movs, selps, depth + 1)
            if v is None:
                return None
            got |= v
    return got or None


class PtxFacts(NamedTuple):
    init_counts: Counter  # count → how many mbarrier.init instructions initialise with it
    tx_bytes: set[int]  # every byte count an expect_tx can announce
    unresolved: list[str]  # operands whose value is not a constant of the PTX


def ptx_facts(ptx: str) -> PtxFacts:
    """The mbarrier.init counts and expect_tx byte counts of every kernel in `ptx`, operands resolved
        through the `mov` / `selp` of immediates that set their (virtual, set-once) registers."""
    inits: Counter = Counter()
    tx: set[int] = set()
    unresolved: list[str] = []
    for body in re.split(r"\.entry ", ptx)[1:]:
        movs: dict[str, set[int]] = {}
        for m in _MOV.finditer(body):
            movs.setdefault(m.group(1), set()).add(int(m.group(2)))
        selps = {m.group(1): (m.group(2), m.group(3)) for m in _SELP.finditer(body)}
        for m in _INIT.finditer(body):
            v = _values(m.group(1), movs, selps)
            if v is None or len(v) != 1:
                unresolved.append(f"mbarrier.init {m.group(1).strip()}")
            else:
                inits[next(iter(v))] += 1
        for m in _EXPECT.finditer(body):
            v = _values(m.group(1), movs, selps)
            if v is None:
                unresolved.append(f"expect_tx {m.group(1).strip()}")
            else:
                tx |= v
    return PtxFacts(inits, tx, unresolved)


def cross_check(proto: Protocol, facts: PtxFacts) -> list[str]:
    """What the protocol says against what the compiled kernel does: the multiset of barrier
    init counts and the set of transaction byte counts must be equal. [] when they agree."""
    bad = []
    want = proto.init_counts()
    if want != facts.init_counts:
        bad.append(f"{proto.name}: barrier init counts: protocol {dict(sorted(want.items()))} != PTX "
                   f"{dict(sorted(facts.init_counts.items()))}")
    if proto.tx_bytes() != facts.tx_bytes:
        bad.append(f"{proto.name}: expect_tx bytes: protocol {sorted(proto.tx_bytes())} != PTX "
                   f"{sorted(facts.tx_bytes)}")
    bad += [f"{proto.name}: PTX operand not a constant: {u}" for u in facts.unresolved]
    return bad
