"""The quantized weight formats (``computron/quant``): GGUF blocks dequantized as the gguf package does, int8/int4
round trips, packed products equal to expanded ones, splits that would cut a block refused with the numbers,
and the ``quantization`` setting checked where a user gives it (ModelConfig, the YAML, the CLI)."""
import pytest
import torch

from computron import ModelConfig, zoo
from computron.quant.formats import GGUF_FORMATS, INT8, int4_format, parse_quantization, quantize
from computron.quant.linear import QuantLinear

np = pytest.importorskip("numpy")
gguf = pytest.importorskip("gguf")


def _random_blocks(name: str, n_blocks: int, rng) -> np.ndarray:
    """Random block bytes of GGUF type ``name`` with finite float16 steps (random bytes there could be NaN)."""
    qtype = gguf.GGMLQuantizationType[name]
    block, nbytes = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, (n_blocks, nbytes), dtype=np.uint8)
    steps = {"Q6_K": (208,), "Q4_1": (0, 2), "Q4_K": (0, 2), "Q5_K": (0, 2)}.get(name, (0,))
    for at in steps:
        raw[:, at:at + 2] = np.frombuffer(rng.uniform(-0.05, 0.05, n_blocks).astype(np.float16).tobytes(),
                                          np.uint8).reshape(n_blocks, 2)
    return raw


@pytest.mark.parametrize("name", list(GGUF_FORMATS))
def test_gguf_blocks_dequantize_as_the_gguf_package_does(name):
    rng = np.random.default_rng(len(name))
    fmt = GGUF_FORMATS[name]
    rows = 3
    raw = _random_blocks(name, rows * 2, rng).reshape(rows, 2 * fmt.block_bytes)
    ref = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[name])
    got = fmt.dequantize(torch.from_numpy(raw), 2 * fmt.block).numpy()
    assert got.shape == ref.shape and np.array_equal(got, ref)


def test_int4_g32_is_gguf_q4_1():
    w = torch.randn(4, 64)
    ours = quantize(w, int4_format(32))
    assert torch.equal(int4_format(32).dequantize(ours, 64), GGUF_FORMATS["Q4_1"].dequantize(ours, 64))
    assert torch.equal(torch.from_numpy(gguf.quants.dequantize(ours.numpy(), gguf.GGMLQuantizationType.Q4_1)),
                       int4_format(32).dequantize(ours, 64))


@pytest.mark.parametrize("fmt,bound", [(INT8, 1 / 254), (int4_format(32), 1 / 30), (int4_format(128), 1 / 30)],
                         ids=["int8", "int4-g32", "int4-g128"])
def test_round_trip_error_is_half_a_step(fmt, bound):
    w = torch.randn(8, 256)
    back = fmt.dequantize(quantize(w, fmt), 256)
    span = (w.abs().amax(dim=1, keepdim=True) * 2) if fmt is INT8 else (w.amax() - w.amin())
    assert ((back - w).abs() <= span * bound * 1.01 + 1e-3).all()
    assert not torch.equal(back, w)


def _quant_linear(data, fmt, n_in, mode, bias):
    lin = torch.nn.Linear(n_in, data.shape[0])
    lin.__class__ = QuantLinear
    del lin._parameters["weight"]
    lin.register_buffer("qdata", data)
    lin.bias = torch.nn.Parameter(bias)
    lin.fmt, lin.n_in, lin.mode = fmt, n_in, mode
    return lin


@pytest.mark.parametrize("fmt", [INT8, int4_format(32), int4_format(128), GGUF_FORMATS["Q4_0"],
                                 GGUF_FORMATS["Q4_K"], GGUF_FORMATS["Q6_K"]], ids=lambda f: f.name)
def test_packed_products_equal_expanded_ones(fmt):
    rng = np.random.default_rng(7)
    n_in, n_out = 256, 48
    if fmt.name.startswith("gguf:"):
        raw = _random_blocks(fmt.name[5:], n_out * n_in // fmt.block, rng).reshape(n_out, -1)
        data = torch.from_numpy(raw)
    else:
        data = quantize(torch.randn(n_out, n_in), fmt)
    bias = torch.randn(n_out)
    x = torch.randn(2, 3, n_in)
    ref = torch.nn.functional.linear(x, fmt.dequantize(data, n_in), bias)
    expand = _quant_linear(data, fmt, n_in, "expand", bias)
    packed = _quant_linear(data, fmt, n_in, "packed", bias)
    scale = float(ref.abs().max())  # float32 sums in another order: differences at its rounding of the largest
    torch.testing.assert_close(expand(x), ref, rtol=1e-5, atol=1e-6 * scale)
    torch.testing.assert_close(packed(x), ref, rtol=1e-4, atol=1e-5 * scale)
    expand.computron_leave()
    assert expand.computron_device_bytes() == 0


def test_split_that_cuts_a_block_is_refused_with_the_numbers():
    fmt = int4_format(128)
    fmt.check_split(512, 2, "w")
    with pytest.raises(ValueError, match=r"w: 384 input features are 3 int4-g128 blocks of 128, which 2 "
                                         r"tensor-parallel ranks cannot share evenly"):
        fmt.check_split(384, 2, "w")
    with pytest.raises(ValueError, match=r"w: 100 input features are not a whole number of gguf:Q4_K blocks of 256"):
        GGUF_FORMATS["Q4_K"].check_split(100, 1, "w")
    INT8.check_split(100, 3, "w")  # a per-channel scale goes with every part of its row


def test_quantization_names():
    assert parse_quantization("int4").name == "int4-g32" and parse_quantization("int4-g128").name == "int4-g128"
    assert parse_quantization("int8") is INT8 and parse_quantization(None) is None
    for bad in ("int3", "int4-g48", "INT8", 8):
        with pytest.raises(ValueError, match=r"ModelConfig.quantization="):
            ModelConfig("m", zoo.load_causal_lm, {"path": "x"}, quantization=bad)


def test_yaml_and_cli_take_quantization(tmp_path):
    from computron.server.config import ConfigError, parse_model
    ckpt = zoo.save_random_causal_lm("llama-tiny", str(tmp_path / "ck"), seed=0)
    (tmp_path / "ck" / "tokenizer_config.json").write_text("{}")
    assert parse_model({"id": "a", "path": ckpt, "quantization": "int4-g128"}, "models[0]").quantization == "int4-g128"
    with pytest.raises(ConfigError, match=r"^models\[0\]\.quantization='int2': must be 'int8'"):
        parse_model({"id": "a", "path": ckpt, "quantization": "int2"}, "models[0]")
