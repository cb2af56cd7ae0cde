"""The CPU block matmul (``kernels/cpu/gemm.py``): built once per machine into the cache, equal to ``F.linear`` to
float rounding for every row count its tiles take (1-8 rows, several tiles, one block or an odd one left,
output features not a multiple of 16, with and without a bias), used only where it was timed faster than
``F.linear`` on this machine (the verdict kept beside the build), and never an error where it cannot build."""
import os

import pytest
import torch
import torch.nn.functional as F

from computron.kernels.cpu import gemm as cpu_gemm
from computron.kernels.cpu import build as cpu_kernels

needs_kernel = pytest.mark.skipif(not cpu_gemm.built(), reason="the kernel does not build here (see its log)")


@needs_kernel
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 8, 9, 17, 64])
@pytest.mark.parametrize("out_f,in_f", [(16, 7), (48, 64), (50, 33), (96, 576), (1, 3)])
@pytest.mark.parametrize("bias", [True, False])
def test_block_matmul_equals_f_linear(rows, out_f, in_f, bias):
    gen = torch.Generator().manual_seed(rows * 1000 + out_f + in_f)
    x, w = torch.randn(rows, in_f, generator=gen), torch.randn(out_f, in_f, generator=gen)
    b = torch.randn(out_f, generator=gen) if bias else None
    blocked = cpu_gemm.block(w)
    assert blocked.shape == (-(-out_f // 16), in_f, 16)
    out = cpu_gemm.matmul(x, blocked, b, out_f)
    assert out.shape == (rows, out_f) and out.is_contiguous()
    torch.testing.assert_close(out, F.linear(x, w, b), rtol=1e-5, atol=1e-4)


@needs_kernel
def test_leading_dims_strided_input_and_zero_rows():
    w, b = torch.randn(32, 24), torch.randn(32)
    blocked = cpu_gemm.block(w)
    x = torch.randn(3, 4, 48)[..., ::2]  # [3, 4, 24], not contiguous
    torch.testing.assert_close(cpu_gemm.matmul(x, blocked, b, 32), F.linear(x, w, b), rtol=1e-5, atol=1e-5)
    assert cpu_gemm.matmul(torch.randn(0, 24), blocked, b, 32).shape == (0, 32)


@needs_kernel
def test_the_build_is_cached_in_the_kernel_dir():
    """The library lies in the kernel cache (wherever this process's environment puts it, which another test
    of the same pytest worker may have changed since the module's first build), and a second build finds it."""
    path = cpu_kernels.build("block_matmul", cpu_gemm._SOURCE)
    assert os.path.dirname(path) == cpu_kernels.kernel_dir() and os.path.basename(path).startswith("block_matmul_")
    made = os.stat(path).st_mtime_ns
    assert cpu_kernels.build("block_matmul", cpu_gemm._SOURCE) == path  # found, not rebuilt
    assert os.stat(path).st_mtime_ns == made


def test_no_compiler_means_unavailable_and_one_warning(monkeypatch, tmp_path, caplog):
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    monkeypatch.setenv(cpu_kernels.CACHE_ENV, str(tmp_path))  # nothing cached there
    cpu_gemm._kernel.cache_clear()
    try:
        with caplog.at_level("WARNING", logger=cpu_gemm.__name__):
            assert not cpu_gemm.available() and not cpu_gemm.available()
        warned = [r for r in caplog.records if "block matmul kernel is not used" in r.getMessage()]
        assert len(warned) == 1
    finally:
        cpu_gemm._kernel.cache_clear()


@needs_kernel
def test_a_kernel_slower_than_torch_is_not_used_and_the_verdict_is_kept(monkeypatch, tmp_path, caplog):
    monkeypatch.setenv(cpu_kernels.CACHE_ENV, str(tmp_path))
    timings = [(2e-3, 1e-3)]  # ours, F.linear's: the kernel loses

    def timed(fn):
        assert fn is cpu_gemm._kernel()
        return timings.pop()
    monkeypatch.setattr(cpu_gemm, "time_against_torch", timed)
    cpu_gemm._kernel.cache_clear()
    cpu_gemm._wins.cache_clear()
    try:
        with caplog.at_level("WARNING", logger=cpu_gemm.__name__):
            assert cpu_gemm.built() and not cpu_gemm.available() and not cpu_gemm.available()
        assert [r.getMessage() for r in caplog.records if "loses: 2.00 ms against F.linear's 1.00 ms" in
                r.getMessage()] and len(caplog.records) == 1
        cpu_gemm._wins.cache_clear()  # a new process: the verdict is read back, nothing timed again
        assert not cpu_gemm.available() and timings == []
        kept = [f for f in os.listdir(cpu_kernels.kernel_dir()) if f.endswith(".so.timed")]
        assert len(kept) == 1 and open(os.path.join(cpu_kernels.kernel_dir(), kept[0])).read().startswith("loses")
    finally:
        cpu_gemm._kernel.cache_clear()
        cpu_gemm._wins.cache_clear()


@needs_kernel
def test_the_timing_compares_both_on_one_thread():
    threads = torch.get_num_threads()
    ours, theirs = cpu_gemm.time_against_torch(cpu_gemm._kernel(), shape=(64, 32), rows=(1, 3), repeats=1)
    assert ours > 0 and theirs > 0 and torch.get_num_threads() == threads


@needs_kernel
def test_a_cache_that_cannot_keep_the_verdict_still_decides(monkeypatch, tmp_path):
    monkeypatch.setenv(cpu_kernels.CACHE_ENV, str(tmp_path))
    monkeypatch.setattr(cpu_gemm, "time_against_torch", lambda fn: (1e-3, 2e-3))  # the kernel wins

    def refuse(path, text):
        raise PermissionError(f"{path}: read-only")
    monkeypatch.setattr(cpu_kernels, "write_beside", refuse)
    cpu_gemm._kernel.cache_clear()
    cpu_gemm._wins.cache_clear()
    try:
        assert cpu_gemm.available()
        assert not [f for f in os.listdir(cpu_kernels.kernel_dir()) if f.endswith(".timed")]
    finally:
        cpu_gemm._kernel.cache_clear()
        cpu_gemm._wins.cache_clear()


@needs_kernel  # a C compiler is there
@pytest.mark.parametrize("undefine", [[], ["-U__linux__"]], ids=["linux", "not_linux"])
def test_the_shipped_source_compiles_with_and_without_helpers(tmp_path, undefine):
    """The ``.c`` file read as package data compiles on Linux (with the helper threads) and with the branch
    other platforms take (no helpers: the same exported functions, each defined once)."""
    import shutil
    import subprocess
    src = tmp_path / "gemm.c"
    src.write_text(cpu_gemm._SOURCE)
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    proc = subprocess.run([cc, "-fsyntax-only", "-Werror=implicit-function-declaration", *undefine, str(src)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
