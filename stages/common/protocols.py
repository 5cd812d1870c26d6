"""The mbarrier protocols of the kernel families, for the CPU simulator (stages/common/pipesim.py).

Each builder reads the plan a kernel computes in its constructor and writes every role's barrier
operations in the order the kernel's role methods (named in each docstring) issue them, for one
CTA.  pipesim.cross_check holds the init and expect_tx counts to the compiled PTX; the loops
must be kept in step with the role methods.

Families: decode_sm100 (DecodeSm100: load warp, MMA warp, 128 softmax threads; q, kv, s, p, o),
sparse_sm100 (stage E sm100: the house's MMA and softmax roles, the index warp, 4 dequantisation
warps; + mask, raw), indexer_sm100 (I1, I2: load, MMA, 128 epilogue threads; q, k, acc),
decode_sm90 (DecodeSm90: load warp, two MMA warpgroups; q, kv) and decode_sm90_persistent,
indexer_sm90_persistent (I1, I2 on Hopper), sparse_sm90 (stage E on Hopper: parts, producer
warps, both MMA warpgroups, the 2-CTA pair's remote barriers).  Not modelled: stages A–D1, named
barriers, stage E sm90's global-memory merge flag."""

from __future__ import annotations

from typing import Iterator

from stages.common.pipesim import Arrive, Barrier, Bytes, Op, Protocol, Wait, consumer_wait, producer_wait, ring


# ---------------------------------------------------------------------------------------
# sm100 decode house (D2–D5) and stage E on it


def _house(k, n_local: int, shift: int, roles: dict, barriers: dict, tx: dict, name: str,
           kv_release_n: int = 1) -> Protocol:
    """The MMA warp and the softmax warps of DecodeSm100 (mma_role / qk_chunks / pv_tile /
    release_v, softmax_role), plus the barriers they share."""
    R, C, S, T = k.slots, k.n_chunks, k.s_stages, k.SOFTMAX_THREADS
    masked_by_ring = "mask" in barriers

    def qk(j: int, lo: int, hi: int) -> Iterator[Op]:
        for p in range(lo, hi):
            g = j * C + p
            yield consumer_wait("kv.full", g, R)
            if p < k.n_nonv:  # a chunk that is only K: released right after its MMAs
                yield Arrive("kv.empty", ring(g, R)[0], kv_release_n)

    def release_v(j: int) -> Iterator[Op]:
        for t in range(k.n_v):
            yield Arrive("kv.empty", ring(j * C + k.n_nonv + t, R)[0], kv_release_n)

    def mma() -> Iterator[Op]:
        yield consumer_wait("q.full", 0, 1)
        sg = 0
        if n_local > 0:
            yield producer_wait("s.empty", sg, S)
            yield from qk(0, 0, C)
            yield Arrive("s.full", ring(sg, S)[0])
            sg += 1
        for j in range(n_local - 1):
            yield producer_wait("s.empty", sg, S)
            yield from qk(j + 1, 0, k.qk_early)
            yield consumer_wait("p.full", j, 1)
            yield Arrive("p.empty", 0)  # tcgen05.commit: PV_j complete
            yield from release_v(j)
            yield from qk(j + 1, k.qk_early, C)
            yield Arrive("s.full", ring(sg, S)[0])
            sg += 1
        if n_local > 0:
            yield consumer_wait("p.full", n_local - 1, 1)
            yield Arrive("p.empty", 0)
            yield from release_v(n_local - 1)
        yield producer_wait("o.empty", 0, 1)
        yield Arrive("o.full", 0)
        yield Arrive("q.empty", 0)  # q_full.release

    def softmax() -> Iterator[Op]:
        for j in range(n_local):
            yield consumer_wait("s.full", j, S)
            yield Arrive("s.empty", ring(j, S)[0], T)
            if masked_by_ring:  # stage E: SparseKeys.mask
                ms = barriers["mask"][0].slots
                yield consumer_wait("mask.full", j, ms)
                yield Arrive("mask.empty", ring(j, ms)[0], T)
            yield producer_wait("p.empty", j, 1)
            yield Arrive("p.full", 0, T)
        yield consumer_wait("o.full", 0, 1)
        yield Arrive("o.empty", 0, T)

    bars = {
        "q.full": Barrier(1, 1), "q.empty": Barrier(1, 1),
        "s.full": Barrier(S, 1), "s.empty": Barrier(S, T),
        "p.full": Barrier(1, T), "p.empty": Barrier(1, 1),
        "o.full": Barrier(1, 1), "o.empty": Barrier(1, T),
    }
    bars.update({f"{b}.{side}": v for b, (full, empty) in barriers.items() for side, v in (("full", full), ("empty", empty))})
    return Protocol(name, bars, {**roles, "mma": mma, "softmax": softmax}, {"q": {k.ring["Q"]}, **tx})


def _load_q(q_bytes: int) -> Iterator[Op]:
    yield producer_wait("q.empty", 0, 1)
    yield Arrive("q.full", 0, 1, q_bytes)
    yield Bytes("q.full", 0, q_bytes)


def decode_sm100(k, n_local: int, half: int = 0) -> Protocol:
    """DecodeSm100 (D2–D5) for one CTA visiting `n_local` KV tiles; `half` its O half
    (the load order's shift).  load_role: Q, the chunks of every tile, the ring tail, q tail."""
    R, C = k.slots, k.n_chunks
    K = k.ring["chunk_bytes"]

    def load() -> Iterator[Op]:
        yield from _load_q(k.ring["Q"])
        for g in range(n_local * C):
            yield producer_wait("kv.empty", g, R)
            yield Arrive("kv.full", ring(g, R)[0], 1, K)
            yield Bytes("kv.full", ring(g, R)[0], K)
        for i in range(R):
            yield producer_wait("kv.empty", n_local * C + i, R)
        yield producer_wait("q.empty", 1, 1)  # q_prod.tail()

    return _house(k, n_local, 0, {"load": load}, {"kv": (Barrier(R, 1), Barrier(R, 1))}, {"kv": {K}},
                  f"{type(k).__module__} n_local={n_local} half={half}")


def sparse_sm100(k, n_local: int, half: int = 0, mask_slots: int = 2, raw_slots: int = 2,
                 dequant_warps: int = 4) -> Protocol:
    """Stage E on sm100, one CTA of `n_local` tiles: index_role (Q; per tile the mask slot, per chunk a
        raw slot: sidecar + arrive.expect_tx of the gathered bytes; the tails) and dequant_role (per
        chunk: raw slot, chunk-ring slot, release raw, commit ring; the ring tail)."""
    R, C = k.slots, k.n_chunks
    shift = ((half + 1) * k.n_v) % C
    dq = k.DEQUANT_THREADS

    def chunk_bytes(p: int) -> int:
        if not k.gather:
            return 0  # `simple`: the sidecar only
        cid = (p + shift) % C
        return 64 * (192 if k.fmt == "model1" and cid == C - 1 else 128)

    def index() -> Iterator[Op]:
        yield from _load_q(k.ring["Q"])
        for j in range(n_local):
            yield producer_wait("mask.empty", j, mask_slots)
            yield Arrive("mask.full", ring(j, mask_slots)[0], 32)
            for p in range(C):
                g = j * C + p
                yield producer_wait("raw.empty", g, raw_slots)
                nbytes = chunk_bytes(p)
                yield Arrive("raw.full", ring(g, raw_slots)[0], 1, nbytes)
                if nbytes:
                    yield Bytes("raw.full", ring(g, raw_slots)[0], nbytes)
        for i in range(raw_slots):
            yield producer_wait("raw.empty", n_local * C + i, raw_slots)
        yield producer_wait("q.empty", 1, 1)

    def dequant() -> Iterator[Op]:
        for g in range(n_local * C):
            yield consumer_wait("raw.full", g, raw_slots)
            if not k.gather:
                yield Arrive("raw.empty", ring(g, raw_slots)[0], dequant_warps)
            yield producer_wait("kv.empty", g, R)
            if k.gather:
                yield Arrive("raw.empty", ring(g, raw_slots)[0], dequant_warps)
            yield Arrive("kv.full", ring(g, R)[0], dq)
        for i in range(R):
            yield producer_wait("kv.empty", n_local * C + i, R)

    tx = {"raw": {chunk_bytes(p) for p in range(C)} if k.gather else {0}}
    return _house(k, n_local, shift, {"index": index, "dequant": dequant},
                  {"kv": (Barrier(R, dq), Barrier(R, 1)),
                   "mask": (Barrier(mask_slots, 32), Barrier(mask_slots, k.SOFTMAX_THREADS)),
                   "raw": (Barrier(raw_slots, 1), Barrier(raw_slots, dequant_warps))},
                  tx, f"{type(k).__module__} {k.fmt} n_local={n_local} half={half}")


# ---------------------------------------------------------------------------------------
# sm100 indexer (I1, I2)


def indexer_sm100(k, tiles: int, boxes: int = 1) -> Protocol:
    """The Sm100 indexer, one CTA of `tiles` key tiles: load_role (Q once if any tile, a K slot a tile
        of `boxes` TMA boxes, k_prod.tail), mma_key_tiles (Q, per tile an acc buffer and the K slot,
        both released by tcgen05.commit) and the epilogue (per tile the acc buffer, 128 threads)."""
    S, A, T = k.STAGES, k.ACC_STAGES, k.EPI_THREADS
    block_k, n, dim = k.mma_tiler
    k_bytes, q_bytes = block_k * dim, n * dim  # e4m3: one byte an element

    def load() -> Iterator[Op]:
        yield from q_then_key_ring(tiles, q_bytes, S, k_bytes, boxes)
        for i in range(S):  # k_prod.tail()
            yield producer_wait("k.empty", tiles + i, S)

    def mma() -> Iterator[Op]:
        if tiles > 0:
            yield consumer_wait("q.full", 0, 1)
        for t in range(tiles):
            yield producer_wait("acc.empty", t, A)
            yield consumer_wait("k.full", t, S)
            yield Arrive("k.empty", ring(t, S)[0])
            yield Arrive("acc.full", ring(t, A)[0])

    def epilogue() -> Iterator[Op]:
        for t in range(tiles):
            yield consumer_wait("acc.full", t, A)
            yield Arrive("acc.empty", ring(t, A)[0], T)

    bars = {"q.full": Barrier(1, 1), "q.empty": Barrier(1, 1), "k.full": Barrier(S, 1), "k.empty": Barrier(S, 1),
            "acc.full": Barrier(A, 1), "acc.empty": Barrier(A, T)}
    return Protocol(f"{type(k).__module__} tiles={tiles}", bars, {"load": load, "mma": mma, "epilogue": epilogue},
                    {"q": {q_bytes}, "k": {k_bytes}})


def q_then_key_ring(tiles: int, q_bytes: int, slots: int, k_bytes: int, boxes: int = 1) -> Iterator[Op]:
    """A load warp's TMA protocol, both archs: Q once (when the CTA has a tile), then tile t into slot
        t mod `slots` (the empty barrier, arrive.expect_tx of `k_bytes` in `boxes` boxes)."""
    if tiles > 0:
        yield producer_wait("q.empty", 0, 1)
        yield Arrive("q.full", 0, 1, q_bytes)
        yield Bytes("q.full", 0, q_bytes)
    for t in range(tiles):
        yield producer_wait("k.empty", t, slots)
        yield Arrive("k.full", ring(t, slots)[0], 1, k_bytes)
        for _ in range(boxes):
            yield Bytes("k.full", ring(t, slots)[0], k_bytes // boxes)


# ---------------------------------------------------------------------------------------
# sm90: one load warp, a Q slot and a TMA ring of key tiles (PipelineTmaAsync)


def tma_ring_sm90(name: str, tiles: int, slots: int, q_bytes: int, q_consumer_warps: int, k_bytes: int,
                  k_consumer_warps: int, consumers: tuple) -> Protocol:
    """The Hopper kernels on sm90_setup.py's TMA pipelines: Q once (load_once), tile t into slot t mod
        `slots` (producer_acquire, expect_tx of `k_bytes`); no producer tail.  `consumers`: (role,
        first tile, step, arrivals a release), one role per group of warps walking the tiles alike
        (a decode CTA's warpgroups: 8 warps, one arrival each; I2's take turns: 4 each).  Every
        consumer waits for Q first."""

    def load() -> Iterator[Op]:
        yield from q_then_key_ring(tiles, q_bytes, slots, k_bytes)

    def consumer(first: int, step: int, n: int):
        def run() -> Iterator[Op]:
            if tiles > 0:
                yield consumer_wait("q.full", 0, 1)
            for t in range(first, tiles, step):
                yield consumer_wait("k.full", t, slots)
                yield Arrive("k.empty", ring(t, slots)[0], n)
        return run

    roles = {"load": load, **{role: consumer(first, step, n) for role, first, step, n in consumers}}
    bars = {"q.full": Barrier(1, 1), "q.empty": Barrier(1, q_consumer_warps),
            "k.full": Barrier(slots, 1), "k.empty": Barrier(slots, k_consumer_warps)}
    return Protocol(f"{name} tiles={tiles}", bars, roles, {"q": {q_bytes}, "k": {k_bytes}})


def decode_sm90(k, tiles: int) -> Protocol:
    """DecodeSm90 (D2–D5 on Hopper): `load` (Q, then the visited KV tiles of either branch) and
        `attend` (warpgroup 0 waits for Q; both wait for and release each slot, one arrival a warp)."""
    warps = k.MMA_THREADS // 32
    return tma_ring_sm90(type(k).__module__, tiles, k.stages, k.BLOCK_M * k.d * 2, 4, k.block_n * k.d * 2, warps,
                         (("mma", 0, 1, warps),))


def decode_sm90_persistent(k, item_tiles: list[int]) -> Protocol:
    """DecodeSm90 with PERSISTENT (D2): one CTA walking its items, item j visiting item_tiles[j] tiles
        (0: no load).  Per item the load warp waits for the Q slot, loads Q, then the tiles into the
        ring (running on across items); warpgroup 0 waits for Q and frees it after the item's last
        S (4 arrivals); both warpgroups wait for and release each slot."""
    warps = k.MMA_THREADS // 32
    q_bytes, k_bytes, slots = k.BLOCK_M * k.d * 2, k.block_n * k.d * 2, k.stages

    def load() -> Iterator[Op]:
        t = q = 0
        for n in item_tiles:
            if n == 0:
                continue
            yield producer_wait("q.empty", q, 1)
            yield Arrive("q.full", 0, 1, q_bytes)
            yield Bytes("q.full", 0, q_bytes)
            for _ in range(n):
                yield producer_wait("k.empty", t, slots)
                yield Arrive("k.full", ring(t, slots)[0], 1, k_bytes)
                yield Bytes("k.full", ring(t, slots)[0], k_bytes)
                t += 1
            q += 1

    def mma() -> Iterator[Op]:
        t = q = 0
        for n in item_tiles:
            if n == 0:
                continue
            yield consumer_wait("q.full", q, 1)
            for i in range(n):
                yield consumer_wait("k.full", t, slots)
                if i == n - 1:
                    yield Arrive("q.empty", 0, 4)  # warpgroup 0, after the item's last S
                yield Arrive("k.empty", ring(t, slots)[0], warps)
                t += 1
            q += 1

    bars = {"q.full": Barrier(1, 1), "q.empty": Barrier(1, 4), "k.full": Barrier(slots, 1), "k.empty": Barrier(slots, warps)}
    return Protocol(f"{type(k).__module__} items={item_tiles}", bars, {"load": load, "mma": mma},
                    {"q": {q_bytes}, "k": {k_bytes}})


def indexer_sm90_persistent(k, segment_blocks: list[int], every_tile: bool = False) -> Protocol:
    """I1 and I2 on Hopper, persistent: one CTA walking its share's segments, segment j of
        `segment_blocks[j]` tiles.  Per segment the load warp waits for the next of Q_SLOTS Q slots,
        loads Q, then the tiles into the K ring (running on); every MMA warp waits for the segment's
        Q and frees it after.  I2: warpgroup w of W takes tiles w, w + W, … (4 arrivals a slot; one
        with none still frees its Q), Q one box; `every_tile` (I1): every warpgroup reads every tile
        (4 arrivals each), Q one box a warpgroup."""
    dim = k.dim
    warps, wgs, slots, q_slots = k.MMA_THREADS // 32, k.NUM_MMA_WG, k.STAGES, k.Q_SLOTS
    q_bytes, k_bytes = k.n * dim * (wgs if every_tile else 1), k.BLOCK_K * dim
    readers = warps if every_tile else 4  # warps that read (and free) a K slot
    segs = [n for n in segment_blocks if n > 0]

    def load() -> Iterator[Op]:
        t = 0
        for j, n in enumerate(segs):
            slot = ring(j, q_slots)[0]
            yield producer_wait("q.empty", j, q_slots)
            yield Arrive("q.full", slot, 1, q_bytes)
            yield Bytes("q.full", slot, q_bytes)
            for _ in range(n):
                yield producer_wait("k.empty", t, slots)
                yield Arrive("k.full", ring(t, slots)[0], 1, k_bytes)
                yield Bytes("k.full", ring(t, slots)[0], k_bytes)
                t += 1

    def mma(w: int):
        def run() -> Iterator[Op]:
            pos = 0
            for j, n in enumerate(segs):
                yield consumer_wait("q.full", j, q_slots)
                for t in range(pos, pos + n):
                    if every_tile or t % wgs == w:
                        yield consumer_wait("k.full", t, slots)
                        yield Arrive("k.empty", ring(t, slots)[0], 4)
                yield Arrive("q.empty", ring(j, q_slots)[0], 4)
                pos += n
        return run

    roles = {"load": load, **{f"mma_wg{w}": mma(w) for w in range(wgs)}}
    bars = {"q.full": Barrier(q_slots, 1), "q.empty": Barrier(q_slots, warps),
            "k.full": Barrier(slots, 1), "k.empty": Barrier(slots, readers)}
    return Protocol(f"{type(k).__module__} segments={segs}", bars, roles, {"q": {q_bytes}, "k": {k_bytes}})


# ---------------------------------------------------------------------------------------
# Stage E on sm90: persistent parts, and a 2-CTA cluster pair at h_q = 128


def sparse_sm90(k, part: int, head_block: int = 0) -> Protocol:
    """Stage E on Hopper for part `part`, per CTA of the cluster (pair barriers `<name>@<rank>`):
        `produce` (per tile the slot's empty barrier, in a pair remote_empty and the arming of
        remote_full with the peer's bytes; the halves land here and by st.async in the peer; commit
        = every producer thread arrives) and `attend` (Q of segment 0, then per segment its Q
        (parity k mod 2), per tile full and remote_full, the next Q issued during the last tile,
        the release — a lane a warp, locally and on the peer's remote_empty).  Not modelled: the
        named barriers and the merge's global-memory flag."""
    g = k.sched
    R, warps, prod = k.KV_STAGES, k.MMA_THREADS // 32, k.plan.producer_threads
    q_bytes = k.BLOCK_M * 512 * 2
    ranks = (0, 1) if k.pair else (0,)
    segs = [g.segment(head_block, part, s) for s in range(g.segments(part))]

    def b(name: str, rank: int) -> str:
        return f"{name}@{rank}"

    def producer(c: int):
        def run() -> Iterator[Op]:
            for work, before in segs:
                for i in range(work.tile_end - work.tile_begin):
                    t = before + i
                    slot = ring(t, R)[0]
                    w = producer_wait(b("kv.empty", c), t, R)
                    yield w
                    if k.pair:
                        yield producer_wait(b("remote_empty", c), t, R)
                        yield Arrive(b("remote_full", c), slot, 1, k.peer_bytes)
                        yield Bytes(b("remote_full", c ^ 1), slot, k.peer_bytes)  # st.async into the peer
                    yield Arrive(b("kv.full", c), slot, prod)
        return run

    def attend(c: int):
        def run() -> Iterator[Op]:
            yield Arrive(b("q", c), 0, 1, q_bytes)
            yield Bytes(b("q", c), 0, q_bytes)
            for s, (work, before) in enumerate(segs):
                yield Wait(b("q", c), 0, s % 2, s + 1)
                n = work.tile_end - work.tile_begin
                for i in range(n):
                    t = before + i
                    slot = ring(t, R)[0]
                    yield consumer_wait(b("kv.full", c), t, R)
                    if k.pair:
                        yield consumer_wait(b("remote_full", c), t, R)
                    if i == n - 1 and s + 1 < len(segs):  # the next segment's Q
                        yield Arrive(b("q", c), 0, 1, q_bytes)
                        yield Bytes(b("q", c), 0, q_bytes)
                    yield Arrive(b("kv.empty", c), slot, warps)
                    if k.pair:
                        yield Arrive(b("remote_empty", c ^ 1), slot, warps)
        return run

    bars: dict[str, Barrier] = {}
    roles = {}
    for c in ranks:
        bars.update({b("q", c): Barrier(1, 1), b("kv.full", c): Barrier(R, prod), b("kv.empty", c): Barrier(R, warps)})
        if k.pair:
            bars.update({b("remote_full", c): Barrier(R, 1), b("remote_empty", c): Barrier(R, warps)})
        roles[f"producer@{c}"] = producer(c)
        roles[f"attend@{c}"] = attend(c)
    tx = {"q": {q_bytes}, **({"remote_full": {k.peer_bytes}} if k.pair else {})}
    return Protocol(f"{type(k).__module__} {k.fmt} part={part}", bars, roles, tx)


def one_cta(proto: Protocol) -> Protocol:
    """The barriers of rank 0 only: what one CTA's PTX initialises (for the cross-check)."""
    bars = {n: b for n, b in proto.barriers.items() if "@" not in n or n.endswith("@0")}
    return Protocol(proto.name, bars, proto.roles, proto.tx)
