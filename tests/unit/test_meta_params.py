"""``storage.checkpoint.params_on_meta``: the parameters its own thread creates go to the meta device,
flagged loaded; a module another thread builds meanwhile, or one built after it, keeps real parameters."""
import threading

from torch import nn

from computron.storage.checkpoint import params_on_meta


def test_params_on_meta_acts_on_its_own_thread_only():
    inside, built = threading.Event(), {}

    def build_elsewhere():
        assert inside.wait(30)
        built["other"] = nn.Linear(3, 2)

    other = threading.Thread(target=build_elsewhere)
    other.start()
    with params_on_meta():
        inside.set()
        other.join(30)
        with params_on_meta():  # nested: still on meta inside, and after the inner one
            nested = nn.Linear(3, 2)
        meta = nn.Linear(3, 2)
    after = nn.Linear(3, 2)
    assert meta.weight.is_meta and meta.bias.is_meta and nested.weight.is_meta
    assert meta.weight._is_hf_initialized
    assert not built["other"].weight.is_meta and not after.weight.is_meta
    assert isinstance(meta.weight, nn.Parameter) and meta.weight.shape == (2, 3)
