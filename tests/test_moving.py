"""Make before break, the parts without processes: a draining agent takes nothing new, and a
claim's status lists the engine a move brings up beside its own (``reconciler.moving``; the
end-to-end path is ``tests.test_moving_integration``'s and ``tests.test_moving_kube``'s)."""

from __future__ import annotations

from reconciler.model.manifests import DRAINING_LABEL, parse_manifests
from reconciler.planning.placement import Placed, Unplaced, place
from reconciler.status import ClaimStatus
from tests.reconciler_fakes import claim_yaml
from tests.test_reconciler_planning_placement import NOW, POOL_LABELS, agent, need


def test_a_draining_agent_takes_no_new_claim_and_says_why() -> None:
    draining = agent("a", labels={**POOL_LABELS, DRAINING_LABEL: "true"})
    got = place(need(), [draining], NOW)
    assert isinstance(got, Unplaced) and "a: draining" in got.message
    placed = place(need(), [draining, agent("b")], NOW)
    assert isinstance(placed, Placed) and placed.agent == "b"
    assert not agent("c", labels={**POOL_LABELS, DRAINING_LABEL: "false"}).draining


def status() -> ClaimStatus:
    (claim,) = parse_manifests(claim_yaml("c")).claims
    st = ClaimStatus("default", "c", "uid", 0.0)
    st.set_spec(claim)
    return st


def test_a_move_lists_the_new_engine_after_the_claim_s_own_until_it_is_cleared() -> None:
    st = status()
    st.set_moving("agent-b", 20001, (0,))
    assert st.instances == []  # no engine of its own: nothing to move from
    st.set_instance("agent-a", 20000, (0,))
    st.set_moving("agent-b", 20001, (0,))
    shown = st.as_json()["status"]["instances"]
    assert [(i["pod"], i.get("moving")) for i in shown] == [("agent-a", None),
                                                            ("agent-b", True)]
    st.set_instance("agent-a", 20000, (0,))  # following its own engine keeps the move listed
    assert len(st.instances) == 2 and st.instance is not None and st.instance.agent == "agent-a"
    st.set_moving(None)
    assert [i.agent for i in st.instances] == ["agent-a"]
    st.set_moving("agent-b", 20001, (0,))
    st.set_instance("agent-b", 20001, (0,))  # the switch: the new engine is the claim's
    assert [(i.agent, i.moving) for i in st.instances] == [("agent-b", False)]
    st.set_instance(None)
    assert st.instances == []


def test_a_status_read_back_keeps_the_move() -> None:
    st = status()
    st.set_instance("agent-a", 20000, (0,))
    st.set_moving("agent-b", 20001, (0,))
    back = ClaimStatus.from_json(st.as_json())
    assert [(i.agent, i.moving) for i in back.instances] == [("agent-a", False),
                                                             ("agent-b", True)]
