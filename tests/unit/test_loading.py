"""Production loading (``computron.loading``), its fixtures' old names, and the one family table (no processes)."""
import pytest
import torch

from computron import ModelConfig, loading
from computron.models import families
from computron.comm.validation import is_finite_number, is_valid_seed


def test_old_fixture_names_still_import_and_share_the_loaders():
    from computron import tokenizer_zoo, zoo, zoo_understanding
    from computron.testing import tokenizer_zoo as tz, zoo as tzoo
    assert zoo.load_causal_lm is loading.load_causal_lm and zoo_understanding.load_encoder is loading.load_encoder
    assert zoo.random_causal_lm is tzoo.random_causal_lm and tokenizer_zoo.train_bpe is tz.train_bpe
    assert zoo.checkpoint_dtype is loading.checkpoint_dtype and tokenizer_zoo.has_tokenizer is loading.has_tokenizer
    assert zoo_understanding.train_tokenizer is tz.train_tokenizer  # one trainer for both zoos


def test_one_dtype_list():
    assert loading.torch_dtype("bfloat16") is torch.bfloat16
    with pytest.raises(ValueError, match=r"load_causal_lm\('x'\): dtype='fp16': must be one of"):
        loading.torch_dtype("fp16", "load_causal_lm('x')")


def test_has_tokenizer(tmp_path):
    assert not loading.has_tokenizer(str(tmp_path))
    (tmp_path / "vocab.txt").write_text("[PAD]\n")
    assert loading.has_tokenizer(str(tmp_path))


def test_checkpoint_of_named_or_through_the_loader(tmp_path):
    p = str(tmp_path)
    assert loading.checkpoint_of(ModelConfig("a", loading.load_causal_lm, {"path": p})) == (p, None)
    assert loading.checkpoint_of(ModelConfig("b", loading.load_encoder, {"path": p, "dtype": "float16"})) == \
        (p, "float16")
    # what `computron serve` builds: the directory named, the loader's dtype honoured
    named = ModelConfig("c", loading.load_causal_lm, {"path": p, "dtype": "bfloat16"}, checkpoint=p)
    assert loading.checkpoint_of(named) == (p, "bfloat16")
    assert loading.checkpoint_of(ModelConfig("d", loading.load_causal_lm, {"path": p, "other": 1})) is None
    assert loading.checkpoint_of(ModelConfig("e", dict, {"path": p})) is None
    assert loading.checkpoint_of(ModelConfig("f", dict, {"dtype": "float16"}, checkpoint=p)) == (p, None)


@pytest.mark.parametrize("name", ["opt-tiny", "llama-tiny"])
def test_causal_lm_plans_come_from_the_family_table(name):
    from computron.testing import zoo
    model = zoo.random_causal_lm(name)
    fam = families.decoder_family(model)
    assert fam.runner == families.CAUSAL_LM and families.encoder_family(model) is None
    layer = model.base_model.get_submodule(fam.layers)[0]
    for path in fam.tp_plan():
        assert isinstance(layer.get_submodule(path), torch.nn.Linear), (name, path)
    for path in fam.divide:
        mod, _, attr = path.rpartition(".")
        assert isinstance(getattr(layer.get_submodule(mod), attr), int), (name, path)


def test_tp_divisibility_one_check():
    with pytest.raises(ValueError, match=r"model 'm': config.ffn_dim=6 is not divisible by tp_world_size=4"):
        families.check_tp_divisible(type("C", (), {"num_attention_heads": 4, "ffn_dim": 6})(),
                                    ("num_attention_heads", "ffn_dim"), 4, "m")
    with pytest.raises(ValueError, match=r"model 'm': shape 'x' has hidden_size=6, not divisible"):
        families.check_tp_divisible({"hidden_size": 6}, families.tp_fields_of_any_family(), 4, "m", "shape 'x'")
    families.check_tp_divisible({"hidden_size": 8}, ("hidden_size", "ffn_dim"), 4, "m")


def test_validators():
    assert is_valid_seed(0) and not is_valid_seed(True) and not is_valid_seed(2 ** 63)
    assert is_finite_number(0.5) and not is_finite_number(float("nan")) and not is_finite_number(False)
