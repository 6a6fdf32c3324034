"""The llm proposer through the real openai client, against a real HTTP server on 127.0.0.1
that speaks the chat-completions protocol and replies from a script."""

from __future__ import annotations

import json
import os
import random
import re
import time

import pytest

from cudal2.kernels.candidate import Candidate, Invalid
from cudal2.config import load_settings
from cudal2.errors import Cudal2Error
from cudal2.search.llm import LLMProposer, LLMSettings, load_llm_settings
from cudal2.problem import Problem
from cudal2.kernels.render import load_templates, max_smem, template_candidate

from conftest import fenced

KEY = "sk-cudal2-FAKE-4f9e1c2b7a63d0"
PROBLEM = Problem(4096, 4096, 4096)
DEVICE = {
    "gpu": "NVIDIA H200", "cc": 90, "sm_count": 132, "max_sm_clock_mhz": 1980, "l2_bytes": 52428800,
    "smem_optin_bytes": 232448, "memory_clock_khz": 3201000, "memory_bus_bits": 6144,
}
GOOD = {"block_m": 128, "block_n": 256, "warps_m": 2, "warps_n": 4, "stages": 3}
SOURCE = """#include <cuda_fp16.h>
extern "C" int cudal2_gemm(const void* A, const void* B, void* C, int M, int N, int K,
                           void* workspace, size_t workspace_bytes, cudaStream_t stream) { return 1; }
"""
HISTORY = [
    {"kernel": "cuBLAS", "status": "ok", "offline_us": 140.0, "baseline_offline_us": 140.0},
    {"kernel": "sm80_mma(...)", "template": "sm80_mma", "params": json.dumps({"block_m": 64, "stages": 2}),
     "status": "ok", "speedup_offline": 0.4521, "offline_us": 309.7, "baseline_offline_us": 140.0,
     "tflops": 443.8, "registers": 96, "smem_bytes": 49152, "spill_bytes": 0, "error": None},
    {"kernel": "sm80_mma(...)", "template": "sm80_mma", "params": json.dumps({"block_m": 128, "stages": 4}),
     "status": "ok", "speedup_offline": 0.9107, "offline_us": 153.7, "baseline_offline_us": 140.0,
     "tflops": 894.2, "registers": 232, "smem_bytes": 131072, "spill_bytes": float("nan"), "error": None},
    {"kernel": "llm-r1-1", "template": None, "params": None, "status": "compile_error",
     "error": 'nvcc -O3 ...\n/tmp/cudal2-build-x1/kernel.cu(12): error: identifier "foo" is undefined\n1 error detected'},
    {"kernel": "sm80_mma(...)", "template": "sm80_mma", "params": None, "status": "invalid",
     "error": "stages=9 is outside template sm80_mma's space (2, 3, 4, 5)"},
]


@pytest.fixture(autouse=True)
def environment(monkeypatch, tmp_path):
    for name in [v for v in os.environ if v.startswith(("CUDAL2_", "OPENAI_"))]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("OPENAI_API_KEY", KEY)
    monkeypatch.chdir(tmp_path)


def make_proposer(endpoint, tmp_path, cc=90, **settings) -> LLMProposer:
    settings = LLMSettings(base_url=endpoint.url, **{"max_retries": 0, **settings})
    return LLMProposer(settings, run_dir=tmp_path / "run", cc=cc, device=DEVICE)



def test_json_block_becomes_the_template_candidate(endpoint, tmp_path):
    endpoint.reply("The fast ones use big tiles.\n\n" + fenced("json", json.dumps({"template": "sm80_mma", "params": GOOD})))
    proposer = make_proposer(endpoint, tmp_path, model="tuner-1", temperature=0.2, max_tokens=777)
    assert proposer.propose(PROBLEM, [], 4) == [template_candidate("sm80_mma", GOOD, 90)]
    request = endpoint.requests[0]
    assert request["path"] == "/v1/chat/completions"
    assert request["headers"]["authorization"] == f"Bearer {KEY}"
    body = request["body"]
    assert (body["model"], body["temperature"], body["max_tokens"]) == ("tuner-1", 0.2, 777)
    assert [m["role"] for m in body["messages"]] == ["system", "user"]
    assert proposer.usage[0]["prompt_tokens"] == 1200 and proposer.usage[0]["cost"] is None


def test_json_list_and_free_form_source(endpoint, tmp_path):
    other = {"block_m": 64, "block_n": 128, "warps_m": 2, "stages": 5}
    listed = json.dumps([{"template": "sm80_mma", "params": GOOD}, {"template": "sm80_mma", "params": other}])
    endpoint.reply(f"Why: ...\n{fenced('json', listed)}\nand a source:\n{fenced('cuda', SOURCE)}")
    endpoint.reply(f"{fenced('json', listed)}\n{fenced('c++', SOURCE)}")
    proposer = make_proposer(endpoint, tmp_path)
    first = proposer.propose(PROBLEM, [], 3)
    assert first == [template_candidate("sm80_mma", GOOD, 90), template_candidate("sm80_mma", other, 90),
                     Candidate.from_source(SOURCE + "\n")]
    assert first[2].label == "llm-r1-3"
    assert proposer.propose(PROBLEM, [], 2) == first[:2]  # at most n candidates


BAD_JSON = '{"template": "sm80_mma", "params": {"stages": 3,}}'


@pytest.mark.parametrize("reply, cc, reason, text", [
    (fenced("json", BAD_JSON), 90, "bad JSON: Expecting property name", BAD_JSON),
    (fenced("json", '{"template": "sm70_wmma", "params": {}}'), 90, "unknown template 'sm70_wmma'", "sm70_wmma"),
    (fenced("json", '{"template": "sm80_mma", "params": {"stages": 9}}'), 90,
     "stages=9 is outside template sm80_mma's space", '"stages": 9'),
    (fenced("json", '{"template": "sm80_mma", "params": {"block_m": 32, "warps_m": 4}}'), 90,
     "fails block_m % (warps_m * 16) == 0", '"block_m": 32'),
    (fenced("json", '{"template": "sm80_mma", "params": {"stagez": 3}}'), 90, "unknown parameter stagez", "stagez"),
    (fenced("json", '{"template": "sm80_mma", "parameters": {"stages": 3}}'), 90, "unexpected keys", "parameters"),
    (fenced("json", '{"template": "sm80_mma", "params": {"stages": 3.0}}'), 90,
     "parameter stages takes an integer or a string", "3.0"),
    (fenced("json", '{"template": "sm90_cutlass", "params": {}}'), 80,
     "template sm90_cutlass does not support fp16 nn on compute capability 80", "sm90_cutlass"),
    (fenced("cuda", "__global__ void gemm() {}"), 90, "does not define cudal2_gemm", "__global__ void gemm"),
    ("Use bigger tiles and more stages.", 90, "no candidate blocks in the reply", "bigger tiles"),
    ("Here it is:\n```cuda\nextern \"C\" int cudal2_gemm(", 90, "ended inside a code block", "cudal2_gemm("),
])
def test_malformed_replies_become_invalid(endpoint, tmp_path, reply, cc, reason, text):
    endpoint.reply(reply)
    [invalid] = make_proposer(endpoint, tmp_path, cc=cc).propose(PROBLEM, [], 4)
    assert isinstance(invalid, Invalid)
    assert reason in invalid.reason and text in invalid.text


def test_good_and_bad_blocks_of_one_reply(endpoint, tmp_path):
    endpoint.reply(f"{fenced('json', BAD_JSON)}\n{fenced('text', 'notes')}\n{fenced('cpp', SOURCE)}")
    candidate, invalid = make_proposer(endpoint, tmp_path).propose(PROBLEM, [], 4)
    assert candidate.source == SOURCE + "\n" and invalid.reason.startswith("bad JSON")


def test_slow_endpoint_times_out_with_the_endpoint_named(endpoint, tmp_path):
    endpoint.reply(fenced("json", json.dumps({"template": "sm80_mma", "params": GOOD})), delay=1.0)
    proposer = make_proposer(endpoint, tmp_path, timeout=0.5, max_retries=0)
    start = time.perf_counter()
    with pytest.raises(Cudal2Error, match=rf"llm endpoint {endpoint.url}/? timed out after 0.5 s"):
        proposer.propose(PROBLEM, [], 1)
    assert time.perf_counter() - start < 0.95


def test_rate_limit_is_retried(endpoint, tmp_path):
    endpoint.reply(status=429, headers={"retry-after-ms": "10"})
    endpoint.reply(fenced("json", json.dumps({"template": "sm80_mma", "params": GOOD})))
    proposer = make_proposer(endpoint, tmp_path, max_retries=2)
    assert proposer.propose(PROBLEM, [], 1) == [template_candidate("sm80_mma", GOOD, 90)]
    assert len(endpoint.requests) == 2


def test_persistent_server_error_is_one_line(endpoint, tmp_path):
    endpoint.reply(status=500, headers={"retry-after-ms": "10"}).reply(status=500, headers={"retry-after-ms": "10"})
    proposer = make_proposer(endpoint, tmp_path, max_retries=1)
    with pytest.raises(Cudal2Error, match=rf"llm endpoint {endpoint.url}/? answered HTTP 500") as caught:
        proposer.propose(PROBLEM, [], 1)
    assert len(endpoint.requests) == 2 and "\n" not in str(caught.value) and KEY not in str(caught.value)


def test_prompt_is_contrastive(endpoint, tmp_path):
    endpoint.reply("nothing useful")
    make_proposer(endpoint, tmp_path).propose(PROBLEM, HISTORY, 2)
    prompt = endpoint.prompt()
    assert "M = 4096, N = 4096, K = 4096" in prompt and "fp16" in prompt and "A[M,K] @ B[K,N]" in prompt
    assert "NVIDIA H200" in prompt and "streaming multiprocessors: 132" in prompt
    assert "140.00 us" in prompt  # the fastest baseline
    fast, slow = prompt.index("0.911x"), prompt.index("0.452x")
    # each candidate as today's template completes its recorded parameters, to be named back
    today = json.dumps(load_templates()["sm80_mma"].space.complete({"block_m": 128, "stages": 4}), sort_keys=True)
    assert fast < slow and f"sm80_mma {today}" in prompt
    assert "| 232 | 131072 | - |" in prompt  # registers, shared memory, unknown spills
    assert 'kernel.cu(12): error: identifier "foo" is undefined' in prompt and "/tmp/cudal2-build" not in prompt
    assert "1 error detected" not in prompt
    assert "stages=9 is outside template sm80_mma's space" in prompt
    for template in load_templates().values():  # those that can run 4096^3 (gemv takes a few rows only)
        assert (f"## {template.name}" in prompt) == template.supports(Problem(4096, 4096, 4096), 90)
        if template.supports(Problem(4096, 4096, 4096), 90):
            assert all(f"`{name}`" in prompt for name in template.space.params)
    assert "`stages`: 2, 3, 4, 5 [4]" in prompt and '`stages`: "auto", 2, 3, 4, 5, 6, 7, 8 ["auto"]' in prompt
    assert "smem_bytes <= max_smem" in prompt and "max_smem = 232448" in prompt
    assert 'extern "C" int cudal2_gemm(const void* A, const void* B, void* C, int M, int N, int K,' in prompt
    assert 'extern "C" size_t cudal2_workspace_bytes(int M, int N, int K);' in prompt
    assert prompt.index("explain why the fast candidates are fast") < prompt.index("exactly 2 new candidates")


def test_prompt_shows_the_best_eight_and_the_four_near_misses_with_their_noise(endpoint, tmp_path):
    rows = [{"kernel": "k", "template": None, "params": None, "status": "ok", "speedup_offline": i / 100,
             "offline_us": 14000.0 / i, "offline_p20_us": 13900.0 / i, "offline_p80_us": 14100.0 / i,
             "kernel_us": 13000.0 / i, "graph_us": 14000.0 / i} for i in range(1, 16)]
    for i, row in enumerate(rows, 1):
        row["kernel"] = f"kernel-{i}"
    rows.append({**rows[-1], "speedup_offline": 0.135})  # the best, measured again: slower
    endpoint.reply("nothing")
    make_proposer(endpoint, tmp_path).propose(PROBLEM, rows, 1)
    prompt = endpoint.prompt()
    shown = [i for i in range(1, 16) if f"free-form source kernel-{i} |" in prompt]
    assert shown == list(range(4, 16))  # the 8 fastest, then the 4 next: near misses, not pathologies
    assert prompt.index("kernel-8 |") < prompt.index("# Near misses") < prompt.index("kernel-7 |")
    # a kernel measured again shows its latest measurement, ranked by it, as the leaderboard does
    assert "0.150x" not in prompt and "0.135x" in prompt
    assert prompt.index("kernel-14 |") < prompt.index("kernel-15 |") < prompt.index("kernel-13 |")
    # the claimed median with its spread, and both methods' times
    assert "| 0.140x | 1000.00 | 992.86-1007.14 | 928.57 / 1000.00 |" in prompt


def test_a_new_problem_starts_from_the_nearest_problems_measured_on_this_gpu(endpoint, tmp_path):
    near = {"m": 4096, "n": 4096, "k": 2048, "dtype": "fp16", "layout": "nn", "status": "ok", "kernel": "k",
            "template": "sm80_mma", "params": json.dumps({"block_m": 128}), "speedup_offline": 1.02, "offline_us": 70.0}
    far = {**near, "m": 64, "n": 64, "k": 64, "params": json.dumps({"block_m": 32}), "speedup_offline": 1.5}
    proposer = make_proposer(endpoint, tmp_path)
    proposer.prior = [far, near]
    endpoint.reply("nothing")
    proposer.propose(PROBLEM, [], 1)
    prompt = endpoint.prompt()
    assert "# Fastest on the nearest problems" in prompt
    assert prompt.index("| 4096x4096x2048 fp16 nn |") < prompt.index("| 64x64x64 fp16 nn |")
    # and derived facts a tuner reasons from
    assert "128x128 output tiles: 1024 (7.76 waves on 132 SMs)" in prompt
    assert "DRAM time floor (operands once at peak bandwidth)" in prompt and "ridge point" in prompt


def test_prompt_offers_only_templates_for_the_gpu(endpoint, tmp_path):
    endpoint.reply("nothing")
    make_proposer(endpoint, tmp_path, cc=80).propose(PROBLEM, [], 1)
    assert "## sm80_mma" in endpoint.prompt() and "## sm90_cutlass" not in endpoint.prompt()
    assert "library calls have not been measured" in endpoint.prompt() and "Nothing has been measured yet" in endpoint.prompt()


def test_rounds_are_kept_and_the_key_never_written(endpoint, tmp_path):
    endpoint.reply("```json\n[]\n```", usage={"prompt_tokens": 10, "completion_tokens": 5, "total_tokens": 15,
                                             "cost": 0.0012})
    endpoint.reply("no blocks")
    endpoint.reply(status=401)
    proposer = make_proposer(endpoint, tmp_path)
    proposer.propose(PROBLEM, HISTORY, 1)
    proposer.propose(PROBLEM, HISTORY, 1)
    with pytest.raises(Cudal2Error, match="answered HTTP 401"):
        proposer.propose(PROBLEM, HISTORY, 1)
    run = tmp_path / "run"
    assert {p.name for p in run.iterdir()} == {
        "llm-round-1-prompt.md", "llm-round-1-reply.md", "llm-round-2-prompt.md", "llm-round-2-reply.md",
        "llm-round-3-prompt.md", "llm-usage.jsonl",
    }
    assert "cudal2_gemm" in (run / "llm-round-1-prompt.md").read_text()
    assert (run / "llm-round-2-reply.md").read_text() == "no blocks"
    lines = [json.loads(line) for line in (run / "llm-usage.jsonl").read_text().splitlines()]
    assert [(u["round"], u["total_tokens"], u["cost"]) for u in lines] == [(1, 15, 0.0012), (2, 1500, None)]
    assert all(u["model"] == "gpt-4o-mini" and u["seconds"] >= 0 for u in lines)
    assert [u["cost"] for u in proposer.usage] == [0.0012, None]
    assert all(r["headers"]["authorization"] == f"Bearer {KEY}" for r in endpoint.requests)  # the key was used
    for path in run.iterdir():
        assert KEY not in path.read_text()


def test_max_rounds_is_honoured(endpoint, tmp_path):
    endpoint.reply("none").reply("none").reply("none")
    proposer = make_proposer(endpoint, tmp_path, max_rounds=2)
    assert [len(proposer.propose(PROBLEM, [], 1)) for _ in range(3)] == [1, 1, 0]
    assert len(endpoint.requests) == 2


def test_key_is_required_except_for_a_local_endpoint(endpoint, tmp_path, monkeypatch):
    monkeypatch.delenv("OPENAI_API_KEY")
    with pytest.raises(Cudal2Error, match=r"set OPENAI_API_KEY \(or --api-key-env\) for the llm proposer"):
        LLMProposer(LLMSettings(base_url="https://llm.example.com/v1"), run_dir=tmp_path, cc=90, device=DEVICE)
    with pytest.raises(Cudal2Error, match="set MY_LLM_KEY"):
        LLMProposer(LLMSettings(api_key_env="MY_LLM_KEY"), run_dir=tmp_path, cc=90, device=DEVICE)
    endpoint.reply("none")
    make_proposer(endpoint, tmp_path).propose(PROBLEM, [], 1)
    assert endpoint.requests[0]["headers"]["authorization"] == "Bearer unused"


def test_unreachable_endpoint_is_named(tmp_path):
    settings = LLMSettings(base_url="http://127.0.0.1:9/v1", max_retries=0, timeout=2)
    with pytest.raises(Cudal2Error, match=r"cannot reach llm endpoint http://127.0.0.1:9/v1"):
        LLMProposer(settings, run_dir=tmp_path, cc=90, device=DEVICE).propose(PROBLEM, [], 1)


def test_settings_precedence_cli_env_file_default(tmp_path, monkeypatch):
    cfg = tmp_path / "cudal2.toml"
    cfg.write_text('[cudal2]\nbudget = 2.0\n[llm]\nmodel = "from-file"\ntemperature = 0.1\nmax_tokens = 1000\n'
                   'base_url = "http://file/v1"\n')
    monkeypatch.setenv("CUDAL2_LLM_MODEL", "from-env")
    monkeypatch.setenv("CUDAL2_LLM_TEMPERATURE", "0.3")
    monkeypatch.setenv("OPENAI_BASE_URL", "http://env/v1")
    s = load_llm_settings({"model": "from-cli", "temperature": None, "api_key_env": "MY_KEY"})
    assert (s.model, s.temperature, s.max_tokens, s.base_url, s.api_key_env) == (
        "from-cli", 0.3, 1000, "http://env/v1", "MY_KEY")
    assert (s.timeout, s.max_rounds, s.max_retries) == (120.0, 20, 4)  # defaults
    assert load_settings().budget == 2.0  # the [llm] table does not disturb [cudal2]


@pytest.mark.parametrize("text, message", [
    ('[llm]\ntemperature = "hot"\n', "bad value 'hot' for setting temperature"),
    ('[llm]\nmodle = "x"\n', r"unknown setting 'modle' in .*c.toml \[llm\]"),
    ("[llm]\nmax_rounds = 0\n", "max_rounds must be > 0"),
    ("[llm]\nmax_retries = -1\n", "max_retries must be >= 0"),
])
def test_bad_llm_config_is_named(tmp_path, text, message):
    cfg = tmp_path / "c.toml"
    cfg.write_text(text)
    with pytest.raises(Cudal2Error, match=message):
        load_llm_settings(config=cfg)


def test_bad_llm_environment_is_named(monkeypatch):
    monkeypatch.setenv("CUDAL2_LLM_MAX_TOKENS", "lots")
    with pytest.raises(Cudal2Error, match=r"bad value 'lots' for setting max_tokens \(from CUDAL2_LLM_MAX_TOKENS\)"):
        load_llm_settings()


def test_pending_candidates_are_not_shown_as_failures(endpoint, tmp_path):
    endpoint.reply("nothing useful")
    pending = {"kernel": "sm80_mma(pending-one)", "template": "sm80_mma", "params": "{}", "status": "pending"}
    make_proposer(endpoint, tmp_path).propose(PROBLEM, HISTORY + [pending], 2)
    assert "pending-one" not in endpoint.prompt()


def test_a_reply_cut_off_at_the_token_limit_is_continued_not_lost(endpoint, tmp_path):
    first = json.dumps({"template": "sm80_mma", "params": GOOD})
    second = json.dumps({"template": "sm80_mma", "params": {**GOOD, "stages": 4}})
    whole = "Bigger tiles win here.\n" + fenced("json", first) + "\n" + fenced("json", second)
    cut = whole.index('"stages": 4')  # the reply stops inside the second block
    endpoint.reply(whole[:cut], finish_reason="length").reply(whole[cut:])
    proposer = make_proposer(endpoint, tmp_path)
    proposals = proposer.propose(PROBLEM, [], 2)
    assert [type(p).__name__ for p in proposals] == ["Candidate", "Candidate"]
    assert len(endpoint.requests) == 2
    follow_up = endpoint.requests[1]["body"]["messages"]
    assert follow_up[2] == {"role": "assistant", "content": whole[:cut]} and "Continue exactly" in follow_up[3]["content"]
    assert proposer.usage[0]["requests"] == 2 and not proposer.usage[0]["cut_off"]
    assert proposer.usage[0]["prompt_tokens"] == 2400  # both requests counted
    # the prompt states the budget the reply has
    assert "up to 16384 tokens" in endpoint.prompt(0) and endpoint.requests[0]["body"]["max_tokens"] == 16384


def test_saved_replies_replay_a_run_without_an_endpoint(tmp_path):
    from cudal2.search.llm import ReplayClient

    saved = tmp_path / "saved"
    saved.mkdir()
    (saved / "llm-round-1-reply.md").write_text(fenced("json", json.dumps({"template": "sm80_mma", "params": GOOD})))
    proposer = LLMProposer(LLMSettings(), run_dir=tmp_path / "run", cc=90, device=DEVICE, client=ReplayClient(saved))
    [candidate] = proposer.propose(PROBLEM, [], 1)
    assert isinstance(candidate, Candidate) and candidate.template == "sm80_mma"
    assert (tmp_path / "run" / "llm-round-1-reply.md").read_text() == (saved / "llm-round-1-reply.md").read_text()
    with pytest.raises(Cudal2Error, match="no reply for round 2"):
        proposer.propose(PROBLEM, [], 1)
    with pytest.raises(Cudal2Error, match="no replay directory"):
        ReplayClient(tmp_path / "nowhere")


def test_parameters_that_left_the_space_are_not_offered_as_valid(endpoint, tmp_path):
    stale = {"kernel": "sm90_cutlass(...)", "template": "sm90_cutlass", "status": "ok", "speedup_offline": 0.98,
             "offline_us": 150.0, "params": json.dumps({"tile_m": 128, "epilogue_stages": 4})}
    endpoint.reply("nothing")
    make_proposer(endpoint, tmp_path).propose(PROBLEM, [stale], 1)
    assert "an earlier version of the template: not a valid parameter set today" in endpoint.prompt()


def test_each_row_shows_its_dynamic_shared_memory_and_registers_per_warpgroup(endpoint, tmp_path):
    """ptxas counts static shared memory (0 for the templates' kernels) and the launch
    registers; the prompt shows what the kernel declared besides, and "-" where nothing is
    known (a free-form source)."""
    measured = {"status": "ok", "offline_us": 200.0, "baseline_offline_us": 140.0, "smem_bytes": 0, "spill_bytes": 0}
    history = [
        {**measured, "kernel": "sm90_cutlass(...)", "template": "sm90_cutlass", "params": "{}", "speedup_offline": 0.98,
         "registers": 168, "dynamic_smem_bytes": 214016, "producer_registers": 40, "consumer_registers": 232},
        {**measured, "kernel": "sm80_mma(...)", "template": "sm80_mma", "params": "{}", "speedup_offline": 0.61,
         "registers": 252, "dynamic_smem_bytes": 131072, "producer_registers": float("nan"),
         "consumer_registers": float("nan")},
        {**measured, "kernel": "mine.cu", "template": None, "params": None, "speedup_offline": 0.2, "registers": 64,
         "spill_bytes": 24, "dynamic_smem_bytes": None},
    ]
    endpoint.reply("nothing")
    make_proposer(endpoint, tmp_path).propose(PROBLEM, history, 1)
    prompt = endpoint.prompt()
    assert "| static smem (B) | dynamic smem (B) | spills (B) |" in prompt
    assert "| 0.980x | 200.00 |" in prompt and "| 168 (40 / 232) | 0 | 214016 | 0 |" in prompt
    assert "| 252 | 0 | 131072 | 0 |" in prompt
    assert "| free-form source mine.cu | 0.200x |" in prompt and "| 64 | 0 | - | 24 |" in prompt


def template_sections(prompt: str) -> dict[str, dict]:
    """Each template of a prompt as the model reads it: the listed values and default of every
    parameter, the constraints and the derived values they read, and the target's facts."""
    sections = {}
    body = prompt[prompt.index("# Templates"):prompt.index("Times are device time")]
    for part in body.split("\n## ")[1:]:
        name, lines = part.split("\n", 1)[0].strip(), part.splitlines()
        params = {}
        for m in (re.match(r"- `(\w+)`: (.+) \[(.+?)\] — ", line) for line in lines):
            if m:
                params[m.group(1)] = (json.loads(f"[{m.group(2)}]"), json.loads(m.group(3)))
        rules, derived, target = [], {}, {}
        for line in lines:
            if header := re.match(r"Constraints .*`max_smem = (\d+)`, `cc = (\d+)`", line):
                target = {"max_smem": int(header.group(1)), "cc": int(header.group(2))}
            elif m := re.fullmatch(r"- `(\w+) = (.+)`", line):
                derived[m.group(1)] = m.group(2)
            elif m := re.fullmatch(r"- `(.+)`", line):
                rules.append(m.group(1))
        sections[name] = {"params": params, "constraints": rules, "derived": derived, "target": target}
    return sections


def shown_valid(section: dict, params: dict) -> bool:
    """Whether a parameter set meets every constraint the prompt shows, judged from the prompt alone."""
    names = {**section["target"], **params}
    for name, expr in section["derived"].items():  # in the order shown: each may read those above
        names[name] = eval(expr, {"__builtins__": {}, "min": min, "max": max}, names)
    return all(eval(rule, {"__builtins__": {}, "min": min, "max": max}, names) for rule in section["constraints"])


@pytest.mark.parametrize("cc", [90, 80])
def test_the_template_section_says_exactly_which_parameter_sets_are_valid(endpoint, tmp_path, cc):
    """Constraints that always hold on the target are left out, and the derived values no
    shown constraint reads: a model judging from the prompt alone still accepts every valid
    parameter set and no invalid one. Checked on valid configurations with one parameter
    moved to another listed value, where a missing constraint or derived value would show."""
    endpoint.reply("nothing")
    make_proposer(endpoint, tmp_path, cc=cc).propose(PROBLEM, [], 1)
    sections = template_sections(endpoint.prompt())
    assert set(sections) == {n for n, t in load_templates().items() if t.supports(PROBLEM, cc)}
    rng = random.Random(cc)
    for name, section in sections.items():
        space = load_templates()[name].space
        assert {p: (list(s.values), s.default) for p, s in space.params.items()} == section["params"]
        assert section["target"] == {"max_smem": max_smem(cc), "cc": cc}
        valid = list(space.configurations(cc))
        for _ in range(1500):
            params = dict(rng.choice(valid))
            moved = rng.choice(list(params))
            params[moved] = rng.choice(section["params"][moved][0])
            assert shown_valid(section, params) == (not space.violations(params, cc)), (name, params)


def test_a_constraint_that_always_holds_on_the_target_is_not_shown(endpoint, tmp_path):
    endpoint.reply("nothing").reply("nothing")
    make_proposer(endpoint, tmp_path, cc=90).propose(PROBLEM, [], 1)
    make_proposer(endpoint, tmp_path, cc=80).propose(PROBLEM, [], 1)
    on_90, on_80 = (template_sections(endpoint.prompt(i))["sm80_mma"] for i in (0, 1))
    assert "split_k == 1 or cc >= 90" not in on_90["constraints"]  # split-K clusters exist on sm_90
    assert "split_k == 1 or cc >= 90" in on_80["constraints"]
    assert set(on_90["constraints"]) == set(load_templates()["sm80_mma"].space.constraints) - {"split_k == 1 or cc >= 90"}
    assert "threads" not in on_90["derived"] and "smem_bytes" in on_90["derived"]  # no constraint reads threads


@pytest.mark.parametrize("problem", [Problem(2048, 512, 2048), Problem(4096, 4096, 4096)], ids=str)
def test_the_template_section_stays_compact(endpoint, tmp_path, problem):
    """It took 8,046 characters of a 12,807-character round (every constraint and derived
    value, the long help); one line per parameter with short help and the binding constraints
    take 5,737 of 10,688 (4096^3 fp16 nn on an H200, nothing measured yet)."""
    endpoint.reply("nothing")
    make_proposer(endpoint, tmp_path).propose(problem, [], 8)
    prompt = endpoint.prompt()
    section = prompt[prompt.index("# Templates"):prompt.index("Times are device time")]
    assert len(section) <= 6200, len(section)
    lines = [line for line in section.splitlines() if re.match(r"- `\w+`: ", line)]
    assert len(lines) == sum(len(t.space.params) for t in load_templates().values() if t.supports(problem, 90))
    assert max(len(p.help) for t in load_templates().values() for p in t.space.params.values()) <= 200
    # what a tuner derives from the problem stays: tiles, waves and the floors
    assert f"128x256 output tiles: {-(-problem.m // 128) * -(-problem.n // 256)} (" in prompt
    assert "DRAM time floor" in prompt and "tensor-core time floor for this problem" in prompt
