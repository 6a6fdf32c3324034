"""A Hugging Face LlamaForCausalLM with Llama-3-8B's dimensions (a few decoder layers, random
weights: nothing is downloaded), its GEMMs tuned with cudal2, exported and patched in. Prefill
and one decode step with a KV cache are timed eagerly and in CUDA graphs, with and without
cudal2. Needs a GPU and the `hf` extra (`pip install -e '.[cuda13,hf]'`).

    python examples/hf_llama.py [--layers 2] [--prefill 512,2048] [--batches 1,4,16] [--context 512]
        [--tune "--iterations 2 --batch 4"] [--no-tune] [--results DIR] [--library DIR] [--json FILE]

The model's own GEMMs are recorded from one run of each case (every nn.Linear call: M, N, K)
and tuned with `cudal2 optimize --shapes` (the `--model llama3-8b` preset lists the fused qkv
and gate_up projections an inference engine runs; Hugging Face's Llama runs q, k, v, gate and
up apart). `cudal2 export` then writes the dispatch library, and `cudal2.torch.patch` routes
the tuned layers to the op (cudal2::layer, linear with the layer's tensors bound first, called from C++).

Prints, per case: the logits' error against the unpatched model and the bf16 model's own error
against an fp32 copy (both relative to the largest logit); the step's device time with and
without cudal2, eager and in a CUDA graph; the measured speedup beside the predicted one (each
GEMM's share of the step in the graph times its speedup, measured alone in a graph); then the
host time of one call through F.linear and through the op, for a shape the library serves and
one it does not.
"""

from __future__ import annotations

import argparse
import collections
import copy
import inspect
import json
import shlex
import statistics
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

import cudal2.torch as ops


def llama3_8b_config(layers: int):
    """LlamaConfig with Meta-Llama-3-8B's config.json dimensions and `layers` decoder layers."""
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=layers,
                       num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=8192,
                       rms_norm_eps=1e-5, tie_word_embeddings=False)


def build(config, device: str, dtype: torch.dtype = torch.bfloat16):
    """The model with random weights, created on `device` in `dtype`, for inference."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    with torch.device(device):
        return LlamaForCausalLM(config).to(dtype).eval()


def _cache_keyword(model) -> str:
    # transformers 5.x renames past_key_values to cache (the old name warns)
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


@dataclass(frozen=True)
class Case:
    kind: str  # "prefill" (`tokens` new tokens per sequence) or "decode" (one token per sequence)
    batch: int
    tokens: int  # prefill: the prompt's length; decode: the context already in the KV cache

    def __str__(self) -> str:
        return f"prefill {self.tokens}" if self.kind == "prefill" else f"decode b={self.batch} ctx={self.tokens}"


def step(model, case: Case, vocab: int):
    """A function running the case once and returning the last position's logits, against a
    static KV cache: a prefill writes the prompt's keys and values into an empty cache of its
    length; a decode step writes one token's after `case.tokens` tokens prefilled once. Each
    call first resets the cache's length, so it writes the same positions again: the step can
    be repeated, timed and captured in a CUDA graph (with a cache, and the prompt filling it
    exactly, Hugging Face's mask needs no host synchronisation)."""
    from transformers import StaticCache

    device = next(model.parameters()).device
    keyword = _cache_keyword(model)
    generator = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, vocab, (case.batch, case.tokens), generator=generator).to(device)
    if case.kind == "prefill":
        cache = StaticCache(config=model.config, max_cache_len=case.tokens)
        start, ids, position = 0, prompt, torch.arange(case.tokens, device=device).expand(case.batch, -1)
    else:
        cache = StaticCache(config=model.config, max_cache_len=case.tokens + 1)
        with torch.no_grad():
            model(input_ids=prompt, logits_to_keep=1, **{keyword: cache})
        token = torch.randint(0, vocab, (case.batch, 1), generator=generator).to(device)
        start, ids, position = case.tokens, token, torch.full((case.batch, 1), case.tokens, device=device)

    def run():
        for layer in cache.layers:  # the length moves to the device when the cache first fills
            layer.cumulative_length.fill_(start)
        return model(input_ids=ids, position_ids=position, logits_to_keep=1, **{keyword: cache}).logits

    return run


def gemm_calls(model, run) -> collections.Counter:
    """(M, N, K) of every nn.Linear call of one run(), counted."""
    calls: collections.Counter = collections.Counter()

    def record(layer, inputs, output):
        calls[(inputs[0].numel() // layer.in_features, layer.out_features, layer.in_features)] += 1

    hooks = [m.register_forward_hook(record) for m in model.modules() if isinstance(m, torch.nn.Linear)]
    try:
        with torch.no_grad():
            run()
    finally:
        for hook in hooks:
            hook.remove()
    return calls


def predicted_speedup(step_us: float, calls: dict, library_us: dict, tuned_us: dict) -> float:
    """The step's speedup if each GEMM alone changed: each GEMM's share of the step (its calls
    times its library-call time, over the step's time) times what its kernel saves."""
    saved = sum(count * (library_us[shape] - tuned_us[shape]) for shape, count in calls.items())
    return step_us / (step_us - saved)


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.float() - ref.float()).abs().max() / ref.float().abs().max())


def device_us(fns: dict, graph: bool, rounds: int = 10, repeats: int = 4) -> dict:
    """Median device time of each of `fns` (name -> fn()): eager calls, or replays of it
    captured in a CUDA graph; NaN (with the reason printed) where one cannot be captured. The
    functions take turns, `repeats` timed calls each a round, so that the host's and the
    GPU's drift falls on all of them alike (an eager step is bound by the host)."""
    runs, times = {}, {}
    for name, fn in fns.items():
        try:
            runs[name] = _prepared(fn, graph)
        except RuntimeError as exc:
            print(f"  {name} not timed ({'graph' if graph else 'eager'}): {str(exc).strip().splitlines()[0]}", flush=True)
    for _ in range(rounds):
        for name, run in runs.items():
            for _ in range(repeats):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                run()
                end.record()
                end.synchronize()
                times.setdefault(name, []).append(start.elapsed_time(end) * 1e3)
    return {name: statistics.median(times[name]) if name in times else float("nan") for name in fns}


def _prepared(fn, graph: bool):
    """fn warmed up (off the default stream, as a capture wants), or its CUDA graph's replay."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    if not graph:
        return fn
    captured = torch.cuda.CUDAGraph()
    with torch.cuda.graph(captured):
        fn()
    return captured.replay


def gemm_us(shape: tuple, op) -> float:
    """Device time of one x @ W^T of `shape` in a CUDA graph of a few calls, each with its own
    weight (as the model's layers have), so that none is served from L2."""
    m, n, k = shape
    calls = max(2, min(10, 2**31 // (n * k * 2)))
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) for _ in range(calls)]
    return device_us({"calls": lambda: [op(x, w) for w in weights]}, graph=True)["calls"] / calls


def tune(shapes: list[tuple], args) -> bool:
    """`cudal2 optimize --shapes` on the recorded GEMMs, then `cudal2 export` of their winners;
    whether a library was exported (none where no kernel was verified)."""
    shapes_csv = args.library.with_suffix(".csv")
    shapes_csv.parent.mkdir(parents=True, exist_ok=True)
    shapes_csv.write_text("m,n,k,dtype,layout\n" + "".join(f"{m},{n},{k},bf16,nt\n" for m, n, k in shapes))
    common = ["--shapes", str(shapes_csv), *(["--results", str(args.results)] if args.results else [])]
    commands = []
    if not args.no_tune:
        commands.append(["optimize", *common, *shlex.split(args.tune)])
    commands.append(["export", "--library", str(args.library), *common, "--gpu", torch.cuda.get_device_name()])
    for command in commands:
        command = [sys.executable, "-m", "cudal2", *command]
        print("$", shlex.join(command), flush=True)
        if subprocess.run(command).returncode != 0:
            return False
    return True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=2, help="decoder layers")
    parser.add_argument("--prefill", default="512,2048", help="prompt lengths of the prefill cases (batch 1)")
    parser.add_argument("--batches", default="1,4,16", help="batch sizes of the decode cases")
    parser.add_argument("--context", type=int, default=512, help="tokens in the KV cache of a decode step")
    parser.add_argument("--tune", default="--iterations 2 --batch 4", help="options of `cudal2 optimize`")
    parser.add_argument("--no-tune", action="store_true", help="export what the leaderboard already holds")
    parser.add_argument("--results", type=Path, default=None)
    parser.add_argument("--library", type=Path, default=Path("hf-llama-library"))
    parser.add_argument("--json", type=Path, default=None, help="also write the numbers here")
    parser.add_argument("--rounds", type=int, default=30,
                        help="timed rounds of each step (4 calls a round, PyTorch's and cudal2's in turn); the median is shown")
    args = parser.parse_args()

    config = llama3_8b_config(args.layers)
    model = build(config, "cuda")
    cases = [Case("prefill", 1, int(t)) for t in args.prefill.split(",") if t] + \
            [Case("decode", int(b), args.context) for b in args.batches.split(",") if b]
    runs = {case: step(model, case, config.vocab_size) for case in cases}
    calls = {case: gemm_calls(model, runs[case]) for case in cases}
    shapes = sorted({shape for counted in calls.values() for shape in counted})
    if not tune(shapes, args):
        print("no library: every call runs the library call", flush=True)
    ops.use(args.library if (args.library / "index.json").is_file() else None)
    tuned = copy.deepcopy(model)
    print(f"{ops.patch(tuned)} of {sum(isinstance(m, torch.nn.Linear) for m in tuned.modules())} Linear layers "
          f"go through the op (cudal2::layer); library {args.library}", flush=True)
    served = {shape: ops.served(*shape, "bf16", "nt") for shape in shapes}
    for shape in shapes:
        print(f"  {shape[0]}x{shape[1]}x{shape[2]}: {served[shape].name if served[shape] else 'library call'}")
    reference = copy.deepcopy(model).float()  # the same weights, computed in fp32

    op = torch.ops.cudal2.linear
    library_us = {shape: gemm_us(shape, F.linear) for shape in shapes}
    tuned_us = {shape: gemm_us(shape, op) if served[shape] else library_us[shape] for shape in shapes}
    rows = []
    print("\n| case | logits error / max (cudal2 vs PyTorch) | PyTorch bf16 vs fp32 | PyTorch eager us | "
          "cudal2 eager us | eager speedup | PyTorch graph us | cudal2 graph us | graph speedup | "
          "predicted speedup |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    with torch.no_grad():
        for case in cases:
            ours = step(tuned, case, config.vocab_size)
            exact = step(reference, case, config.vocab_size)
            ref = runs[case]()
            error, own = relative_error(ours(), ref), relative_error(ref, exact())
            times = {(name, graph): t for graph in (False, True)
                     for name, t in device_us({"torch": runs[case], "cudal2": ours}, graph, rounds=args.rounds).items()}
            predicted = predicted_speedup(times["torch", True], calls[case], library_us, tuned_us)
            row = {"case": str(case), "error": error, "bf16_vs_fp32": own, "predicted": predicted,
                   **{f"{name}_{'graph' if graph else 'eager'}_us": t for (name, graph), t in times.items()}}
            rows.append(row)
            print(f"| {case} | {error:.2e} | {own:.2e} | {row['torch_eager_us']:.1f} | {row['cudal2_eager_us']:.1f} | "
                  f"{row['torch_eager_us'] / row['cudal2_eager_us']:.3f} | {row['torch_graph_us']:.1f} | "
                  f"{row['cudal2_graph_us']:.1f} | {row['torch_graph_us'] / row['cudal2_graph_us']:.3f} | "
                  f"{predicted:.3f} |", flush=True)
        del reference

        print("\n| GEMM (M x N x K) | served by | F.linear us (graph) | op us (graph) | speedup | "
              "host us: F.linear / op | host us: nn.Linear / patched |")
        print("|---|---|---|---|---|---|---|")
        layers = {(m.out_features, m.in_features): (m, p) for m, p in zip(model.modules(), tuned.modules())
                  if isinstance(m, torch.nn.Linear)}
        gemms = []
        for shape in shapes:
            m, n, k = shape
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            plain, patched = layers[(n, k)]
            host = list(ops.host_us({"F.linear": lambda: F.linear(x, plain.weight), "op": lambda: op(x, plain.weight),
                                     "nn.Linear": lambda: plain(x), "patched": lambda: patched(x)},
                                    cuda=True, rounds=3, repeat=200).values())
            gemms.append({"shape": shape, "served": served[shape].name if served[shape] else None,
                          "library_us": library_us[shape], "tuned_us": tuned_us[shape], "host_us": host})
            print(f"| {m}x{n}x{k} | {served[shape].stem[:12] if served[shape] else 'library call'} | "
                  f"{library_us[shape]:.1f} | {tuned_us[shape]:.1f} | {library_us[shape] / tuned_us[shape]:.3f} | "
                  f"{host[0]:.1f} / {host[1]:.1f} | "
                  f"{host[2]:.1f} / {host[3]:.1f} |", flush=True)
    if args.json:
        args.json.write_text(json.dumps({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                                         "layers": args.layers, "cases": rows, "gemms": gemms}, indent=1))


if __name__ == "__main__":
    main()
