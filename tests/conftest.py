"""Where GPU and nvcc availability is decided, once: markers `gpu` and `nvcc` skip cleanly
on machines without them and run for real where they exist."""

from __future__ import annotations

import functools
import json
import os
import shutil
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import jinja2
import pytest

from cudal2.kernels.compile import Compiler, cache_key

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = Path(__file__).resolve().parent / "kernels"


@functools.cache
def gpu_count() -> int:
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount()
    except Exception:
        return 0


@functools.cache
def gpu_cc() -> int:
    import cupy

    props = cupy.cuda.runtime.getDeviceProperties(0)
    return props["major"] * 10 + props["minor"]


def pytest_collection_modifyitems(config, items):
    no_gpu = pytest.mark.skip(reason="no CUDA GPU on this machine (run `pytest -m gpu` on one)")
    no_nvcc = pytest.mark.skip(reason="nvcc not found")
    for item in items:
        if "gpu" in item.keywords and gpu_count() == 0:
            item.add_marker(no_gpu)
        if ("nvcc" in item.keywords or "gpu" in item.keywords) and shutil.which("nvcc") is None:
            item.add_marker(no_nvcc)


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory) -> Path:
    """One kernel cache for the whole session, so each source compiles once;
    $CUDAL2_CACHE_DIR shares it with other runs (a GPU session's measurements)."""
    shared = os.environ.get("CUDAL2_CACHE_DIR")
    return Path(shared) if shared else tmp_path_factory.mktemp("cache")


@pytest.fixture(scope="session")
def arch() -> str:
    from cudal2.measure.environment import default_arch

    return default_arch(gpu_cc()) if gpu_count() else "sm_90a"


@pytest.fixture(scope="session")
def compiler(cache_dir, arch) -> Compiler:
    return Compiler(arch, cache_dir)


def cache_holding(path: Path, compiler: Compiler, sources: list[str]) -> Compiler:
    """A compiler with a cache of its own at `path` that holds the builds of `sources` alone
    (built once a session by `compiler`, copied): whatever else it is asked for compiles."""
    own = Compiler(compiler.arch, path)
    for source in sources:
        assert compiler.compile(source).status == "ok"
        key = cache_key(source, compiler.arch, ())
        shutil.copytree(compiler.entry(key), own.entry(key))
    return own


def benchmark_script(name: str):
    """benchmarks/<name>.py loaded as a module (the folder is scripts, not a package)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def fixture_source(variant: str) -> str:
    """tests/kernels/simt.cu.j2 rendered as `variant` (honest, or one way to cheat)."""
    env = jinja2.Environment(loader=jinja2.FileSystemLoader(FIXTURES), undefined=jinja2.StrictUndefined,
                             trim_blocks=True, lstrip_blocks=True)
    return env.get_template("simt.cu.j2").render(variant=variant)


# ------------------------------------------------ an OpenAI-compatible endpoint on loopback

@dataclass
class Step:
    content: str = ""
    status: int = 200
    delay: float = 0.0
    headers: dict = field(default_factory=dict)
    finish_reason: str = "stop"  # "length": cut off at max_tokens
    usage: dict = field(default_factory=lambda: {"prompt_tokens": 1200, "completion_tokens": 300, "total_tokens": 1500})


class Endpoint:
    """Serves the scripted steps in order (500 when the script runs out); keeps every request."""

    def __init__(self):
        self.script: list[Step] = []
        self.requests: list[dict] = []
        self.url = ""

    def reply(self, content: str = "", **step) -> Endpoint:
        self.script.append(Step(content, **step))
        return self

    def prompt(self, i: int = -1) -> str:
        return "\n".join(m["content"] for m in self.requests[i]["body"]["messages"])


class _Server(ThreadingHTTPServer):
    def handle_error(self, request, client_address):
        pass  # a client that gave up (the timeout test) is expected


@pytest.fixture
def endpoint():
    state = Endpoint()

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            state.requests.append({"path": self.path, "headers": {k.lower(): v for k, v in self.headers.items()}, "body": body})
            step = state.script.pop(0) if state.script else Step(status=500)
            time.sleep(step.delay)
            if self.path != "/v1/chat/completions":
                step = Step(status=404)
            if step.status == 200:
                payload = {
                    "id": f"chatcmpl-{len(state.requests)}", "object": "chat.completion", "created": int(time.time()),
                    "model": body["model"],
                    "choices": [{"index": 0, "message": {"role": "assistant", "content": step.content},
                                 "finish_reason": step.finish_reason}],
                    "usage": step.usage,
                }
            else:
                payload = {"error": {"message": f"scripted failure {step.status}", "type": "server_error"}}
            data = json.dumps(payload).encode()
            self.send_response(step.status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            for name, value in step.headers.items():
                self.send_header(name, value)
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args):
            pass

    server = _Server(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    state.url = f"http://127.0.0.1:{server.server_address[1]}/v1"
    yield state
    server.shutdown()
    server.server_close()



def fenced(tag: str, body: str) -> str:
    return f"```{tag}\n{body}\n```"


def verifier_failures(kernel, shapes, dtype: str, layout: str, seed: int) -> list[str]:
    """The verifier's verdict on `kernel` at each of `shapes` (M, N, K), against cuBLAS: one
    line per shape it does not accept."""
    import random

    import cupy

    from cudal2.measure.baselines import cublas_gemm
    from cudal2.measure.verify import verify
    from cudal2.problem import Problem

    rng = random.Random(seed)
    stream = cupy.cuda.Stream(non_blocking=True)
    failures = []
    with stream:
        for m, n, k in shapes:
            problem = Problem(m, n, k, dtype, layout)
            verdict = verify(kernel, problem, stream, cublas_gemm(problem, stream), rng)
            if verdict.status != "ok":
                failures.append(f"{problem}: {verdict.status} {verdict.reason}")
    return failures


def split_k_reset_failures(kernel, seed: int, deterministic: bool = True) -> list[str]:
    """What goes wrong with a split-K kernel whose clusters meet through arrival counters in
    its static memory (bf16 nt): calls queued without a sync, each on new inputs; two calls on
    the same inputs (with `deterministic`, they must agree to the bit: a fixed-order sum); a
    CUDA graph replayed over inputs changed in place; and calls alternating between shapes of
    different tile counts. A counter left non-zero makes a cluster sum too early, or none at
    all; a sum in static memory left non-zero adds the last call's C to the next."""
    import random

    import cupy

    from cudal2.measure.verify import Numerics, Operands, compare
    from cudal2.problem import Problem

    rng, num = random.Random(seed), Numerics("bf16")
    stream = cupy.cuda.Stream(non_blocking=True)
    failures: list[str] = []

    def check(ops: Operands, what: str) -> None:
        _, _, why = compare(ops.c, ops.reference(), num)
        if why or ops.stray_writes():
            failures.append(f"{what}: {why or 'wrote outside C'}")

    with stream:
        shapes = [Problem(64, 64, 16384, "bf16", "nt"), Problem(256, 192, 8192, "bf16", "nt")]
        sets = {p: [Operands(p, kernel.workspace_bytes(p.m, p.n, p.k), num) for _ in range(3)] for p in shapes}
        one = shapes[0]
        for ops in sets[one]:
            ops.fill("normal", rng)
            ops.poison(rng)
        stream.synchronize()
        codes = [ops.call(kernel, stream) for ops in sets[one] for _ in range(2)]
        stream.synchronize()
        if codes != [0] * 6:
            failures.append(f"back-to-back calls returned {codes}")
        for i, ops in enumerate(sets[one]):
            check(ops, f"back-to-back call {i}")

        first = sets[one][0]
        before = first.c.copy()
        first.poison(rng)
        first.call(kernel, stream)
        stream.synchronize()
        if deterministic and not bool(cupy.array_equal(first.c.view(cupy.uint16), before.view(cupy.uint16))):
            failures.append("two calls on the same inputs differ: the sum's order depends on arrival")
        check(first, "the same inputs again")

        stream.begin_capture()
        first.call(kernel, stream)
        graph = stream.end_capture()
        for replay in range(3):
            first.fill(("normal", "uniform", "positive")[replay], rng)
            first.poison(rng)
            graph.launch(stream)
            stream.synchronize()
            check(first, f"graph replay {replay}")

        for round_ in range(3):
            for p in shapes:
                ops = sets[p][round_]
                ops.fill("normal", rng)
                ops.poison(rng)
                if ops.call(kernel, stream) != 0:
                    failures.append(f"{p}: declined")
            stream.synchronize()
            for p in shapes:
                check(sets[p][round_], f"{p}, round {round_} of alternating shapes")
    return failures
