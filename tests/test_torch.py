"""The PyTorch ops on the CPU: registered through torch.library, fake tensors, torch.compile,
the fallback, and patching a model (the GPU path: tests/test_gpu.py)."""

import json

import pytest

torch = pytest.importorskip("torch")

import cudal2.torch as ops  # noqa: E402

VERSIONS = {"gpu": "NVIDIA H200", "driver": "580.159.04", "cuda": "13.0"}


def library(tmp_path, entries):
    (tmp_path / "index.json").write_text(json.dumps({"versions": VERSIONS, "entries": entries}))
    return tmp_path


def test_the_ops_are_registered_and_fall_back_off_the_gpu():
    assert hasattr(torch.ops.cudal2, "mm") and hasattr(torch.ops.cudal2, "linear")
    a, b, w = torch.randn(8, 16), torch.randn(16, 4), torch.randn(4, 16)
    assert torch.equal(torch.ops.cudal2.mm(a, b), torch.matmul(a, b))
    assert torch.equal(torch.ops.cudal2.linear(a, w), torch.nn.functional.linear(a, w))
    torch.library.opcheck(torch.ops.cudal2.mm.default, (a, b))  # schema, fake and eager agree
    torch.library.opcheck(torch.ops.cudal2.linear.default, (a, w))


def test_fake_tensors_and_torch_compile_see_the_right_shapes():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        out = torch.ops.cudal2.linear(torch.empty(5, 32, dtype=torch.bfloat16), torch.empty(7, 32, dtype=torch.bfloat16))
        assert out.shape == (5, 7) and out.dtype == torch.bfloat16
    compiled = torch.compile(lambda x, w: torch.ops.cudal2.linear(x, w).relu(), fullgraph=True, backend="eager")
    x, w = torch.randn(3, 8), torch.randn(6, 8)
    assert torch.allclose(compiled(x, w), torch.nn.functional.linear(x, w).relu())


def test_patch_swaps_only_the_layers_whose_shapes_were_tuned(tmp_path):
    entry = {"m": 16, "n": 6, "k": 8, "dtype": "bf16", "layout": "nt", "library": "kernels/x.so", "kernel": "k",
             "speedup": 1.05, "verified_m": [16]}
    model = torch.nn.Sequential(torch.nn.Linear(8, 6), torch.nn.ReLU(), torch.nn.Linear(6, 3)).to(torch.bfloat16)
    x = torch.randn(2, 4, 8, dtype=torch.bfloat16)
    before = model(x)
    with pytest.warns(UserWarning, match="built for gpu 'NVIDIA H200', this machine has 'NVIDIA A100'"):
        assert ops.use(library(tmp_path, [entry]), environment={**VERSIONS, "gpu": "NVIDIA A100"}) is not None
    assert ops.patch(model) == 0  # a library for another GPU serves nothing
    ops.use(library(tmp_path, [entry]), environment=VERSIONS)
    assert ops.patch(model) == 1  # the 6x8 layer; the 3x6 one was never tuned
    # off the GPU the op falls back to F.linear (the bias added after it: bf16 rounds once more)
    assert torch.allclose(model(x), before, rtol=2e-2, atol=2e-2)
    ops.use(None)


def test_gradients_through_the_ops_are_the_library_calls_gradients():
    import torch.nn.functional as F

    x, w = torch.randn(4, 8, requires_grad=True), torch.randn(6, 8, requires_grad=True)
    a, b = torch.randn(4, 8, requires_grad=True), torch.randn(8, 3, requires_grad=True)
    for ours, theirs, inputs in ((torch.ops.cudal2.linear, F.linear, (x, w)), (torch.ops.cudal2.mm, torch.matmul, (a, b))):
        expected = torch.autograd.grad(theirs(*inputs).pow(2).sum(), inputs)
        got = torch.autograd.grad(ours(*inputs).pow(2).sum(), inputs)
        assert all(torch.allclose(g, e) for g, e in zip(got, expected))


def test_the_ops_autograd_holds_under_aot_tracing_and_a_dispatch_mode_sees_the_op():
    """The op's own autograd kernel (lighter than register_autograd's: 3.4 against 5.9 us a
    call here): opcheck's autograd and AOT checks pass, torch.compile through AOTAutograd gets
    the library call's gradients, and a dispatch mode (a profiler, a FLOP counter) still sees
    the op rather than the call it runs."""
    import torch.nn.functional as F
    from torch.utils._python_dispatch import TorchDispatchMode

    x, w = torch.randn(4, 8, requires_grad=True), torch.randn(6, 8, requires_grad=True)
    torch.library.opcheck(torch.ops.cudal2.linear.default, (x, w))
    torch.library.opcheck(torch.ops.cudal2.mm.default, (x, w.t().detach().requires_grad_()))
    compiled = torch.compile(lambda a, b: torch.ops.cudal2.linear(a, b).pow(2).sum(), fullgraph=True,
                             backend="aot_eager")
    expected = torch.autograd.grad(F.linear(x, w).pow(2).sum(), (x, w))
    assert all(torch.allclose(g, e) for g, e in zip(torch.autograd.grad(compiled(x, w), (x, w)), expected))

    class Seen(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(str(func))
            return func(*args, **(kwargs or {}))

    with torch.no_grad(), Seen() as seen:
        torch.ops.cudal2.linear(x, w)
    assert seen.ops[0] == "cudal2.linear.default", seen.ops


def test_a_patched_layer_answers_alike_in_inference_training_and_compiled(tmp_path):
    """Eager inference takes the op's function without the dispatcher (host cost: a layer of
    a decode step runs in microseconds); with gradients, or traced, the op itself."""
    entry = {"m": 4, "n": 6, "k": 8, "dtype": "fp16", "layout": "nt", "library": "kernels/x.so", "kernel": "k",
             "speedup": 1.05, "verified_m": [4]}
    ops.use(library(tmp_path, [entry]), environment=VERSIONS)
    try:
        layer, plain = torch.nn.Linear(8, 6, bias=False).half(), torch.nn.Linear(8, 6, bias=False).half()
        plain.load_state_dict(layer.state_dict())
        assert ops.patch(layer) == 1
        x = torch.randn(4, 8, dtype=torch.float16)
        with torch.no_grad():
            assert torch.equal(layer(x), plain(x)) and torch.equal(layer(x[None])[0], plain(x))
        layer(x.float().half().requires_grad_()).float().sum().backward()
        plain(x).float().sum().backward()
        assert torch.allclose(layer.weight.grad.float(), plain.weight.grad.float())
        compiled = torch.compile(layer, fullgraph=True, backend="eager")
        with torch.no_grad():
            assert torch.equal(compiled(x), plain(x))
    finally:
        ops.use(None)
