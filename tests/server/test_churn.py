"""benchmarks/churn.py --quick: 16 clients (whole and streamed completions, n 1 and 2, streams closed after
their first chunk) against a live `computron serve` while models are added, replaced and removed and LoRA
adapters loaded and unloaded through the repository APIs at random, seeded. Every answer must be what an id
served at some moment of its request, every refusal a 404 for an id unserved at some moment of it (or a 429 /
503), nothing may hang, nothing stays running, everything unloads and no process is left. The checker itself
is checked on answers a broken server would give."""
import os
import sys
from types import SimpleNamespace

import pytest
from helpers import run_main

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SEED = 3


@pytest.mark.timeout(900)
def test_churn_through_serve_fails_no_request(tmp_path):
    doc, _ = run_main(os.path.join(ROOT, "benchmarks", "churn.py"), "--quick", "--seed", str(SEED),
                      "--dir", str(tmp_path), "--count-split-choices")
    assert doc["pass"], f"seed {doc['seed']} failed ({doc['replay']}): {doc['failures']}"
    assert doc["failures"] == [] and doc["leftover_processes"] == [] and doc["server_exit"] == 0, doc
    assert len(doc["prompts"]) == 2, doc  # prompts every checkpoint and adapter answers differently
    done = doc["requests"]
    for kind in ("ok_plain", "ok_plain_n2", "ok_stream", "ok_stream_n2", "cancelled"):
        assert done.get(kind, 0) > 0, (kind, done)
    assert sum(doc["changes"].values()) > 0 and doc["swaps"] > 0, doc


@pytest.fixture
def churn():
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    try:
        import churn
        yield churn
    finally:
        sys.path.remove(os.path.join(ROOT, "benchmarks"))


class Reply:
    def __init__(self, status, body):
        self.status_code, self._body = status, body
        self.text = str(body)

    def json(self):
        return self._body


def answer(text):
    """An answer whose tokens are its characters."""
    return text, tuple(text)


def test_the_checker_catches_a_wrong_model_a_late_404_and_a_5xx(churn):
    zero, one, adapted = answer("zero"), answer("one"), answer("adapted")
    run = churn.Run(args=SimpleNamespace(count_split_choices=False), server=None, paths={}, adapter_paths={},
                    refs={(("c0", None), 0): zero, (("c1", None), 0): one, (("c0", "a0"), 0): adapted})
    run.history.begin("m0", ("c0", None), 0.0)
    run.history.begin("a0", ("c0", "a0"), 0.0)
    run.history.begin("m1", None, 0.0)
    ok = Reply(200, {})
    churn.check(run, "m0", 0, "plain", ok, 1.0, 2.0, [zero], True)
    churn.check(run, "a0", 0, "stream_n2", ok, 1.0, 2.0, [adapted, adapted], True)
    churn.check(run, "m0", 0, "cancel", ok, 1.0, 2.0, [answer("ze")], False)
    churn.check(run, "m1", 0, "plain", Reply(404, {"error": {"message": "unknown model 'm1'"}}), 1.0, 2.0)
    for args, needle in (
            (("m0", 0, "plain", ok, 1.0, 2.0, [one], True), "the answers of what m0 served"),  # another model's
            (("a0", 0, "plain", ok, 1.0, 2.0, [zero], True), "the answers of what a0 served"),  # adapter dropped
            (("m0", 0, "plain_n2", ok, 1.0, 2.0, [zero, one], True), "the answers of what m0 served"),
            (("m0", 0, "plain", ok, 1.0, 2.0, [("zero", ("z", "e", "r", "0"))], True), "the answers of"),  # tokens
            (("m0", 0, "stream", ok, 1.0, 2.0, [zero], False), "without [DONE]"),
            (("m0", 0, "stream", ok, 1.0, 2.0, [answer("ze")], False, '{"message": "boom"}'), "error event"),
            (("m0", 0, "cancel", ok, 1.0, 2.0, [answer("on")], False), "starts no answer"),
            (("m1", 0, "plain", ok, 1.0, 2.0, [one], True), "served nothing"),
            (("m0", 0, "plain", Reply(404, {"error": {"message": "unknown"}}), 1.0, 2.0), "served all along"),
            (("m0", 0, "plain", Reply(500, {"error": {"message": "internal"}}), 1.0, 2.0), "500: internal"),
            (("m0", 0, "plain", Reply(502, "bad gateway"), 1.0, 2.0), "without an error message")):
        with pytest.raises(churn.Failure) as e:
            churn.check(run, *args)
        assert needle in str(e.value), (args, str(e.value))
    # a replace: during it both versions may answer, after it only the new one
    run.history.begin("m0", ("c1", None), 3.0)
    run.history.end("m0", True, 4.0)
    churn.check(run, "m0", 0, "plain", ok, 3.5, 3.6, [zero], True)
    churn.check(run, "m0", 0, "plain", ok, 3.5, 3.6, [one], True)
    with pytest.raises(churn.Failure):
        churn.check(run, "m0", 0, "plain", ok, 4.5, 4.6, [zero], True)
    # with --count-split-choices, an n=2 answer whose choices came from the two versions is counted, not failed
    run.args = SimpleNamespace(count_split_choices=True)
    churn.check(run, "m0", 0, "plain_n2", ok, 3.5, 3.6, [zero, one], True)
    assert run.requests["split_choices"] == 1
    with pytest.raises(churn.Failure):
        churn.check(run, "m0", 0, "plain_n2", ok, 4.5, 4.6, [zero, one], True)
