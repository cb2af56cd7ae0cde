"""The cluster's plain parts, without Ray or processes: errors carried from a group, request weights,
placement bundles, and the front's merge of the groups' pushes (snapshots, counters across restarts,
the timeline)."""
import pickle

from computron.cluster.board import Board, Timeline, add_counters
from computron.cluster.groups import GroupUpdate, group_bundle, model_of, request_tokens
from computron.cluster.relay import Relayed
from computron.cluster.policy import GroupState
from computron.engine import EngineSnapshot, ModelSnapshot
from computron.errors import EngineDeadError, PayloadError, UnknownModelError


def test_errors_keep_their_type_and_fields_through_pickle():
    for exc in (UnknownModelError("x", ["a", "b"]), PayloadError("bad", param="max_tokens", reason="r"),
                EngineDeadError("engine is dead: worker rank 0 exited")):
        back = pickle.loads(pickle.dumps(Relayed.of(exc))).original()
        assert type(back) is type(exc) and str(back) == str(exc)
    assert pickle.loads(pickle.dumps(Relayed.of(UnknownModelError("x", [])))).original().model_id == "x"
    assert pickle.loads(pickle.dumps(Relayed.of(PayloadError("bad", "seed")))).original().param == "seed"


def test_request_weights_model_ids_and_bundles():
    assert request_tokens({"input_ids": [1], "max_tokens": 7}) == 7
    assert request_tokens({"input_ids": [1]}) == 16 and request_tokens({"pixel_values": []}) == 1
    assert model_of("m@v3") == "m" and model_of("m") == "m"
    assert group_bundle(2, 2, 2, {"CPU": 10}, False) == {"CPU": 5}
    assert group_bundle(2, 2, 2, {"CPU": 8, "GPU": 8}, True) == {"CPU": 4, "GPU": 4}
    assert group_bundle(1, 1, 2, {"CPU": 2}, False) == {"CPU": 1}


def _model(state, tier="host", waiting=0, wall=0.0):
    return ModelSnapshot(state=state, tier=tier, waiting=waiting, running=0, paused=0, token_level=True,
                         pinned=False, last_load={"wall_time": wall} if wall else None)


def _update(group, inc, models, counters, events=()):
    snap = EngineSnapshot(True, None, models)
    state = GroupState(group=group, served=frozenset(models),
                       resident=frozenset(m for m, s in models.items() if s.state == "loaded"))
    return GroupUpdate(state, snap, counters, list(events), inc)


def test_board_merges_groups_and_keeps_counters_across_restarts():
    b = Board(2)
    b.record(0, _update(0, "a", {"m": _model("loaded", "device", 1, wall=5.0)}, {"swaps": {("m", "load"): 2}}))
    b.record(1, _update(1, "b", {"m": _model("offloaded", waiting=2, wall=9.0)}, {"swaps": {("m", "load"): 1}}))
    snap = b.snapshot(["m"], True, None)
    m = snap.models["m"]
    assert (m.state, m.tier, m.waiting, m.groups, m.last_load) == ("loaded", "device", 3, {0: "loaded", 1: "offloaded"},
                                                                    {"wall_time": 9.0})
    assert b.counters() == {"swaps": {("m", "load"): 3}}
    b.down(1, "engine group 1 died: boom")
    assert b.snapshot(["m"], True, None).models["m"].groups == {0: "loaded"}
    assert "group 1: engine group 1 died: boom" in b.reasons()
    assert b.record(1, _update(1, "c", {"m": _model("offloaded")}, {"swaps": {("m", "load"): 1}}))  # restarted
    assert b.counters() == {"swaps": {("m", "load"): 4}} and b.views[1].restarts == 1
    assert add_counters({"a": {"x": 1}}, {"a": {"x": 2, "y": 1}}) == {"a": {"x": 3, "y": 1}}


def test_timeline_sends_an_extended_event_again_under_its_id():
    t = Timeline()
    t.add(0, "a", [{"id": 1, "kind": "load"}, {"id": 2, "kind": "step", "steps": 1}])
    t.add(1, "b", [{"id": 1, "kind": "load"}])
    cursor, evs = t.since(0)
    assert [(e["id"], e["group"]) for e in evs] == [(1, 0), (2, 0), (3, 1)] and cursor == 3
    t.add(0, "a", [{"id": 2, "kind": "step", "steps": 5}])  # the group extended its step bar
    cursor, evs = t.since(cursor)
    assert [(e["id"], e["steps"]) for e in evs] == [(2, 5)] and cursor == 4
