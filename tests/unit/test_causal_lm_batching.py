"""The causal-LM batch manager on the master: left padding, which requests batch together, bad requests,
sampling choices, stop ids (no process)."""
import pytest
import torch

from computron import OPTBatchManager, zoo


def test_batch_manager_left_pads_and_truncates():
    bm = OPTBatchManager(max_batch_size=3, pad_token_id=1, eos_token_id=2)
    from collections import deque

    from computron import SubmitEntry, TaskEntry
    q = deque([SubmitEntry(0, {"input_ids": [5, 6, 7], "max_tokens": 2}),
               SubmitEntry(1, {"input_ids": [8], "max_tokens": 4, "temperature": 0.5}),
               SubmitEntry(2, {"input_ids": [9, 10], "max_tokens": 4}),
               SubmitEntry(3, {"input_ids": [11], "max_tokens": 1})])
    task, info = bm.make_batch(q)
    # same sampling parameters batch together, the differently sampled request waits
    assert task.uids == (0, 2, 3)
    assert [e.uid for e in q] == [1]
    assert task.batch["input_ids"].tolist() == [[5, 6, 7], [1, 9, 10], [1, 1, 11]]
    assert task.batch["attention_mask"].tolist() == [[1, 1, 1], [0, 1, 1], [0, 0, 1]]
    assert task.batch["max_new_tokens"] == 4
    out = torch.tensor([[30, 31, 32, 33], [40, 2, 1, 1], [50, 51, 52, 53]])
    got = dict(bm.split_batch(TaskEntry(task.uids, out), **info))
    assert got[0].tolist() == [30, 31]          # cut to its own max_tokens
    assert got[2].tolist() == [40, 2]           # cut after EOS
    assert got[3].tolist() == [50]


@pytest.mark.parametrize("data,needle", [
    ("hello", "dict"),
    ({}, "input_ids"),
    ({"input_ids": []}, "empty"),
    ({"input_ids": [1, 2.5]}, "list of ints"),
    ({"input_ids": [1, 99999]}, "[0, 512)"),
    ({"input_ids": [1], "max_tokens": 0}, "max_tokens"),
    ({"input_ids": [1], "top_p": 1.5}, "top_p"),
    ({"input_ids": [1], "temperature": -1}, "temperature"),
    ({"input_ids": [1], "attention_mask": [1, 1]}, "attention_mask"),
    ({"input_ids": [1], "bogus": 3}, "bogus"),
    ({"input_ids": torch.zeros(2, 3, dtype=torch.long)}, "1-D"),
])
def test_batch_manager_rejects_malformed_requests(data, needle):
    bm = OPTBatchManager.for_config(zoo.hf_config("opt-tiny"))
    with pytest.raises((ValueError, TypeError)) as err:
        bm.validate(data)
    assert needle in str(err.value)


def test_sampling_choices():
    from computron.models.causal_lm import CausalLMRunner
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0], [5.0, 0.0, 0.0, 4.9]])
    pick = CausalLMRunner._pick
    assert pick(logits, {}, None).tolist() == [1, 0]  # no sampling parameters: greedy
    assert pick(logits, {"temperature": 0.0}, None).tolist() == [1, 0]
    gen = torch.Generator().manual_seed(0)
    assert pick(logits, {"temperature": 1.0, "top_k": 1}, gen).tolist() == [1, 0]
    assert pick(logits, {"temperature": 1.0, "top_p": 0.01}, gen).tolist() == [1, 0]  # nucleus of one token
    draws = [tuple(pick(logits, {"temperature": 5.0, "top_k": 2}, torch.Generator().manual_seed(s)).tolist())
             for s in range(40)]
    assert {d[0] for d in draws} == {1, 3} and {d[1] for d in draws} == {0, 3}  # only the top two, both seen
    again = [tuple(pick(logits, {"temperature": 5.0, "top_k": 2}, torch.Generator().manual_seed(s)).tolist())
             for s in range(40)]
    assert draws == again  # a seed reproduces its draws


def test_several_eos_ids_cut_answers():
    from computron import TaskEntry
    bm = OPTBatchManager(eos_token_id=[2, 7])
    got = dict(bm.split_batch(TaskEntry((0, 1), torch.tensor([[5, 7, 2, 1], [5, 6, 2, 1]])), max_tokens=[4, 4]))
    assert got[0].tolist() == [5, 7] and got[1].tolist() == [5, 6, 2]
