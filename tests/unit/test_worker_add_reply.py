"""A model added while serving always answers the master (``worker/changes.py``): when making its
``ModelAdded`` reply fails, the rank replies ``CommandFailed`` and does not keep the model, instead of leaving
the master waiting for an answer that never comes."""
import threading
from types import SimpleNamespace

import pytest

from computron.comm import messages as msg
from computron.worker.changes import ModelChanges

pytestmark = pytest.mark.unit


class _Rank(ModelChanges):
    def __init__(self, runner, store):
        self.rank, self.runners, self.stores, self.model_configs = 0, {}, {}, {}
        self._registry_lock = threading.Lock()
        self._builder = SimpleNamespace(build=lambda mid, mc, reserve, while_serving: SimpleNamespace(
            runner=runner, store=store))
        self._builds = SimpleNamespace(submit=lambda job: job())  # the build thread, run inline
        self.replies = []
        self.channel = SimpleNamespace(reply=self.replies.append)

    def _reserve_host(self, mid, nbytes=0):
        pass

    def _settle_host(self, mid):
        pass

    def _log_built(self, mid, built, how):
        pass

    def host_resident(self):
        return 0

    def _failure(self, seq, model_id, exc, fatal=False):
        return msg.CommandFailed(seq=seq, rank=self.rank, model_id=model_id, error=f"{type(exc).__name__}: {exc}",
                                 fatal=fatal, exc_type=type(exc).__name__, upstream=False)


class _Store:
    nbytes = 64
    slots = ()


class _BrokenStore(_Store):
    @property
    def slots(self):
        raise RuntimeError("no slots to report")


def _add(rank):
    rank._on_add_model(msg.AddModel(seq=7, config=SimpleNamespace(model_id="m")))
    return rank.replies


def test_a_model_added_is_reported_and_kept():
    rank = _Rank(SimpleNamespace(), _Store())
    (reply,) = _add(rank)
    assert isinstance(reply, msg.ModelAdded) and reply.seq == 7 and reply.model_id == "m"
    assert "m" in rank.runners and "m" in rank.stores


def test_a_reply_that_cannot_be_made_is_a_failure_and_the_model_is_not_kept():
    rank = _Rank(SimpleNamespace(), _BrokenStore())
    (reply,) = _add(rank)
    assert isinstance(reply, msg.CommandFailed) and reply.seq == 7 and "no slots to report" in reply.error
    assert "m" not in rank.runners and "m" not in rank.stores and "m" not in rank.model_configs
