"""Native CPU kernels (mm_parallel.ops.native): built here with g++, equal to the written-out
operator-by-operator path they replace, and a clear fallback when they cannot be built."""

import logging

import mindspore as ms
import numpy as np
import pytest
from mindspore import Tensor

from mm_parallel import ops as K
from mm_parallel.ops import activations, native, norms


@pytest.fixture
def native_switch():
    """A test that turns native kernels off and on leaves them on."""
    yield
    native.set_enabled(True)


def _values_and_grads(cell, x, cotangent):
    out = cell(x).asnumpy()
    grad = ms.grad(lambda t: (cell(t) * cotangent).sum())(x).asnumpy()
    return out, grad


def test_gelu_tanh_native_kernel_builds_and_equals_the_written_out_path():
    forward = native.operator("gelu_tanh", "GeluTanh")
    assert forward is not None, native.unavailable_reason("gelu_tanh")  # g++ is part of this machine
    rng = np.random.default_rng(0)
    values = rng.standard_normal((300, 257)).astype(np.float32) * 4  # odd sizes, saturated tails
    cotangent = Tensor(rng.standard_normal((300, 257)).astype(np.float32))
    native_cell = activations._gelu_tanh_on_cpu()
    assert isinstance(native_cell, activations._NativeGeluTanh)
    for x in (Tensor(values), Tensor(values.T.copy()).T):  # contiguous, and a transposed view
        got = _values_and_grads(native_cell, x, cotangent)
        want = _values_and_grads(activations._gelu_tanh, x, cotangent)
        np.testing.assert_allclose(got[0], want[0], rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(got[1], want[1], rtol=1e-5, atol=1e-5)
    small = Tensor(values[:3, :5])  # below the threads' threshold: one thread
    np.testing.assert_allclose(K.gelu(small, "tanh").asnumpy(), activations._gelu_tanh(small).asnumpy(), atol=1e-6)


@pytest.mark.parametrize("norm", ["layer_norm", "rms_norm"])
def test_norms_native_kernels_equal_the_written_out_path(norm, native_switch):
    """Values and the gradients of input, weight and bias; rows of 300 features (not a multiple of
    the vector width), an offset and a large spread, a 3-D input and a transposed view."""
    rng = np.random.default_rng(1)
    values = (rng.standard_normal((2, 150, 300)) * 5 + 2).astype(np.float32)
    cotangent = Tensor(rng.standard_normal(values.shape).astype(np.float32))
    weight, bias = (Tensor(rng.standard_normal(300).astype(np.float32)) for _ in range(2))

    def forward(x, w, b):
        return K.layer_norm(x, w, b, 1e-5) if norm == "layer_norm" else K.rms_norm(x, w, 1e-6) + b

    def run(setting, x):
        native.set_enabled(setting == "1")
        grads = ms.grad(lambda *t: (forward(*t) * cotangent).sum(), grad_position=(0, 1, 2))(x, weight, bias)
        return [forward(x, weight, bias).asnumpy()] + [g.asnumpy() for g in grads]

    transposed = Tensor(values.transpose(0, 2, 1).copy()).transpose(0, 2, 1)
    for x in (Tensor(values), transposed):
        for got, want in zip(run("1", x), run("0", x)):
            np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)
    native.set_enabled(True)
    assert isinstance(norms._standardize(1e-5, True), norms._NativeRowNormalise)  # the native path ran
    assert isinstance(norms._rms_scale(1e-6), norms._NativeRowNormalise)


def test_swiglu_native_kernel_equals_silu_times_up(native_switch):
    rng = np.random.default_rng(2)
    gate, up = (Tensor((rng.standard_normal((257, 130)) * 6).astype(np.float32)) for _ in range(2))
    cotangent = Tensor(rng.standard_normal((257, 130)).astype(np.float32))

    def run(setting):
        native.set_enabled(setting == "1")
        grads = ms.grad(lambda g, u: (K.swiglu(g, u) * cotangent).sum(), grad_position=(0, 1))(gate, up)
        return [K.swiglu(gate, up).asnumpy()] + [g.asnumpy() for g in grads]

    for got, want in zip(run("1"), run("0")):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    assert isinstance(native._CELLS["swiglu"], activations._NativeSwiglu)  # the native path ran
    want = run("0")[0]
    native.set_enabled(True)
    joined = Tensor(np.concatenate([gate.asnumpy(), up.asnumpy()], -1))  # Megatron's [gate | up] form
    np.testing.assert_allclose(K.swiglu(joined).asnumpy(), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("masked", [False, True])
def test_attention_native_kernels_equal_the_written_out_path(masked, native_switch):
    """softmax and the scores' gradient of the attention core (grouped-query heads; with a causal
    and key-padding mask, the masked core with a query that sees no key)."""
    rng = np.random.default_rng(3)
    q = Tensor(rng.standard_normal((2, 7, 4, 16)).astype(np.float32) * 3)
    k, v = (Tensor(rng.standard_normal((2, 9, 2, 16)).astype(np.float32)) for _ in range(2))
    cotangent = Tensor(rng.standard_normal((2, 7, 4, 16)).astype(np.float32))
    mask = dict(causal=True, key_padding_mask=np.array([[1] * 9, [0] * 4 + [1] * 5])) if masked else {}

    def run(setting):
        native.set_enabled(setting)
        grads = ms.grad(lambda *t: (K.attention(*t, **mask) * cotangent).sum(), grad_position=(0, 1, 2))(q, k, v)
        return [K.attention(q, k, v, **mask).asnumpy()] + [g.asnumpy() for g in grads]

    for got, want in zip(run(True), run(False)):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    native.set_enabled(True)
    assert native.operator("attention", "Softmax") is not None and native.operator("attention", "ScoresGradient")
    swap = native._CELLS["swap_seq_heads"]  # the (seq, heads) swap ran natively
    assert swap is not None
    np.testing.assert_array_equal(swap(q).asnumpy(), q.asnumpy().transpose(0, 2, 1, 3))
    np.testing.assert_array_equal(ms.grad(lambda t: (swap(t) * swap(cotangent)).sum())(q).asnumpy(),
                                  cotangent.asnumpy())


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("tables", ["shared", "per_batch", "partial"])
def test_rotary_native_kernels_equal_the_written_out_path(interleaved, tables, native_switch):
    """Tables shared by the batch (seq, dim) or one per sample (batch, seq, dim), and a partial
    rotary (the first 6 of 10 dims); values and the gradient of x."""
    rng = np.random.default_rng(4)
    x = Tensor(rng.standard_normal((2, 5, 3, 10)).astype(np.float32))
    rot = 6 if tables == "partial" else 10
    angles = rng.standard_normal((2, 5, rot) if tables == "per_batch" else (5, rot)).astype(np.float32)
    cos, sin = Tensor(np.cos(angles)), Tensor(np.sin(angles))
    cotangent = Tensor(rng.standard_normal((2, 5, 3, 10)).astype(np.float32))

    def run(setting):
        native.set_enabled(setting)
        grad = ms.grad(lambda t: (K.apply_rotary(t, cos, sin, interleaved) * cotangent).sum())(x)
        return K.apply_rotary(x, cos, sin, interleaved).asnumpy(), grad.asnumpy()

    for got, want in zip(run(True), run(False)):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    from mm_parallel.ops import rotary

    assert isinstance(rotary._native_rotary(interleaved), rotary._NativeRotary)  # the native path ran


@pytest.fixture
def fresh_native(monkeypatch, tmp_path):
    """native's caches emptied before and after, its build cache in tmp_path."""
    monkeypatch.setenv("MM_CACHE_DIR", str(tmp_path))
    native.forget()
    yield
    native.forget()
    native.set_enabled(True)


def test_without_a_compiler_gelu_falls_back_and_says_why(fresh_native, monkeypatch, caplog):
    monkeypatch.setenv("CXX", "no-such-compiler-mm")
    with caplog.at_level(logging.WARNING, logger="mm_parallel.ops.native"):
        cell = activations._gelu_tanh_on_cpu()
    assert isinstance(cell, activations._GeluTanh)
    reason = native.unavailable_reason("gelu_tanh")
    assert "no-such-compiler-mm" in reason and "install g++" in reason
    assert any("gelu_tanh unavailable" in record.getMessage() for record in caplog.records)
    assert not list((native.Path(native.os.environ["MM_CACHE_DIR"]) / "kernels").glob("*.so"))


def test_a_failed_build_falls_back_with_the_compilers_message(fresh_native, monkeypatch, tmp_path):
    broken = tmp_path / "broken.cc"
    broken.write_text("this is not C++\n")
    monkeypatch.setattr(native, "_SOURCES", tmp_path)
    assert native.library("broken") is None
    assert "building or loading csrc/broken.cc failed" in native.unavailable_reason("broken")


def test_set_enabled_false_turns_them_off(fresh_native):
    native.set_enabled(False)
    assert native.operator("gelu_tanh", "GeluTanh") is None
    assert "turned off" in native.unavailable_reason("gelu_tanh")
    assert isinstance(activations._gelu_tanh_on_cpu(), activations._GeluTanh)
    native.set_enabled(True)
    assert native.operator("gelu_tanh", "GeluTanh") is not None


def test_not_on_a_device_other_than_cpu(fresh_native, monkeypatch):
    """On Ascend the reference path (MM_KERNELS=reference) keeps MindSpore's operators: the native
    kernels read host memory."""
    real = native.ms.get_context
    monkeypatch.setattr(native.ms, "get_context", lambda key: "Ascend" if key == "device_target" else real(key))
    assert not native.enabled() and native.operator("gelu_tanh", "GeluTanh") is None
    assert native.cell("swiglu", activations._native_swiglu) is None


def test_a_second_build_reuses_the_cached_library(fresh_native):
    first = native.library("gelu_tanh")
    native.library.cache_clear()
    stamp = native.Path(first).stat().st_mtime_ns
    assert native.library("gelu_tanh") == first and native.Path(first).stat().st_mtime_ns == stamp


def _kernels(tmp_path):
    return tmp_path / "kernels"


def _replace(path, content: bytes):
    """A new file at ``path`` (this process may have the old one mapped: writing it in place would
    pull the pages from under it)."""
    staged = path.with_name(path.name + ".new")
    staged.write_bytes(content)
    native.os.replace(staged, path)


def test_a_library_cut_short_is_built_again(fresh_native, tmp_path, caplog):
    """A cached library is checked against the size and sha256 its build recorded before it is
    loaded (a truncated one used to be trusted because it existed, and failed at its first call)."""
    first = native.Path(native.library("layout"))
    whole = first.read_bytes()
    _replace(first, whole[: len(whole) // 2])
    native.forget()
    with caplog.at_level(logging.WARNING, logger="mm_parallel.ops.native_build"):
        again = native.library("layout")
    assert again == str(first) and first.read_bytes() == whole
    assert any("bytes, its build wrote" in record.getMessage() and "building it again" in record.getMessage()
               for record in caplog.records)


def test_a_library_that_does_not_load_falls_back_with_the_reason(fresh_native, tmp_path, caplog):
    """A file that passes the record (here: the record rewritten for garbage) but is no library:
    refused when loading is tried, before any operator is made of it, and the caller falls back."""
    import hashlib
    import json

    from mm_parallel.ops import native_build

    path = native_build.library_path(native._SOURCES / "gelu_tanh.cc", "g++", _kernels(tmp_path))
    path.parent.mkdir()
    garbage = b"not an ELF file" * 100
    path.write_bytes(garbage)
    record = native.Path(str(path) + ".json")
    record.write_text(json.dumps({"size": len(garbage), "sha256": hashlib.sha256(garbage).hexdigest()}))
    with caplog.at_level(logging.WARNING, logger="mm_parallel.ops.native"):
        assert native.operator("gelu_tanh", "GeluTanh") is None
        assert isinstance(activations._gelu_tanh_on_cpu(), activations._GeluTanh)
    assert "building or loading csrc/gelu_tanh.cc failed" in native.unavailable_reason("gelu_tanh")
    assert any("gelu_tanh unavailable" in record.getMessage() for record in caplog.records)


def test_a_cache_others_can_write_is_refused(fresh_native, tmp_path):
    _kernels(tmp_path).mkdir()
    _kernels(tmp_path).chmod(0o777)
    assert native.library("layout") is None
    reason = native.unavailable_reason("layout")
    assert "not safe to load from" in reason and "writable by other users (mode 0o777)" in reason, reason
    assert f"chmod go-w {_kernels(tmp_path)}" in reason and "MM_CACHE_DIR" in reason
    assert not list(_kernels(tmp_path).glob("*.so"))
    _kernels(tmp_path).chmod(0o755)
    native.forget()
    assert native.library("layout") is not None


def test_processes_on_a_cold_cache_build_once(tmp_path):
    """Three processes asking for the same kernel at once on an empty cache: one compiles under
    the host lock, the others wait and load its library (counted by a compiler wrapper)."""
    import subprocess
    import sys

    calls = tmp_path / "calls"
    wrapper = tmp_path / "cxx"
    wrapper.write_text(f"#!/bin/sh\necho \"$@\" >> {calls}\nexec g++ \"$@\"\n")
    wrapper.chmod(0o755)
    env = dict(native.os.environ, MM_CACHE_DIR=str(tmp_path / "cache"), CXX=str(wrapper), GLOG_v="3")
    code = "from mm_parallel.ops import native; print(native.library('layout'))"
    procs = [subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, text=True)
             for _ in range(3)]
    paths = {p.communicate(timeout=300)[0].strip() for p in procs}
    assert len(paths) == 1 and paths.pop().endswith(".so")
    compiles = [line for line in calls.read_text().splitlines() if " -c " in f" {line} "]
    assert len(compiles) == 1, calls.read_text()


def _agree_with_one_rank_unable_to_build(cache: str):
    """Rank 1 with a compiler that fails and a cache of its own (as on another host); rank 0 with
    this machine's cache, where every kernel builds."""
    import os

    import mm_parallel

    rank = int(os.environ["RANK_ID"])
    saved = {key: os.environ.get(key) for key in ("MM_CACHE_DIR", "CXX")}
    if rank == 1:
        os.environ.update(MM_CACHE_DIR=cache, CXX="false")
    native.forget()
    try:
        mm_parallel.initialize()
        return {"operator": native.operator("gelu_tanh", "GeluTanh") is not None,
                "reason": native.unavailable_reason("gelu_tanh"), "library": native.library("gelu_tanh")}
    finally:
        for key, value in saved.items():
            os.environ.pop(key, None) if value is None else os.environ.update({key: value})
        native.forget()


@pytest.mark.distributed
def test_every_rank_takes_the_same_path_when_one_cannot_build(run_distributed, tmp_path):
    """A kernel one rank cannot build is used by none: the native and operator-by-operator paths
    agree to rounding only, so ranks on different paths would drift apart."""
    rank0, rank1 = run_distributed(_agree_with_one_rank_unable_to_build, nproc=2, timeout=300, cache=str(tmp_path))
    assert rank0["library"] is not None and not rank0["operator"], rank0
    assert rank0["reason"].startswith("another rank of this run cannot use it"), rank0
    assert rank1["library"] is None and not rank1["operator"], rank1
    assert "building or loading csrc/gelu_tanh.cc failed" in rank1["reason"], rank1
