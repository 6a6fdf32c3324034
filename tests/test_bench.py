"""The bench protocol's round logic with the GPU stood in for: rotation of the input sets,
each call timed alone, outputs checked, the lower of the two methods claimed."""

import random
import re
from pathlib import Path

import pytest
from conftest import gpu_count

from cudal2.measure.bench import INPUT_SETS, OFFLINE_METHODS, claimed, graph_rounds, kernel_rounds
from cudal2.measure.measure import window_totals
from cudal2.tune.pipeline import timing_columns


class StandInTimer:
    """Times each call as the stand-in device would: `device_us(name)` per call."""

    def __init__(self, device_us):
        self.device_us, self.pending, self.calls = device_us, [], []

    def time(self, fn):
        fn()
        self.pending.append(self.device_us(self.calls[-1]))

    def collect(self):
        done, self.pending = self.pending, []
        return done


class StandInDevice:
    """Input sets whose contents get a new version at every refresh; a memoising contestant
    ('memo') is fast whenever it sees contents it has seen before."""

    def __init__(self):
        self.version = [0] * INPUT_SETS
        self.seen = {}  # contestant -> set of (set, version) it was called on
        self.log = []  # (event, name or None, set, version)
        self.timer = StandInTimer(self.us)

    def refresh(self, s):
        self.version[s] += 1
        self.log.append(("refresh", None, s, self.version[s]))

    def call(self, name, s):
        key = (s, self.version[s])
        repeat = key in self.seen.setdefault(name, set())
        self.seen[name].add(key)
        self.timer.calls.append((name, repeat))
        self.log.append(("call", name, s, self.version[s]))

    def check(self, name, s):
        self.log.append(("check", name, s, self.version[s]))

    @staticmethod
    def us(call):
        name, repeat = call
        return {"honest": 10.0, "baseline": 12.0, "memo": 2.0 if repeat else 10.5}[name]


def test_every_timed_call_sees_fresh_inputs_at_rotating_addresses():
    dev = StandInDevice()
    samples = kernel_rounds(["honest", "baseline", "memo"], call=dev.call, refresh=dev.refresh, check=dev.check,
                            timer=dev.timer, budget_s=0.0, rng=random.Random(1), min_rounds=9)
    calls = [e for e in dev.log if e[0] == "call"]
    assert len(calls) == 27
    # No contestant is ever called twice on the same contents, so a memo never pays:
    assert samples["memo"] == [10.5] * 9 and samples["honest"] == [10.0] * 9
    # Rounds cycle through the sets (different addresses), each refreshed first...
    refreshed = [e[2] for e in dev.log if e[0] == "refresh"]
    assert refreshed == [0, 1, 2] * 3
    # ...and every contestant's output of every round is checked after its call.
    for r in range(9):
        round_calls = {e[1]: e[2:] for e in calls[3 * r:3 * r + 3]}
        assert set(round_calls) == {"honest", "baseline", "memo"} and len(set(round_calls.values())) == 1
    checks = [(e[1], e[2:]) for e in dev.log if e[0] == "check"]
    assert sorted(checks) == sorted((e[1], e[2:]) for e in calls)


def test_contestants_run_in_a_shuffled_order_and_keep_their_own_samples():
    dev = StandInDevice()
    kernel_rounds(["honest", "baseline", "memo"], call=dev.call, refresh=dev.refresh, check=dev.check,
                  timer=dev.timer, budget_s=0.0, rng=random.Random(3), min_rounds=12)
    orders = {tuple(e[1] for e in dev.log[i:i + 7] if e[0] == "call") for i in range(0, len(dev.log), 7)}
    assert len(orders) > 1  # not always the same contestant first (drift falls on all alike)


def test_a_wrong_output_stops_the_rounds():
    dev = StandInDevice()

    def check(name, s):
        if name == "memo":
            raise ValueError("stale output")

    with pytest.raises(ValueError, match="stale"):
        kernel_rounds(["honest", "memo"], call=dev.call, refresh=dev.refresh, check=check, timer=dev.timer,
                      budget_s=0.0, rng=random.Random(0))


def test_lead_calls_run_untimed_on_the_other_sets_and_a_memo_still_never_pays():
    dev = StandInDevice()
    leads = []

    def before(name, s):  # what measure.Session.lead does: the other sets' calls first
        for t in (1, 2):
            dev.call(name, (s + t) % INPUT_SETS)
            leads.append((name, (s + t) % INPUT_SETS))

    samples = kernel_rounds(["honest", "memo"], call=dev.call, refresh=dev.refresh, check=dev.check,
                            timer=dev.timer, budget_s=0.0, rng=random.Random(2), min_rounds=6, before=before)
    assert len(leads) == 2 * 12 and all(len(v) == 6 for v in samples.values())
    # The lead calls repeat earlier contents (the memo is fast there), but they are not timed:
    # every timed call is the first on its set's fresh contents.
    assert samples["memo"] == [10.5] * 6 and samples["honest"] == [10.0] * 6
    assert sum(e[0] == "call" for e in dev.log) == 12 + len(leads)


def test_graph_samples_are_the_calls_share_beyond_the_neighbours():
    replays = {None: 500.0, "a": 500.0 + 20 * 7.5, "b": 500.0 + 20 * 9.0}
    samples = graph_rounds(["a", "b"], replay=replays.__getitem__, calls=20, budget_s=0.0, rng=random.Random(0))
    assert samples == {"a": [7.5] * 5, "b": [9.0] * 5}


def test_a_rested_round_idles_the_gpu_after_each_contestants_replay_for_its_share_of_it(monkeypatch):
    """A screening session of long calls (worker.SCREEN_REST): back to back, the H200 runs
    them at its power cap, not at the clock the protocol's sessions time them at."""
    import importlib

    slept = []
    monkeypatch.setattr(importlib.import_module("cudal2.measure.bench").time, "sleep", slept.append)
    replays = {None: 500.0, "a": 2500.0, "b": 3500.0}
    samples = graph_rounds(["a", "b"], replay=replays.__getitem__, calls=3, budget_s=0.0, rng=random.Random(0),
                           min_rounds=2, rest=1.5)
    assert samples == {"a": [2000 / 3] * 2, "b": [1000.0] * 2}
    # after each contestant's replay, none after the neighbours'
    assert sorted(slept) == pytest.approx(sorted([1.5 * 2500e-6, 1.5 * 3500e-6] * 2))
    slept.clear()
    graph_rounds(["a", "b"], replay=replays.__getitem__, calls=3, budget_s=0.0, rng=random.Random(0))
    assert slept == []  # the protocol's rounds: no rest


def test_only_a_screening_session_of_long_calls_rests_the_gpu():
    from cudal2.measure.measure import graph_rest
    from cudal2.measure.worker import SCREEN_REST, SOAK_US

    screening = {"screen": True, "screen_rest": SCREEN_REST}
    assert graph_rest(screening, SOAK_US) == graph_rest(screening, 40 * SOAK_US) == SCREEN_REST > 0
    assert graph_rest(screening, SOAK_US / 2) == 0.0  # short calls: no power cap to keep off
    assert graph_rest({"screen_rest": SCREEN_REST}, 4 * SOAK_US) == 0.0  # the protocol's session
    assert graph_rest({"screen": True}, 4 * SOAK_US) == 0.0


def test_a_screening_job_carries_its_rest():
    from cudal2.measure.worker import SCREEN_REST

    ok = {"status": "ok", "error": "", "max_error": 1e-4, "tolerance": 0.01}
    session = (session_answers({"status": "ok", "typical_us": 400.0}, {"graph": timed("kernel:0")}), None)
    worker, log, _ = measuring_worker({"a.so": ok}, [session])
    worker.measure(job(), ["a.so"], 10, screen=True)
    [opening] = [j for _, op, j in log if op == "kernels"]
    assert opening["settings"]["screen"] is True and opening["settings"]["screen_rest"] == SCREEN_REST


def test_cupti_records_are_summed_per_call_window_and_the_bench_own_work_ignored():
    windows = [(100, 200), (300, 400)]
    records = [(50, 90),            # a refill before the first call: not counted
               (110, 140), (150, 180),  # the first call's two kernels
               (250, 260),          # the check between calls
               (310, 390)]          # the second call
    assert window_totals(windows, records) == [0.06, 0.08]
    assert window_totals([(0, 10)], []) == [0.0]  # a call that launched nothing reads 0


def test_kernels_of_one_call_that_overlap_count_once():
    """A call whose second kernel is launched with programmatic dependent launch (parallel
    split-K's sum) has it resident, waiting, while the first runs: summed, the two records
    read the overlap twice (on the H200 such a call read 0.91 of the library by CUPTI and 1.08
    in the graph). The device ran them for the union of their intervals."""
    windows = [(100, 300)]
    assert window_totals(windows, [(110, 200), (150, 230)]) == [0.12]  # 110-230, not 90 + 80
    assert window_totals(windows, [(110, 200), (120, 150), (210, 250)]) == [0.13]  # one inside another
    assert window_totals(windows, [(110, 200), (200, 250)]) == [0.14]  # back to back: the sum


def test_the_claim_is_the_lower_of_the_two_methods():
    assert claimed({"kernel": 1.10, "graph": 0.97}) == ("graph", 0.97)
    assert claimed({"kernel": 1.00, "graph": 1.00}) == ("kernel", 1.00)
    assert claimed({"kernel": 1.2}) == ("kernel", 1.2) and claimed({}) is None
    assert OFFLINE_METHODS == ("kernel", "graph")


def timing(us):
    return {"median_us": us, "p20_us": us, "p80_us": us, "samples": 5}


def test_speedups_are_against_the_fastest_baseline_of_each_method():
    timings = {
        "kernel": {"kernel": timing(9.0), "cuBLAS": timing(10.0), "cuBLASLt": timing(9.5), "torch.matmul": timing(9.8)},
        "graph": {"kernel": timing(10.0), "cuBLAS": timing(10.4), "cuBLASLt": timing(10.6), "torch.matmul": timing(10.2)},
    }
    row = timing_columns(timings, "kernel", flops=2 * 64**3)
    assert row["speedup_kernel"] == pytest.approx(9.5 / 9.0)  # cuBLASLt fastest by CUPTI time
    assert row["speedup_graph"] == pytest.approx(10.2 / 10.0)  # torch.matmul fastest in the graph
    assert row["speedup_offline"] == pytest.approx(1.02) and row["baseline"] == "torch.matmul"
    assert (row["offline_us"], row["baseline_offline_us"]) == (10.0, 10.2)
    assert row["speedup_vs_cublas"] == pytest.approx(min(10.0 / 9.0, 10.4 / 10.0))
    assert row["speedup_vs_cublaslt"] == pytest.approx(min(9.5 / 9.0, 10.6 / 10.0))
    assert row["cublaslt_graph_us"] == 10.6 and row["torch_kernel_us"] == 9.8





class StandInLt:
    """cuBLASLt's heuristic stood in for: 4 algorithms, each with its configuration."""

    selected = None

    def algorithms(self, problem):
        return 4

    def select(self, index):
        self.selected = index

    def version(self):
        return 130001

    def describe(self, index):
        return {"algo": 20 + index, "tile": index}


def test_cublaslt_autotuning_times_the_close_algorithms_again_and_keeps_the_fastest():
    from cudal2.measure.baselines import AUTOTUNE_S, DEFAULT, autotune
    from cudal2.problem import Problem

    asked = []
    first = {0: 10.0, 1: 9.1, 2: 9.3, 3: 12.0, DEFAULT: 9.6}
    again = {1: 9.5, 2: 9.2, DEFAULT: 9.7}

    def medians(indices, budget_s):  # all timed together, cuBLAS's default beside them, as the worker does
        asked.append((indices, budget_s))
        return dict(first if len(asked) == 1 else again)

    lt = StandInLt()
    record = autotune(lt, Problem(64, 64, 64), medians)
    # 1 read fastest once, but 2 was within 3% of it and won when the two were timed again;
    # each pass within its share of the autotuning's device time.
    assert asked == [([0, 1, 2, 3], AUTOTUNE_S[0]), ([1, 2], AUTOTUNE_S[1])] and lt.selected == 2
    assert record == {"index": 2, "of": 4, "offered": 4, "cublaslt_version": 130001, "us": 9.2, "heuristic_first_us": 10.0, "algo": 22,
                      "tile": 2, "retimed": [1, 2], "cublas_default_us": 9.7}
    # a long call: the budget allowed the first two of the heuristic's 4 (and the default)
    first, again = {0: 10.0, 1: 9.9, DEFAULT: 9.6}, {0: 9.8, 1: 9.85, DEFAULT: 9.7}
    asked.clear()
    assert autotune(lt, Problem(64, 64, 64), medians) == {
        "index": 0, "of": 2, "offered": 4, "cublaslt_version": 130001, "us": 9.8, "heuristic_first_us": 10.0, "algo": 20, "tile": 0,
        "retimed": [1, 0], "cublas_default_us": 9.7}
    assert sum(budget for _, budget in asked) <= 0.5  # the rest of the baselines' 2 s is their session's


def test_cublaslts_choice_is_kept_per_problem_gpu_driver_and_library_and_checked_when_read(tmp_path, monkeypatch):
    import json

    import cudal2.measure.baselines as baselines
    from cudal2.measure.baselines import names_its_algorithm, pick_key, read_pick, write_pick
    from cudal2.problem import Problem

    h200 = {"gpu": "NVIDIA H200", "cc": 90, "driver": "580.95.05"}
    path = tmp_path / "cache" / baselines.PICKS
    problem = Problem(4096, 1024, 512)
    key = pick_key(problem, h200, "libcublasLt.so.13:551000000")
    record = {"index": 2, "of": 4, "cublaslt_version": 130001, "us": 9.2, "algo": 22, "tile": 2, "stages": 3,
              "splitk": 1, "reduction": 0, "swizzle": 0, "custom": 0, "cluster": 0}
    assert read_pick(path, key) is None  # no file yet
    write_pick(path, key, {"index": 2, "of": 4})  # no configuration: nothing to check it by, not kept
    assert not path.exists()
    write_pick(path, key, record)
    other = pick_key(Problem(4096, 1024, 512, "bf16"), h200, "libcublasLt.so.13:551000000")
    write_pick(path, other, {**record, "index": 1, "algo": 21, "tile": 1})
    assert read_pick(path, key) == record and read_pick(path, other)["index"] == 1  # each problem its own
    # anything the choice depends on, changed: not found
    for changed in (pick_key(Problem(4096, 1024, 513), h200, "libcublasLt.so.13:551000000"),
                    pick_key(Problem(4096, 1024, 512, layout="nt"), h200, "libcublasLt.so.13:551000000"),
                    pick_key(problem, {**h200, "driver": "590.10"}, "libcublasLt.so.13:551000000"),
                    pick_key(problem, {**h200, "gpu": "NVIDIA H100 80GB HBM3"}, "libcublasLt.so.13:551000000"),
                    pick_key(problem, h200, "libcublasLt.so.13:552000000")):
        assert read_pick(path, changed) is None, changed
    monkeypatch.setattr(baselines, "LT_ALGOS", 64)  # the shim asks the heuristic for more: other indices
    assert read_pick(path, pick_key(problem, h200, "libcublasLt.so.13:551000000")) is None
    monkeypatch.undo()
    # a choice written again replaces the key's earlier one
    write_pick(path, key, {**record, "index": 3, "algo": 23, "tile": 3})
    assert read_pick(path, key)["index"] == 3 and len(json.loads(path.read_text())["entries"]) == 2
    # an entry not shaped like a choice is no choice; an unreadable file is an empty one
    path.write_text(json.dumps({"entries": [{"key": key, "record": {**record, "index": "2"}}]}))
    assert read_pick(path, key) is None
    path.write_text("{not json")
    assert read_pick(path, key) is None
    write_pick(path, key, record)
    assert read_pick(path, key) == record
    # read back, it is used only where the heuristic's list still names the same algorithm
    lt = StandInLt()
    assert names_its_algorithm(lt, 4, record)
    assert not names_its_algorithm(lt, 2, record)  # the list is shorter now
    assert not names_its_algorithm(lt, 4, {**record, "algo": 21})  # index 2 is another algorithm now
    assert not names_its_algorithm(lt, 4, {**record, "cublaslt_version": 130000})  # another cuBLASLt loaded


def test_cublaslts_finalists_keep_the_heuristics_first_and_are_judged_offline():
    from cudal2.measure.baselines import choose_finalist, finalists

    record = {"index": 5, "retimed": [5, 4, 1, 2], "finalist_configs": {"5": {"tile": 5}, "0": {"tile": 0}}}
    assert finalists(record) == [5, 0, 4, 1]  # what a plain cuBLASLt call runs is always among them
    us = lambda v: {"median_us": v}
    names = ("cuBLASLt", "cuBLASLt@0", "cuBLASLt@4", "cuBLASLt@1")
    timings = {"kernel": dict(zip(names, map(us, (10.0, 9.0, 9.5, 11.0)))) | {"cuBLAS": us(9.8)},
               "graph": dict(zip(names, map(us, (10.0, 9.2, 9.4, 11.0)))) | {"cuBLAS": us(9.9)},
               "server": dict(zip(names, map(us, (5.0, 20.0, 20.0, 20.0)))) | {"cuBLAS": us(20.0)}}  # cold L2: not judged
    errors = {name: (1e-4, 1e-3) for name in (*names, "cuBLAS")}
    chosen, kept, kept_errors = choose_finalist(record, timings, errors)
    assert chosen["index"] == 0 and chosen["autotuned"] == 5 and chosen["tile"] == 0
    assert kept["kernel"]["cuBLASLt"] == us(9.0) and kept["server"]["cuBLASLt"] == us(20.0)
    assert all(set(entries) == {"cuBLAS", "cuBLASLt"} for entries in kept.values()) and set(kept_errors) == {"cuBLAS", "cuBLASLt"}
    # a finalist left out of the session (outside the tolerance): the others decide
    chosen, kept, _ = choose_finalist({**record, "finalists": [5, 4, 1]}, timings, errors)
    assert chosen["index"] == 4 and "finalists" not in chosen and set(chosen["finalists_us"]) == {"5", "4", "1"}
    assert set(kept["kernel"]) == {"cuBLAS", "cuBLASLt"}  # whatever else was timed, no finalist is a row
    # a finalist missing from the timings: the pick stays, and no finalist is left to be a row
    del timings["graph"]["cuBLASLt@4"]
    chosen, kept, _ = choose_finalist(record, timings, errors)
    assert chosen["index"] == 5 and "finalists_us" not in chosen and "finalist_configs" not in chosen
    assert kept["kernel"]["cuBLASLt"] == us(10.0) and set(kept["kernel"]) == {"cuBLAS", "cuBLASLt"}


class StandInChild:
    """A worker process stood in for: answers each job from `answer(job)`, logging them."""

    def __init__(self, name, answer, log):
        self.name, self.answer, self.log, self.environment = name, answer, log, {"gpu": "stand-in"}

    def start(self):
        self.log.append((self.name, "start", None))
        return self.environment

    def request(self, job, timeout):
        self.log.append((self.name, job["op"], job))
        return self.answer(job)

    def close(self):  # the real one ends the process: the next request starts a fresh one
        self.log.append((self.name, "close", None))


def two_phase_worker(graph_answer, cupti_answer):
    from cudal2.measure.worker import Worker

    worker, log = Worker(), []
    worker._graph = StandInChild("graph", graph_answer, log)
    worker._cupti = StandInChild("cupti", cupti_answer, log)
    return worker, log


def test_a_worker_starts_both_processes_before_any_session_and_a_failed_start_leaves_neither():
    """A tuning run's first shape pays no process's start-up out of its time budget (on the
    H200 the CUPTI process, started inside the first shape's baselines, took 10.8-13.8 s of a
    5 s budget): Worker.start() starts the graph and the CUPTI processes; where one cannot
    start, both are closed and its error is raised."""
    from cudal2.errors import Cudal2Error

    worker, log = two_phase_worker(lambda j: {"status": "ok"}, lambda j: {"status": "ok"})
    assert worker.start() == {"gpu": "stand-in"}
    assert sorted(entry[:2] for entry in log) == [("cupti", "start"), ("graph", "start")]

    worker, log = two_phase_worker(lambda j: {"status": "ok"}, lambda j: {"status": "ok"})

    def fails():
        raise Cudal2Error("the GPU worker exited as it started")

    worker._cupti.start = fails
    with pytest.raises(Cudal2Error, match="exited as it started"):
        worker.start()
    assert ("graph", "close", None) in log and ("cupti", "close", None) in log


def job(protocol="cupti-graph-3", op="kernels", kernels=1):
    return {"op": op, "settings": {"protocol": protocol, "budget_s": 0.0},
            "kernels": [{"name": f"kernel:{i}", "library": f"k{i}.so", "tolerance": 0.01} for i in range(kernels)]}


def session_answers(opened, timings, failing_round=None, failure=None):
    rounds = []

    def answer(j):
        if j["op"] == "round":
            rounds.append(j)
            failed = failure or {"status": "cheat", "error": "a cached result", "contestant": "kernel:0"}
            return failed if len(rounds) == failing_round else {"status": "ok"}
        return {"status": "ok", "timings": timings} if j["op"] == "finish" else opened
    return answer


def test_a_session_opens_both_processes_then_alternates_their_rounds_and_merges_the_timings(monkeypatch):
    from cudal2.measure.worker import MIN_ROUNDS, SOAK_S, SOAK_US

    monkeypatch.setattr("cudal2.measure.worker.gpu_temperature", lambda device: 57)

    record = {"index": 3, "of": 8}
    worker, log = two_phase_worker(
        session_answers({"status": "ok", "cublaslt": record, "typical_us": 4 * SOAK_US}, {"graph": {"kernel:0": 1}}),
        session_answers({"status": "ok"}, {"kernel": {"kernel:0": 2}}))
    result = worker.request(job(), 10)
    assert result["timings"] == {"graph": {"kernel:0": 1}, "kernel": {"kernel:0": 2}}
    assert result["cublaslt"] == record and result["rejected"] == {}
    ops = [(name, op) for name, op, _ in log]
    # the graph process opens (and autotunes) first; the CUPTI one gets its cuBLASLt choice
    assert ops[:2] == [("graph", "kernels"), ("cupti", "kernels")]
    opened = log[1][2]
    assert opened["phase"] == "cupti" and opened["cublaslt"] == record and opened["kernels"] == job()["kernels"]
    assert "phase" not in log[0][2]
    # a long call: the graphs replayed untimed first, so its rounds see a busy GPU's clock
    assert ops[2] == ("graph", "soak") and log[2][2]["seconds"] == SOAK_S
    # then the rounds alternate (drift falls on both methods alike), then each finishes
    assert ops[3:-2] == [("graph", "round"), ("cupti", "round")] * MIN_ROUNDS
    assert ops[-2:] == [("graph", "finish"), ("cupti", "finish")]
    # the temperature its timed rounds began at is recorded (the check times it at the same)
    assert result["temperature_c"] == 57


def test_calls_between_the_two_thresholds_alternate_without_a_soak():
    from cudal2.measure.worker import INTERLEAVE_US, MIN_ROUNDS, SOAK_US

    worker, log = two_phase_worker(
        session_answers({"status": "ok", "typical_us": (INTERLEAVE_US + SOAK_US) / 2}, {"graph": {"kernel:0": 1}}),
        session_answers({"status": "ok"}, {"kernel": {"kernel:0": 2}}))
    assert worker.request(job(), 10)["temperature_c"] is None  # not soaked: not read
    ops = [(name, op) for name, op, _ in log]
    assert ops[2:-2] == [("graph", "round"), ("cupti", "round")] * MIN_ROUNDS


def test_a_job_may_ask_for_fewer_rounds_than_a_session_of_kernels_gets():
    """The baselines' own session (pipeline.measure_baselines) asks for 3 rounds a process:
    with 5, the longest calls of the grid took over 2 s there alone."""
    from cudal2.measure.worker import INTERLEAVE_US

    worker, log = two_phase_worker(
        session_answers({"status": "ok", "typical_us": 2 * INTERLEAVE_US}, {"graph": {"kernel:0": 1}}),
        session_answers({"status": "ok"}, {"kernel": {"kernel:0": 2}}))
    few = job()
    few["settings"] = {**few["settings"], "budget_s": 0.0, "min_rounds": 3}
    worker.request(few, 10)
    ops = [(name, op) for name, op, _ in log]
    assert ops[2:-2] == [("graph", "round"), ("cupti", "round")] * 3


def test_short_calls_are_timed_in_one_block_per_process_the_graph_first():
    from cudal2.measure.worker import INTERLEAVE_US, MIN_ROUNDS

    worker, log = two_phase_worker(
        session_answers({"status": "ok", "typical_us": INTERLEAVE_US / 4}, {"graph": {"kernel:0": 1}}),
        session_answers({"status": "ok"}, {"kernel": {"kernel:0": 2}}))
    assert worker.request(job(), 10)["timings"] == {"graph": {"kernel:0": 1}, "kernel": {"kernel:0": 2}}
    ops = [(name, op) for name, op, _ in log]
    assert ops[2:-2] == [("graph", "round")] * MIN_ROUNDS + [("cupti", "round")] * MIN_ROUNDS


def test_a_session_of_more_contestants_times_longer_so_each_gets_the_rounds_it_would_alone(monkeypatch):
    """A round of a session of 8 kernels and 3 baselines times 11 contestants: for the same
    rounds per contestant as a kernel timed alone with the baselines, 11/4 of the budget. The
    baselines alone get the budget of one kernel's session, and with 3 finalists 6/4 of it."""
    import cudal2.measure.worker as worker_module

    clock = iter(range(10_000))
    monkeypatch.setattr(worker_module.time, "perf_counter", lambda: next(clock) * 0.01)  # 10 ms a request
    rounds = {}
    for contestants in (3, 4, 6, 11):
        worker, log = two_phase_worker(session_answers({"status": "ok", "typical_us": 1.0, "contestants": contestants}, {}),
                                       session_answers({"status": "ok"}, {}))
        settings = {"protocol": "cupti-graph-3", "budget_s": 0.4}
        worker.request({**job(kernels=max(0, contestants - 3)), "settings": settings}, 10)
        rounds[contestants] = [op for _, op, _ in log].count("round")
    assert rounds[3] == pytest.approx(rounds[4], rel=0.05)
    assert rounds[11] == pytest.approx(rounds[4] * 11 / 4, rel=0.1)
    assert rounds[6] == pytest.approx(rounds[4] * 6 / 4, rel=0.1)


def measuring_worker(verdicts, sessions):
    """A worker whose graph process answers verify jobs from `verdicts` (library -> answer)
    and whose sessions answer in turn from `sessions` (each: kernels -> (graph answer, cupti answer))."""
    opened = []

    def graph(j):
        if j["op"] == "kernel":
            return verdicts[j["library"]]
        if j["op"] in ("kernels", "baselines"):
            opened.append([k["library"] for k in j["kernels"]])
        return sessions[len(opened) - 1][0](j)

    def cupti(j):
        return sessions[len(opened) - 1][1](j)

    worker, log = two_phase_worker(graph, cupti)
    return worker, log, opened


def timed(*names, us=10.0):
    entries = {name: {"median_us": us + i} for i, name in enumerate(names)}
    return entries | {"cuBLAS": {"median_us": 20.0}, "cuBLASLt": {"median_us": 19.0}}


def test_measure_verifies_each_kernel_alone_then_times_the_verified_together():
    ok = {"status": "ok", "error": "", "max_error": 1e-4, "tolerance": 0.01}
    verdicts = {"a.so": ok, "b.so": {"status": "wrong", "error": "max error"}, "c.so": {**ok, "tolerance": 0.02}}
    session = (session_answers({"status": "ok", "typical_us": 1.0, "cublaslt": {"index": 0}},
                               {"graph": timed("kernel:0", "kernel:2")}),
               session_answers({"status": "ok"}, {"kernel": timed("kernel:0", "kernel:2", us=9.0)}))
    worker, log, opened = measuring_worker(verdicts, [session])
    results = worker.measure(job(), ["a.so", "b.so", "c.so"], 10)
    assert [r["status"] for r in results] == ["ok", "wrong", "ok"]
    assert opened == [["a.so", "c.so"]]  # one session: the two verified, not the wrong one
    tolerances = [k["tolerance"] for k in next(j for _, op, j in log if op == "kernels")["kernels"]]
    assert tolerances == [0.01, 0.02]  # each with the tolerance its verification found
    # each result: its own time under "kernel", beside the same baselines' of the session
    assert results[0]["timings"]["graph"]["kernel"] == {"median_us": 10.0}
    assert results[2]["timings"]["graph"]["kernel"] == {"median_us": 11.0}
    assert results[2]["timings"]["kernel"]["kernel"] == {"median_us": 10.0}
    assert results[0]["timings"]["graph"]["cuBLASLt"] == results[2]["timings"]["graph"]["cuBLASLt"]
    assert results[0]["cublaslt"] == {"index": 0} and "timings" not in results[1]


def test_a_check_failing_in_a_session_of_several_convicts_none_until_each_is_timed_alone():
    """kernel:1's output differed in the shared session, but another kernel may have written
    into it (or into cuBLAS's, the reference): alone, b passes and a is caught."""
    ok = {"status": "ok", "tolerance": 0.01}
    caught = lambda name: session_answers({"status": "ok"}, {}, failing_round=2, failure={
        "status": "cheat", "error": f"{name}: output of a timed call differs", "contestant": name})
    shared = (session_answers({"status": "ok", "typical_us": 1.0}, {}), caught("kernel:1"))
    a_alone = (session_answers({"status": "ok", "typical_us": 1.0}, {}), caught("kernel:0"))
    b_alone = (session_answers({"status": "ok", "typical_us": 1.0}, {"graph": timed("kernel:1")}),
               session_answers({"status": "ok"}, {"kernel": timed("kernel:1")}))
    worker, log, opened = measuring_worker({"a.so": ok, "b.so": ok}, [shared, a_alone, b_alone])
    results = worker.measure(job(), ["a.so", "b.so"], 10)
    assert opened == [["a.so", "b.so"], ["a.so"], ["b.so"]]
    assert results[0]["status"] == "cheat" and "kernel:0" in results[0]["error"] and results[0]["timings"] == {}
    assert results[1]["status"] == "ok" and results[1]["timings"]["kernel"]["kernel"] == {"median_us": 10.0}


def test_a_session_that_crashed_naming_no_kernel_times_each_alone_to_find_it():
    ok = {"status": "ok", "tolerance": 0.01}
    crashed = lambda j: {"status": "crash", "error": "worker process died (exit code -11)"}
    alone = (session_answers({"status": "ok", "typical_us": 1.0}, {"graph": timed("kernel:0")}),
             session_answers({"status": "ok"}, {"kernel": timed("kernel:0")}))
    worker, log, opened = measuring_worker({"a.so": ok, "b.so": ok}, [(crashed, crashed), alone, (crashed, crashed)])
    results = worker.measure(job(), ["a.so", "b.so"], 10)
    assert opened == [["a.so", "b.so"], ["a.so"], ["b.so"]]
    assert results[0]["status"] == "ok" and results[1]["status"] == "crash" and "died" in results[1]["error"]


def test_a_kernel_below_the_physical_limit_is_rejected_at_the_finish_and_the_others_kept():
    ok = {"status": "ok", "tolerance": 0.01}
    session = (session_answers({"status": "ok", "typical_us": 1.0}, {"graph": timed("kernel:0", "kernel:1")}),
               lambda j: ({"status": "ok", "timings": {"kernel": timed("kernel:0", "kernel:1")},
                           "rejected": {"kernel:1": ("cheat", "below the physical limit")}}
                          if j["op"] == "finish" else {"status": "ok"}))
    worker, log, opened = measuring_worker({"a.so": ok, "b.so": ok}, [session])
    results = worker.measure(job(), ["a.so", "b.so"], 10)
    assert [r["status"] for r in results] == ["ok", "cheat"] and "physical" in results[1]["error"]




def test_after_a_fault_the_next_kernel_is_verified_in_a_fresh_process():
    """A kernel that swallowed a failed launch (its output unwritten, an error left pending),
    one that crashed, one judged wrong: each is followed by a fresh process, so the honest
    kernel after it, which returns what cudaGetLastError() says, reports its own status. A
    kernel that declines the shape cleanly, or passes, costs no process."""
    ok = {"status": "ok", "tolerance": 0.01}
    verdicts = {"swallowed.so": {"status": "wrong", "error": "outputs unwritten",
                                 "left_error": "cudaErrorInvalidValue"},
                "crash.so": {"status": "crash", "error": "worker process died (exit code -6)"},
                "half.so": {"status": "wrong", "error": "max error"},
                "declines.so": {"status": "unsupported", "error": "returned 1"},
                "leaves.so": {**ok, "left_error": "cudaErrorInvalidValue"},
                "honest.so": ok}
    order = ["honest.so", "swallowed.so", "honest.so", "crash.so", "honest.so", "declines.so", "honest.so",
             "half.so", "leaves.so", "honest.so"]
    worker, log, opened = measuring_worker(verdicts, [])
    worker.request = lambda job, timeout: {"status": "ok", "rejected": {}, "timings": {}}  # the sessions: not here
    worker.measure(job(), order, 10)
    verified = [("close" if op == "close" else j["library"]) for name, op, j in log if name == "graph"]
    assert verified == ["honest.so", "swallowed.so", "close", "honest.so", "crash.so", "close", "honest.so",
                        "declines.so", "honest.so", "half.so", "close", "leaves.so", "close", "honest.so"]


def test_a_session_that_failed_or_left_an_error_is_followed_by_fresh_processes():
    ok = {"status": "ok", "tolerance": 0.01}
    left = lambda j: ({"status": "ok", "timings": {"kernel": timed("kernel:0")}, "left_errors": {"kernel:0": "cudaErrorInvalidValue"}}
                      if j["op"] == "finish" else {"status": "ok"})
    clean = (session_answers({"status": "ok", "typical_us": 1.0}, {"graph": timed("kernel:0")}),
             session_answers({"status": "ok"}, {"kernel": timed("kernel:0")}))
    caught = (session_answers({"status": "ok", "typical_us": 1.0}, {}),
              session_answers({"status": "ok"}, {}, failing_round=1))
    leaving = (session_answers({"status": "ok", "typical_us": 1.0}, {"graph": timed("kernel:0")}), left)

    for session, fresh in ((clean, False), (caught, True), (leaving, True)):
        worker, log, opened = measuring_worker({"a.so": ok}, [session])
        result = worker.measure(job(), ["a.so"], 10)[0]
        closed = {name for name, op, _ in log if op == "close"}
        assert closed == ({"graph", "cupti"} if fresh else set()), (session, log)
        assert result["status"] == ("cheat" if session is caught else "ok")


@pytest.mark.skipif(gpu_count() > 0, reason="with a GPU the script measures for minutes (the README's test runs it)")
def test_a_script_calling_the_api_at_its_top_level_starts_the_worker_once(tmp_path):
    """The worker is a fresh interpreter that never imports the caller's main module: a script
    of two lines at its top level, run as a file or from stdin, is not run again in the
    worker (multiprocessing's spawn did, which died bootstrapping). Without a GPU it ends
    with the one error of no usable device, which the worker reports."""
    import os
    import subprocess
    import sys

    script = tmp_path / "snippet.py"
    script.write_text("import cudal2\nresult = cudal2.bench(cudal2.Problem(64, 64, 64))\n")
    env = {**os.environ, "CUDAL2_RESULTS": str(tmp_path / "results"), "CUDAL2_CACHE_DIR": str(tmp_path / "cache"),
           "PYTHONPATH": os.pathsep.join(filter(None, [str(Path(__file__).resolve().parent.parent),
                                                       os.environ.get("PYTHONPATH")]))}
    runs = [subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, cwd=tmp_path,
                           timeout=300),
            subprocess.run([sys.executable, "-"], stdin=script.open(), capture_output=True, text=True, env=env,
                           cwd=tmp_path, timeout=300)]
    for run in runs:
        assert "bootstrapping" not in run.stderr and "EOFError" not in run.stderr, run.stderr
        assert run.returncode == 1
        assert re.search(r"no usable CUDA device|no NVIDIA driver", run.stderr.strip().splitlines()[-1]), run.stderr


def test_the_baselines_session_is_short_and_reuses_the_choice_kept_on_this_machine(tmp_path, monkeypatch):
    """The first measurement of a problem autotunes and decides between the finalists; a
    later run (a fresh context) sends the kept choice and asks for none; a choice the worker
    found stale comes back re-made and replaces the kept one."""
    from cudal2.measure.baselines import PICKS, SESSION_BUDGET_S, SESSION_MIN_ROUNDS, SESSION_SOAK_S, read_pick
    from cudal2.kernels.compile import Compiler
    from cudal2.config import Settings
    from cudal2.results.leaderboard import Leaderboard
    from cudal2.tune.pipeline import Context, measure_baselines
    from cudal2.problem import Problem

    monkeypatch.setattr("cudal2.tune.pipeline.cublaslt_version", lambda: "libcublasLt.so.13:551000000")
    config = {"algo": 22, "tile": 2, "stages": 3, "splitk": 1, "reduction": 0, "swizzle": 0, "custom": 0, "cluster": 0}
    autotuned = {"index": 2, "of": 4, "cublaslt_version": 130001, "us": 9.2, **config, "finalists": [2, 0],
                 "finalist_configs": {"2": config, "0": {**config, "algo": 20, "tile": 0}}}
    settings = Settings(results=tmp_path / "results", cache_dir=tmp_path / "cache", budget=1.0)

    def run(answered, finalists=()):  # a worker that timed these finalists beside the baselines
        names = ("cuBLAS", "cuBLASLt", *finalists)
        errors = {name: (1e-4, 1e-3) for name in names}
        times = {name: timing(20.0 - i) for i, name in enumerate(names)}  # the last the fastest
        worker, log = two_phase_worker(
            session_answers({"status": "ok", "cublaslt": answered, "typical_us": 1.0, "errors": errors}, {"graph": times}),
            session_answers({"status": "ok"}, {"kernel": times}))
        worker._graph.environment = {"gpu": "NVIDIA H200", "cc": 90, "driver": "580.95.05", "memory_bytes": 1 << 37}
        ctx = Context(Problem(4096, 1024, 512), settings, worker, Compiler("sm_90a", tmp_path / "cache"),
                      Leaderboard(settings.results), "test", libraries={"cuBLAS": "b.so", "cuBLASLt": "lt.so"})
        rows = measure_baselines(ctx)
        assert {row["kernel"] for row in rows} == {"cuBLAS", "cuBLASLt"}
        return log[0][2], ctx.cublaslt[ctx.problem]

    sent, chosen = run(autotuned, finalists=("cuBLASLt@0",))
    assert sent["finalists"] and "cublaslt" not in sent
    assert sent["settings"]["budget_s"] == SESSION_BUDGET_S and sent["settings"]["soak_s"] == SESSION_SOAK_S
    assert sent["settings"]["min_rounds"] == SESSION_MIN_ROUNDS < 5  # fewer rounds than a kernel's session
    kept = read_pick(settings.cache_dir / PICKS, next(iter(json_entries(settings.cache_dir / PICKS)))["key"])
    assert kept == chosen and chosen["index"] == 0 and "finalists" not in kept  # the session's faster finalist

    sent, chosen = run(kept)  # the worker used what it was sent
    assert sent["cublaslt"] == kept and not sent["finalists"] and chosen == kept

    remade = {"index": 1, "of": 4, "cublaslt_version": 130002, "us": 9.0, **config, "algo": 21, "tile": 1}
    sent, chosen = run(remade)  # the kept one named another algorithm there: re-made
    assert sent["cublaslt"] == kept and chosen == remade
    assert [e["record"] for e in json_entries(settings.cache_dir / PICKS)] == [remade]


def json_entries(path):
    import json

    return json.loads(path.read_text())["entries"]


def test_a_screening_session_verifies_each_kernel_then_times_the_graph_method_alone_for_a_few_rounds():
    """The screening pass (cudal2/tune/optimize.py): every kernel verified as in the protocol,
    then one session in the graph process only (no CUPTI process), SCREEN_ROUNDS rounds and
    the finish's checks; its rows carry the graph method's timings alone."""
    from cudal2.measure.worker import SCREEN_ROUNDS

    ok = {"status": "ok", "error": "", "max_error": 1e-4, "tolerance": 0.01}
    verdicts = {"a.so": ok, "b.so": {"status": "wrong", "error": "max error"}, "c.so": ok}
    never = lambda j: pytest.fail(f"the CUPTI process was asked for {j['op']} in a screening session")
    session = (session_answers({"status": "ok", "typical_us": 1.0}, {"graph": timed("kernel:0", "kernel:2")}), never)
    worker, log, opened = measuring_worker(verdicts, [session])
    results = worker.measure(job(), ["a.so", "b.so", "c.so"], 10, screen=True)
    assert [r["status"] for r in results] == ["ok", "wrong", "ok"]
    assert [j["library"] for _, op, j in log if op == "kernel"] == ["a.so", "b.so", "c.so"]  # every one verified
    assert opened == [["a.so", "c.so"]] and {name for name, *_ in log} == {"graph"}
    assert [op for _, op, _ in log if op in ("round", "soak", "finish")] == ["round"] * SCREEN_ROUNDS + ["finish"]
    assert set(results[0]["timings"]) == {"graph"} and results[2]["timings"]["graph"]["kernel"] == {"median_us": 11.0}


def test_a_screening_session_of_millisecond_calls_times_one_round():
    """Where the library's call takes a millisecond or more, one replay of a kernel's graph
    (three calls) ranks it: a 5 s budget then screens more of the batch."""
    from cudal2.measure.worker import LONG_SCREEN_US

    ok = {"status": "ok", "error": "", "max_error": 1e-4, "tolerance": 0.01}
    for typical, rounds in ((LONG_SCREEN_US / 2, 3), (LONG_SCREEN_US, 1), (4 * LONG_SCREEN_US, 1)):
        session = (session_answers({"status": "ok", "typical_us": typical}, {"graph": timed("kernel:0")}), None)
        worker, log, _ = measuring_worker({"a.so": ok}, [session])
        [result] = worker.measure(job(), ["a.so"], 10, screen=True)
        assert result["status"] == "ok" and result["timings"]["graph"]["kernel"] == {"median_us": 10.0}
        assert [op for _, op, _ in log if op in ("round", "finish")] == ["round"] * rounds + ["finish"], typical


def test_a_screening_session_that_catches_a_kernel_convicts_it_alone_as_the_protocol_does():
    ok = {"status": "ok", "tolerance": 0.01}
    caught = lambda name: session_answers({"status": "ok"}, {}, failing_round=2, failure={
        "status": "cheat", "error": f"{name}: output of a timed call differs", "contestant": name})
    clean = session_answers({"status": "ok", "typical_us": 1.0}, {"graph": timed("kernel:1")})
    worker, log, opened = measuring_worker({"a.so": ok, "b.so": ok}, [(caught("kernel:0"), None),
                                                                     (caught("kernel:0"), None), (clean, None)])
    results = worker.measure(job(), ["a.so", "b.so"], 10, screen=True)
    assert opened == [["a.so", "b.so"], ["a.so"], ["b.so"]]
    assert [r["status"] for r in results] == ["cheat", "ok"] and "kernel:0" in results[0]["error"]
    assert ("graph", "close", None) in log  # a failed session: fresh processes after it


def test_a_failed_session_of_several_is_timed_again_by_halves_down_to_the_culprit():
    """One culprit among four: its session and the halves holding it fail, the innocent half
    is timed as one session, and only a session of one convicts (log2 sessions, not one
    each: a screening session holds 64 kernels)."""
    ok = {"status": "ok", "tolerance": 0.01}
    failing = lambda: (session_answers({"status": "ok", "typical_us": 1.0}, {}, failing_round=1, failure={
        "status": "cheat", "error": "kernel:1: output of a timed call differs", "contestant": "kernel:1"}), None)
    clean = lambda *names: (session_answers({"status": "ok", "typical_us": 1.0}, {"graph": timed(*names)}), None)
    libraries = ["a.so", "b.so", "c.so", "d.so"]
    worker, log, opened = measuring_worker(dict.fromkeys(libraries, ok), [
        failing(), failing(), clean("kernel:0"), failing(), clean("kernel:2", "kernel:3")])
    results = worker.measure(job(), libraries, 10, screen=True)
    assert opened == [libraries, ["a.so", "b.so"], ["a.so"], ["b.so"], ["c.so", "d.so"]]
    assert [r["status"] for r in results] == ["ok", "cheat", "ok", "ok"]
    assert results[3]["timings"]["graph"]["kernel"] == {"median_us": 11.0}
