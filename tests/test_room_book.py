"""The room book: the index follows snapshots, reservations, pools and claims' perGPU, and
rebuilds only the agents whose inputs changed."""

from __future__ import annotations

from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st

from contract.quantity import GiB
from reconciler.desired import ClaimKey
from reconciler.model.manifests import AgentRef, PerGPU, WarmPool
from reconciler.model.policy import PoolPolicy
from reconciler.model.selector import LabelSelector
from reconciler.observe import (
    AgentObs,
    EngineObs,
    GpuObs,
    Reservation,
    Reservations,
    candidate,
)
from reconciler.planning.placement import ClaimNeed, Placed, place
from reconciler.planning.state import Candidate, EngineState, Resident
from reconciler.core import scaled_timings
from reconciler.room_book import AgentDef, RoomBook
from tests.reconciler_fakes import FakeAgent, Rig, claim_yaml

LABELS = {"claim.model.aibrix.ai/pool": "pool-a", "claim.model.aibrix.ai/enabled": "true"}
NEED = ClaimNeed("default/new", LabelSelector({"claim.model.aibrix.ai/pool": "pool-a"}),
                 6 * GiB, GiB)
NOW = 100.0


def obs(name: str, *claims: str, usable: int = 16, at: float = NOW) -> AgentObs:
    engines = tuple(EngineObs(f"{c}-model", "vllm", "active", ("default", c), devices=(0,))
                    for c in claims)
    return AgentObs(name, True, at, at, gpus=(GpuObs(0, usable * GiB, 0),), engines=engines)




class World:
    """The inputs the reconciler keeps: pools, perGPU by claim, reservations, snapshots."""

    def __init__(self, agents: int) -> None:
        self.policy = PoolPolicy()
        self.defs: dict[str, AgentDef] = {}
        self.figures: dict[ClaimKey, PerGPU] = {}
        self.reservations = Reservations()
        self.observed = {f"a{i}": obs(f"a{i}") for i in range(agents)}
        self.redefine()
        self.builds: list[str] = []
        self.book = RoomBook(self.defs.get, self.reservations.version, self.build,
                             self.figures.get)

    def redefine(self, policy: PoolPolicy | None = None) -> None:
        self.policy = policy or self.policy
        refs = tuple(AgentRef(n, f"http://{n}", LABELS) for n in sorted(self.observed))
        pool = WarmPool("pool-a", "default", refs, self.policy)
        self.defs.clear()
        self.defs.update({a.name: (a, pool) for a in refs})

    def build(self, o: AgentObs, agent: AgentRef, pool: WarmPool) -> Candidate:
        self.builds.append(o.name)
        return self.fresh(o, agent, pool)

    def fresh(self, o: AgentObs, agent: AgentRef, pool: WarmPool) -> Candidate:
        return candidate(o, agent, pool, self.figures.get, lambda m: None,
                         self.reservations.live(o))

    def exhaustive(self) -> Placed | None:
        cands = [self.fresh(o, *self.defs[n]) for n, o in sorted(self.observed.items())
                 if n in self.defs]
        got = place(NEED, cands, NOW)
        return got if isinstance(got, Placed) else None

    def indexed(self) -> Placed | None:
        return self.book.sync(self.observed).best(NEED, NOW)


def test_an_unchanged_fleet_is_not_rebuilt() -> None:
    w = World(3)
    w.indexed()
    assert sorted(w.builds) == ["a0", "a1", "a2"] and w.book.rebuilds == 3
    w.indexed()
    w.book.claim_changed(("default", "nobody"))
    w.indexed()
    assert w.book.rebuilds == 3


def test_a_new_snapshot_rebuilds_that_agent_only() -> None:
    w = World(3)
    w.figures[("default", "x")] = PerGPU(6 * GiB, GiB)
    w.indexed()
    w.observed["a0"] = obs("a0", "x")
    w.builds.clear()
    assert w.indexed() == Placed("a1", (0,), 9 * GiB)
    assert w.builds == ["a0"]


def test_a_reservation_and_its_drop_rebuild_the_agent() -> None:
    w = World(2)
    assert w.indexed() == Placed("a0", (0,), 9 * GiB)
    w.reservations.add(Reservation("a0", "m", Resident("m", 6 * GiB, GiB, EngineState.STARTING),
                                   (0,), "activate", NOW))
    assert w.indexed() == Placed("a1", (0,), 9 * GiB)
    w.reservations.drop("a0", "m")
    assert w.indexed() == Placed("a0", (0,), 9 * GiB)
    assert w.book.rebuilds == 4


def test_a_claims_new_per_gpu_rebuilds_the_agents_its_engines_run_on() -> None:
    w = World(2)
    key = ("default", "x")
    w.figures[key] = PerGPU(2 * GiB, GiB)
    w.observed["a0"] = obs("a0", "x")
    assert w.indexed() == Placed("a1", (0,), 9 * GiB)
    w.observed["a1"] = obs("a1", "x")  # a second engine of the claim, as after a lost agent
    w.indexed()
    w.figures[key] = PerGPU(9 * GiB, GiB)
    assert w.indexed() == Placed("a0", (0,), 6 * GiB)  # not rebuilt yet: reads the old figures
    w.book.claim_changed(key)
    assert w.indexed() is None and w.exhaustive() is None


def test_a_claim_first_known_after_its_engine_turns_a_foreign_engine_into_a_claims() -> None:
    w = World(1)
    w.observed["a0"] = obs("a0", "x")
    assert w.indexed() is None  # an engine that answers to no claim: nothing placed beside it
    w.figures[("default", "x")] = PerGPU(2 * GiB, GiB)
    w.book.claim_changed(("default", "x"))
    assert w.indexed() == Placed("a0", (0,), 6 * GiB)


def test_agents_that_leave_are_dropped_and_a_pool_change_rebuilds() -> None:
    w = World(2)
    w.indexed()
    del w.observed["a0"]
    assert w.indexed() == Placed("a1", (0,), 9 * GiB) and "a0" not in w.book.index
    w.defs.pop("a1")
    assert w.indexed() is None and len(w.book.index) == 0
    w.observed["a0"] = obs("a0")
    w.redefine(PoolPolicy(300, True, 30))
    w.builds.clear()
    assert w.indexed() == Placed("a0", (0,), 9 * GiB) and sorted(w.builds) == ["a0", "a1"]


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["snap", "reserve", "drop", "figures", "pool",
                                           "leave"]),
                          st.integers(0, 3), st.integers(0, 3), st.integers(1, 9)),
                max_size=25))
def test_after_any_changes_the_index_chooses_what_a_scan_of_fresh_candidates_chooses(
        ops: list[tuple[str, int, int, int]]) -> None:
    w = World(4)
    for op, i, c, size in ops:
        name, key = f"a{i}", ("default", f"c{c}")
        if op == "snap":
            claims = [f"c{j}" for j in range(c)]
            w.observed[name] = obs(name, *claims, usable=8 + 2 * size)
        elif op == "reserve":
            w.reservations.add(Reservation(name, f"r{c}", Resident(
                f"r{c}", size * GiB, GiB, EngineState.STARTING), (0,), "activate", NOW))
        elif op == "drop":
            w.reservations.drop(name, f"r{c}")
        elif op == "figures":
            w.figures[key] = PerGPU(size * GiB // 2, GiB)
            w.book.claim_changed(key)
        elif op == "pool":
            w.redefine(PoolPolicy(300, size % 2 == 0, 30))
        else:
            w.observed.pop(name, None)
        assert w.indexed() == w.exhaustive()


# ---- through the claim reconciler, with the run modes' timings --------------------------------


async def test_a_placement_reads_again_only_the_agent_it_chooses(tmp_path: Path) -> None:
    agents = [FakeAgent(f"agent-{c}") for c in "abcd"]
    rig = Rig(tmp_path, agents, "".join(claim_yaml(f"c{i}") for i in range(3)))
    rig.deps.reader.timings = scaled_timings()  # others serve at any age unless made stale
    await rig.reconcile("c0")
    assert [a.snapshots for a in agents] == [1, 1, 1, 1]
    rig.clock.advance(60)  # every snapshot older than others_max_age
    await rig.claims.reconcile(("default", "c1"))
    assert [len(a.calls_of("activate")) for a in agents] == [1, 1, 0, 0]
    assert [a.snapshots for a in agents] == [2, 2, 1, 1]  # a: its own engine; b: the choice


async def test_a_chosen_agent_whose_new_snapshot_is_full_gives_way_to_the_next(
        tmp_path: Path) -> None:
    agents = [FakeAgent(f"agent-{c}") for c in "ab"]
    rig = Rig(tmp_path, agents, claim_yaml("c0"))
    rig.deps.reader.timings = scaled_timings()
    await rig.deps.reader.world()  # every agent seen, empty
    rig.clock.advance(60)
    agents[0].add("stray", "active", claim=("default", "gone"), port=1)  # seen by no event
    await rig.claims.reconcile(("default", "c0"))
    assert [len(a.calls_of("activate")) for a in agents] == [0, 1]
    assert [a.snapshots for a in agents] == [2, 2]
