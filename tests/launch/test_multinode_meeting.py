"""The node meeting before the elastic rendezvous: one roster for everyone, checked against the plan.
Nodes are threads here, meeting on a real TCP store on loopback."""

from __future__ import annotations

import threading
import time

import pytest

from heteroflow.errors import UserError
from heteroflow.launcher.launch import free_port
from heteroflow.launcher.rendezvous import (NodeEntry, check_roster, meet, open_store, parse_endpoint,
                                            plan_fingerprint, roster_problems)

PLAN_NODES = ["a", "b"]


def run_meeting(arrivals: list[tuple[str, str, float]], *, expected: int = 2, timeout_s: float = 2.0) -> dict:
    """Each (name, fingerprint, delay) arrives after `delay` s; returns name-or-index -> (roster, index, error)."""
    port = free_port()
    host_store, hosting = open_store("127.0.0.1", port, timeout_s=10)
    assert hosting
    results: dict = {}

    def node(i: int, name: str, fingerprint: str, delay: float) -> None:
        time.sleep(delay)
        store, _ = open_store("127.0.0.1", port, timeout_s=10)
        me = NodeEntry(node=name, fingerprint=fingerprint, host="h", pid=i)
        roster, index = meet(store, "run0", me, expected=expected, timeout_s=timeout_s)
        try:
            check_roster(roster, endpoint=f"127.0.0.1:{port}", plan_nodes=PLAN_NODES, me=me, my_index=index,
                         timeout_s=timeout_s)
            error = None
        except UserError as e:
            error = str(e)
        results[i] = (roster, index, error)

    threads = [threading.Thread(target=node, args=(i, *a)) for i, a in enumerate(arrivals)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert len(results) == len(arrivals)
    del host_store
    return results


def test_matching_nodes_agree_and_pass():
    results = run_meeting([("a", "f1", 0), ("b", "f1", 0.1)])
    rosters = {tuple(e.node for e in r) for r, _, _ in results.values()}
    assert len(rosters) == 1 and sorted(rosters.pop()) == ["a", "b"]
    assert all(error is None for _, _, error in results.values())


def test_duplicate_name_is_the_same_error_on_both_nodes():
    results = run_meeting([("a", "f1", 0), ("a", "f1", 0.1)])
    errors = {error for _, _, error in results.values()}
    assert len(errors) == 1
    error = errors.pop()
    assert "node 'a' joined 2 times (host h pid 0, host h pid 1)" in error
    assert "node 'b' of the plan did not join (the first 2 to arrive were taken)" in error


def test_missing_node_is_reported_at_the_deadline_not_a_hang():
    started = time.monotonic()
    results = run_meeting([("a", "f1", 0)], timeout_s=1.0)
    assert time.monotonic() - started < 10
    (_, _, error), = results.values()
    assert "node 'b' of the plan did not join within 1 s" in error and "nodes that joined: 'a' (host h, pid 0)" in error


def test_late_node_learns_the_roster_it_missed():
    results = run_meeting([("a", "f1", 0), ("b", "f1", 0.1), ("b", "f1", 0.6)])
    late = results[2]
    assert late[1] == 2 and "arrived after the meeting had decided" in late[2]
    assert results[0][2] is None and results[1][2] is None


def test_different_jobs_are_refused():
    results = run_meeting([("a", "f1", 0), ("b", "f2", 0.1)])
    for _, _, error in results.values():
        assert "the nodes disagree on the job ('a': job f1; 'b': job f2)" in error


def test_roster_problems_name_unknown_nodes_and_local_problems():
    me = NodeEntry("c", "f", "h", 1)
    roster = [NodeEntry("a", "f", "h", 0), me, NodeEntry("b", "f", "h", 2, problem="needs 2 nvidia devices")]
    found = roster_problems(roster, plan_nodes=PLAN_NODES, me=me, my_index=1, timeout_s=5)
    assert any("node 'c' joined, but the plan has no ranks on a node of that name" in p for p in found)
    assert "node 'b' cannot run its ranks: needs 2 nvidia devices" in found


def test_fingerprint_changes_with_the_job_and_endpoint_parsing():
    assert plan_fingerprint({"x": 1}, steps=3) == plan_fingerprint({"x": 1}, steps=3)
    assert plan_fingerprint({"x": 1}, steps=3) != plan_fingerprint({"x": 1}, steps=4)
    assert parse_endpoint("10.0.0.1:29400") == ("10.0.0.1", 29400)
    assert parse_endpoint("[::1]:29400") == ("::1", 29400)
    for bad in ("10.0.0.1", ":1", "host:0", "host:x", "host:70000"):
        with pytest.raises(UserError, match="--rdzv expects HOST:PORT"):
            parse_endpoint(bad)


def test_unreachable_rendezvous_is_a_bounded_user_error(monkeypatch):
    import heteroflow.launcher.rendezvous as rendezvous
    monkeypatch.setattr(rendezvous, "_is_this_machine", lambda host: False)  # a node on another machine
    port = free_port()  # nobody listens there
    started = time.monotonic()
    with pytest.raises(UserError, match=f"cannot reach the rendezvous at 127.0.0.1:{port} within 1 s"):
        open_store("127.0.0.1", port, timeout_s=1)
    assert time.monotonic() - started < 30
