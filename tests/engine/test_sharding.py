"""Host-only tests of the sharding rules, mesh shapes, the wire encoding and the control
channel (1 device; the 8-device tests are in test_sharding_devices.py)."""
from __future__ import annotations

import socket
import threading
import time

import pytest
import yaml

from jaxserve.config import ConfigError
from jaxserve.parallel import ShardingPlan, ShardingRules, ShardingRulesError, make_mesh
from jaxserve.core.multihost import codec as wire
from jaxserve.core.multihost.control import Follower, Leader
from jaxserve.parallel.mesh import mesh_shape_from
from jaxserve.parallel.rules import BUILTIN_RULES, DEFAULT_RULES_FILE
from jaxserve.sampling.params import SamplingParams
from jaxserve.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput

from engine_utils import tiny_config


# ---- rules --------------------------------------------------------------------------------
def test_default_file_equals_builtin_copy():
    rules = ShardingRules.load()
    assert rules.source == str(DEFAULT_RULES_FILE)
    assert dict(rules.rules) == BUILTIN_RULES and rules.uneven == "replicate"


def test_spec_maps_logical_axes():
    rules = ShardingRules.load()
    assert tuple(rules.spec(("embed", "heads"))) == (None, "model")
    assert tuple(rules.spec(("ffn", "embed"))) == ("model", None)
    assert tuple(rules.spec(("embed", "heads"), dropped=frozenset({"heads"}))) == (None, None)


def test_two_axes_on_one_mesh_axis_are_refused():
    rules = ShardingRules.from_mapping({"rules": dict(BUILTIN_RULES, embed="model")}, "test")
    with pytest.raises(ShardingRulesError, match="'embed' and 'heads' both on mesh axis 'model'"):
        rules.spec(("embed", "heads"), name="wq")
    # ...and a plan refuses at start-up, whatever the sizes (here TP=1, nothing is split).
    with pytest.raises(ShardingRulesError, match="both on mesh axis"):
        ShardingPlan.build(tiny_config(), make_mesh(1), rules)


@pytest.mark.parametrize("bad, match", [
    ({"rules": {"heads": "tensor"}}, "unknown mesh axis"),
    ({"rules": {"heads": 3}}, "must be a mesh axis name"),
    ({"rules": {}, "uneven": "pad"}, "uneven must be one of"),
    ({"rules": {}, "extra": 1}, "unknown key"),
    ({"heads": "model"}, "'rules:' section"),
])
def test_bad_rule_files_are_refused(bad, match):
    with pytest.raises(ShardingRulesError, match=match):
        ShardingRules.from_mapping(bad, "test")


def test_rules_file_with_mesh_section(tmp_path):
    p = tmp_path / "r.yaml"
    p.write_text(yaml.safe_dump({"rules": dict(BUILTIN_RULES), "mesh": {"data": 2, "model": 4}}))
    rules = ShardingRules.load(p)
    assert mesh_shape_from(1, 1, rules.mesh_section) == (2, 4)
    assert mesh_shape_from(4, 1, rules.mesh_section) == (2, 4)
    with pytest.raises(ConfigError, match="contradicts"):
        mesh_shape_from(2, 1, rules.mesh_section)
    with pytest.raises(ShardingRulesError, match="does not exist"):
        ShardingRules.load(tmp_path / "missing.yaml")


def test_uneven_error_policy_names_the_axis():
    rules = ShardingRules.from_mapping({"rules": dict(BUILTIN_RULES), "uneven": "error"}, "t")
    cfg = tiny_config(num_heads=9, num_kv_heads=3, head_dim=8, hidden_size=72)
    plan = ShardingPlan.build(cfg, make_mesh(1), rules)   # one device: nothing to split
    assert not any(d.sharded for d in plan.decisions.values())

    class FourWide:                                       # the decision against 4 devices
        shape = {"data": 1, "model": 4}
    plan.mesh = FourWide()                                # type: ignore[assignment]
    with pytest.raises(ShardingRulesError, match="heads: 9 not divisible by model size 4"):
        plan._decide("heads", 9)
    assert plan._decide("ffn", 128).sharded


def test_too_few_devices_is_a_config_error():
    with pytest.raises(ConfigError, match="needs 8 devices"):
        make_mesh(8)


# ---- wire encoding ----------------------------------------------------------------------
def _so() -> SchedulerOutput:
    new = NewRequestData("a", [1, 2, 3], 3, SamplingParams(temperature=0.5, seed=7, stop=["x"],
                                                           logit_bias={5: -1.5}), [0, 1], 0)
    return SchedulerOutput([new], [CachedRequestData("b", [9], 17)], {"a": 3, "b": 1}, 4,
                           finished_req_ids={"c"}, preempted_req_ids={"d", "e"})


def test_scheduler_output_round_trips_exactly():
    so = _so()
    back = wire.decode(wire.encode(so))
    assert back == so
    assert type(back.finished_req_ids) is set
    assert back.scheduled_new_reqs[0].sampling_params.logit_bias == {5: -1.5}


def test_wire_refuses_unregistered_types_and_garbage():
    class Evil:
        pass
    with pytest.raises(TypeError, match="register it"):
        wire.encode({"x": Evil()})
    with pytest.raises(wire.WireError):
        wire.decode(b"\xc1\x00garbage")
    forged = wire._pack(wire.msgpack.ExtType(1, wire._pack(["os.system", {"cmd": "ls"}])))
    with pytest.raises(wire.WireError, match="unknown type"):
        wire.decode(forged)


# ---- control channel ------------------------------------------------------------------------
def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _pair(timeout: float):
    port = _port()
    fatal: dict[str, list[str]] = {"leader": [], "follower": []}
    box: dict = {}
    t = threading.Thread(target=lambda: box.setdefault("leader", Leader(
        2, ("127.0.0.1", port), secret=b"s", timeout=timeout, connect_timeout=10,
        on_fatal=fatal["leader"].append)))
    t.start()
    follower = Follower(1, ("127.0.0.1", port), secret=b"s", timeout=timeout, connect_timeout=10,
                        on_fatal=fatal["follower"].append)
    t.join(10)
    return box["leader"], follower, fatal


def _wait(cond, limit: float) -> float:
    t0 = time.monotonic()
    while not cond():
        assert time.monotonic() - t0 < limit, "timed out"
        time.sleep(0.05)
    return time.monotonic() - t0


def test_channel_delivers_in_order_and_stops_cleanly():
    leader, follower, fatal = _pair(timeout=2.0)
    for i in range(5):
        leader.broadcast("step", wire.encode(i))
    got = [follower.recv() for _ in range(5)]
    assert [wire.decode(p) for _, p in got] == list(range(5))
    time.sleep(1.2)                              # heartbeats flow both ways meanwhile
    leader.stop()
    assert follower.recv() == ("stop", None)
    time.sleep(0.3)
    follower.close()
    time.sleep(0.3)
    assert fatal == {"leader": [], "follower": []}


def test_a_closed_peer_is_fatal_on_the_other_side():
    leader, follower, fatal = _pair(timeout=2.0)
    follower.conn.sock.close()                   # like a killed process: the OS closes it
    _wait(lambda: fatal["leader"], 5)
    assert "lost rank 1" in fatal["leader"][0]
    leader.stop()


def test_a_silent_peer_is_fatal_after_the_timeout():
    leader, follower, fatal = _pair(timeout=1.0)
    follower.conn.closing = True                 # stops its heartbeats, socket stays open
    waited = _wait(lambda: fatal["leader"], 5)
    assert "no heartbeat" in fatal["leader"][0] and waited < 3
    leader.stop()
    follower.close()
