"""The benches run in --quick mode (a smoke run each, not a measurement), and the
shared helpers in benches/common.py do what they say."""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

BENCHES = Path(__file__).resolve().parent.parent / "benches"


@pytest.fixture
def benches(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHES))
    import common
    return common


def bench_main(name: str):
    __import__(name)
    return sys.modules[name].main


def test_side_by_side_alternates_and_takes_the_median(benches, monkeypatch):
    calls = []
    durations = [1.0, 2.0, 5.0, 2.0, 3.0, 7.0]  # a, b, a, b, a, b
    ticks = iter([t for d in durations for t in (0.0, d)])
    monkeypatch.setattr(benches.time, "perf_counter", lambda: next(ticks))
    seconds = benches.side_by_side({"a": lambda: calls.append("a"), "b": lambda: calls.append("b")},
                                   repeats=3, warmup=1)
    assert calls == ["a", "b"] * 4  # one untimed warm-up each, then alternating
    assert seconds == {"a": 3.0, "b": 2.0}


def test_timed_is_a_median(benches, monkeypatch):
    ticks = iter([0.0, 1.0, 1.0, 4.0, 4.0, 6.0])  # three calls lasting 1, 3 and 2 seconds
    monkeypatch.setattr(benches.time, "perf_counter", lambda: next(ticks))
    assert benches.timed(lambda: None, repeats=3, warmup=0) == statistics.median([1.0, 3.0, 2.0])


def test_tables_and_json(benches, tmp_path):
    rows = [{"name": "x", "tok_s": 1234.5, "ratio": 0.98765, "ok": True}, {"name": "yy", "ratio": None}]
    text = benches.format_table(rows, ["name", ("tok_s", "tok/s"), "ratio", "ok"])
    lines = text.splitlines()
    assert lines[0].split() == ["name", "tok/s", "ratio", "ok"] and len({len(line) for line in lines}) == 1
    assert "1,234" in lines[2] and "0.988" in lines[2] and "yes" in lines[2] and lines[3].split()[1:] == ["-"] * 3
    markdown = benches.format_table(rows, ["name", "ratio"], markdown=True).splitlines()
    assert markdown[0].startswith("| name") and set(markdown[1]) <= {"|", "-", " "}
    path = benches.write_json(tmp_path / "r.json", {"rows": rows})
    payload = json.loads(path.read_text())
    assert payload["rows"][0]["tok_s"] == 1234.5
    assert {"platform", "cpu_count", "torch", "date", "torch_threads"} <= set(payload["machine"])


def test_serve_quick(benches, tmp_path):
    """Servers started, Poisson clients served, a row per variant and rate, and the serving targets."""
    pytest.importorskip("uvicorn")
    out = tmp_path / "serve.json"
    assert bench_main("serve")(["--quick", "--out", str(out)]) == 0
    payload = json.loads(out.read_text())
    rows = payload["rows"]
    assert [(r["variant"], r["rate"]) for r in rows] == [("plain", 4.0), ("plain", 32.0), ("γ=4", 4.0), ("γ=4", 32.0)]
    assert all(r["out_tok_per_s"] > 0 and 0 < r["ttft_p50_ms"] <= r["ttft_p99_ms"] and r["offline_ttft_ms"] > 0
               for r in rows)
    assert [t["target"] for t in payload["targets"]] == [
        "plain: served / offline tok/s at 32 req/s", "plain: p50 TTFT / offline first token at 4 req/s",
        "γ=4: served / offline tok/s at 32 req/s", "γ=4: p50 TTFT / offline first token at 4 req/s"]
    assert all(t["figure"] > 0 for t in payload["targets"])


def test_serve_hol_quick(benches, tmp_path):
    """Big bodies against a streaming server: the allowed ones over the context 400, the one over the limit 413."""
    out = tmp_path / "serve_hol.json"
    assert bench_main("serve_hol")(["--quick", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["status"] for r in rows] == [None, 400, 400, 413]
    assert all(r["longest_gap_s"] > 0 for r in rows)


def test_serve_clients_quick(benches, tmp_path):
    """Both servers answer the own client at each concurrency: a row each, latencies and throughput measured
    (the real clients, lm-eval and aiperf, are left out of a smoke run)."""
    pytest.importorskip("uvicorn")
    out = tmp_path / "serve_clients.json"
    assert bench_main("serve_clients")(["--quick", "--out", str(out)]) == 0
    payload = json.loads(out.read_text())
    rows = payload["rows"]
    assert [(r["server"], r["concurrency"], r["tool"]) for r in rows] == [
        (server, c, "own client") for server in ("speculative (auto)", "plain") for c in (1, 2)]
    assert all(r["TTFT p50 ms"] > 0 and r["ITL p99 ms"] >= r["ITL p50 ms"] >= 0 and r["output tok/s"] > 0
               for r in rows)
    assert payload["lm_eval"] is None and payload["errors"] == {}


def test_prompt_logprobs_quick(benches, tmp_path):
    """A row per variant; a request asking for prompt log-probs takes no prefix hit, and its log-probs with
    the cache on equal those with it off."""
    out = tmp_path / "prompt_logprobs.json"
    assert bench_main("prompt_logprobs")(["--quick", "--out", str(out)]) == 0
    payload = json.loads(out.read_text())
    rows = {r["variant"]: r for r in payload["rows"]}
    assert list(rows) == ["off", "off + logprobs", "on", "on + logprobs"] and payload["cache_on_equals_off"]
    assert rows["on"]["hit_tokens"] > 0 and rows["on + logprobs"]["hit_tokens"] == 0
    assert rows["on + logprobs"]["computed"] == rows["off"]["computed"] >= rows["on"]["computed"]


def test_plain_decode_quick(benches, tmp_path):
    out = tmp_path / "plain.json"
    assert bench_main("plain_decode")(["--quick", "--out", str(out)]) == 0
    payload = json.loads(out.read_text())
    assert [r["batch"] for r in payload["rows"]] == [1, 4]
    for row in payload["rows"]:
        assert row["tokens_equal"] is True and row["first_mismatch"] is None
        assert row["engine_tok_s"] > 0 and row["hf_tok_s"] > 0
        assert row["ratio"] == pytest.approx(row["engine_tok_s"] / row["hf_tok_s"])


def test_quant_quick(benches, tmp_path):
    """Every format decodes the embedded target; speculative equals plain on each."""
    out = tmp_path / "quant.json"
    assert bench_main("quant")(["--quick", "--out", str(out)]) == 0
    payload = json.loads(out.read_text())
    assert [r["format"] for r in payload["rows"]] == ["float32", "q8_0", "q4_0", "q4_k"]
    assert payload["rows"][1]["weight_mb"] < payload["rows"][0]["weight_mb"] / 3
    assert all(r["equal"] for r in payload["speculative"])


def test_quant_head_quick(benches, tmp_path):
    """A Q6_K head's passes side by side: both layouts at every row count, the coarse argmax at one row
    (nothing where the CPU has no AVX512-VNNI)."""
    out = tmp_path / "quant_head.json"
    assert bench_main("quant")(["--quick", "--head", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    from hybridspec.kernels.cpu import quant as cpu_quant
    if cpu_quant.vector_path() != "avx512vnni":
        assert rows == []
        return
    assert {(r["rows"], r["variant"].split(",")[1].strip()) for r in rows} >= {(1, "plain"), (4, "interleaved")}
    assert [r["rows"] for r in rows if "coarse" in r["variant"]] == [1]
    assert all(r["ms"] > 0 and r["speedup_min"] <= r["speedup"] <= r["speedup_max"] for r in rows)


def test_gdn_speed_quick(benches, tmp_path):
    """Plain decode against HF, the snapshot and log overheads, speculative with both GDN drafters."""
    out = tmp_path / "gdn.json"
    assert bench_main("gdn_speed")(["--quick", "--out", str(out)]) == 0
    payload = json.loads(out.read_text())
    assert [(r["prompt_len"], r["batch"]) for r in payload["decode"]] == [(16, 1), (16, 4)]
    for row in payload["decode"]:
        assert row["tokens_equal"] is True
        assert row["speedup"] == pytest.approx(row["hf_ms_tok"]["median"] / row["engine_ms_tok"]["median"])
    assert [r["batch"] for r in payload["overhead"]] == [1, 4, 16]
    assert all(r["final_only_ms"] > 0 and r["every_input_ms"] > 0 and r["log_ms"] > 0 for r in payload["overhead"])
    assert len(payload["spec"]) == 3 and all(r["spec_equals_plain"] is True for r in payload["spec"])
    assert payload["spec"][1]["acceptance_rate"] > payload["spec"][0]["acceptance_rate"]  # the copy agrees more


def test_e2e_quick(benches, tmp_path):
    out = tmp_path / "e2e.json"
    assert bench_main("e2e")(["--quick", "--out", str(out)]) == 0
    payload = json.loads(out.read_text())
    rows = payload["rows"]
    assert [(r["workload"], r["drafter"]) for r in rows[:2]] == [("embedded", "model"), ("embedded", "ngram")]
    assert rows[2]["workload"].startswith("random")
    for row in rows:
        assert row["spec_equals_plain"] is True and row["plain_equals_hf"] is True  # greedy: all three agree
        assert row["speedup"] == pytest.approx(row["spec_tok_s"] / row["plain_tok_s"])
        assert row["spec_stats"]["emitted_tokens"] == payload["new_tokens"] * payload["prompts"]
        assert 0.0 <= row["acceptance_rate"] <= 1.0 and row["c"] > 0 and row["verify_cost"] > 0
        assert row["spec_outside_ms"] >= 0 and row["plain_outside_ms"] >= 0  # wall and phases of one call
    assert out.with_suffix(".png").stat().st_size > 0


def test_e2e_exact_draft_is_always_accepted(benches, tmp_path):
    """lambda = 0: the target's layers past the draft's add nothing, so the
    layer-skip draft is the target's own distribution and every draft is kept."""
    out = tmp_path / "e2e0.json"
    assert bench_main("e2e")(["--quick", "--skip", "embedded", "--scales", "0", "--out", str(out)]) == 0
    (row,) = json.loads(out.read_text())["rows"]
    assert row["acceptance_rate"] == 1.0 and row["spec_equals_plain"] is True


def test_batch_sweep_quick(benches, tmp_path):
    out = tmp_path / "sweep.json"
    assert bench_main("batch_sweep")(["--quick", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert {r["batch"] for r in rows} == {1, 2} and all(r["same tokens"] for r in rows)
    assert all(r["plain tok/s"] > 0 and r["auto / plain"] > 0 for r in rows)
    assert (tmp_path / "sweep.png").is_file()


def test_compile_probe_quick(benches, tmp_path):
    out = tmp_path / "compile.json"
    assert bench_main("compile_probe")(["--quick", "--repeats", "1", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["part"] for r in rows] == ["verify recurrence, 5 inputs", "decode recurrence, 1 input", "gated RMSNorm"]
    assert all(r["eager_ms"] > 0 and r["compiled_ms"] > 0 for r in rows)
    assert all(r["max_abs_diff"] < 1e-4 for r in rows)  # the compiled math is the eager math


def test_threads_quick(benches, tmp_path):
    import torch
    out = tmp_path / "threads.json"
    before = torch.get_num_threads()
    assert bench_main("threads")(["--quick", "--thread-counts", "1", "2", "--out", str(out)]) == 0
    assert torch.get_num_threads() == before  # the run's thread count restored
    rows = json.loads(out.read_text())["rows"]
    forwards = [r for r in rows if not r["part"].startswith("generate")]
    assert {(r["part"], r["threads"], r["kernels"]) for r in forwards} == {
        (p, t, k) for p in ("plain step", "verify (5 inputs)") for t, k in ((1, "native"), (2, "native"), (2, "torch"))}
    generates = [r for r in rows if r["part"].startswith("generate")]
    assert len(generates) == 4 and all(r["tok_s"] > 0 for r in generates)  # the tokens were checked equal
    assert all(r["min_ms"] <= r["ms"] <= r["max_ms"] for r in rows)


def test_llamacpp_quick_without_a_converter(benches, tmp_path):
    """Our side of the llama.cpp comparison on a tiny Granite-4.0-H-shaped model: it agrees with HF,
    and the llama.cpp side is skipped with its reason (no llama_cpp, or no converter given)."""
    import torch
    out = tmp_path / "llamacpp.json"
    before = torch.get_num_threads()
    assert bench_main("llamacpp")(["--quick", "--thread-counts", "1", "2", "--out", str(out)]) == 0
    assert torch.get_num_threads() == before
    payload = json.loads(out.read_text())
    assert payload["llama_cpp_skipped"]
    assert [c["weights"] for c in payload["checks"]] == ["float32", "bfloat16"]
    assert all(c["ours_vs_hf"] < 1e-4 for c in payload["checks"])
    assert {(r["weights"], r["threads"]) for r in payload["rows"]} == {
        (w, t) for w in ("float32", "bfloat16") for t in (1, 2)}
    for row in payload["rows"]:
        decode = row["hybridspec decode tok/s"]
        assert decode["min"] <= decode["median"] <= decode["max"]  # (a smoke run: a timing, not a measurement)
        spec = row["hybridspec speculative decode tok/s"]  # the speculative row: a layer-skip draft
        assert spec["min"] <= spec["median"] <= spec["max"] and 0.0 <= row["acceptance_rate"] <= 1.0
    assert all(c["spec_equals_plain"] for c in payload["checks"])  # greedy speculative tokens are the plain ones
    assert payload["speculative"]["draft_layers"] == 1 and all("spec_decode" in r for r in payload["table"])


def test_llamacpp_quant_quick_runs_one_file_in_every_runtime_it_has(benches, tmp_path):
    """The quantized-GGUF comparison on a tiny model: our side loads the quantized file (llama.cpp's
    quantizer where llama_cpp is importable, else our writer's) close to HF's logits, speculates
    exactly, and a fresh process measures its resident memory; llama.cpp's columns where it runs."""
    out = tmp_path / "llamacpp_quant.json"
    assert bench_main("llamacpp_quant")(["--quick", "--formats", "Q8_0", "--thread-counts", "1", "--gamma", "2", "3",
                                         "--out", str(out)]) == 0
    payload = json.loads(out.read_text())
    assert [c["format"] for c in payload["checks"]] == ["F32", "Q8_0"]
    f32, q8 = payload["checks"]
    assert f32["ours_vs_hf"]["max_rel"] < 1e-5 and q8["ours_vs_hf"]["max_rel"] < 0.05
    assert "Q8_0" in q8["tensor_bytes_by_type"] and q8["tensor_bytes"] < f32["tensor_bytes"]
    [row] = payload["rows"]
    labels = {"draft file γ=2", "draft file γ=3", "layers:1 γ=2", "layers:1 γ=3"}  # both drafters by default
    assert row["speculative equals plain"] and set(row["acceptance_rates"]) == labels
    assert all(0.0 <= rate <= 1.0 for rate in row["acceptance_rates"].values())
    [cells] = payload["table"]  # the fastest drafter's and γ's figure in the speculative column
    assert cells["drafter"] in labels and cells["spec_decode"] == row[
        f"hybridspec {cells['drafter']} decode tok/s"]["median"]
    assert {m["runtime"] for m in payload["memory"]} >= {"hybridspec"}
    assert all(m["load"] > 0 and m["run"] > 0 for m in payload["memory"])
    [written] = payload["writer"]
    assert written["format"] == "q8_0" and written["ours_vs_hf"]["top1"] > 0.5
    if payload["llama_cpp_skipped"]:
        assert payload["quantizer"] == "hybridspec's writer" and "llama_decode" not in payload["table"][0]
    else:
        assert q8["ours_vs_llama"]["max_rel"] < 0.05 and written["greedy_tokens_equal"] == "4/4"

def test_cpu_kernels_quick(benches, tmp_path):
    from hybridspec.kernels.cpu import native as cpu_native
    from hybridspec.kernels.cpu import rows as cpu_rows
    if not cpu_native.available():
        pytest.skip("the few-row kernel cannot run on this machine")
    out = tmp_path / "cpu_kernels.json"
    assert bench_main("cpu_kernels")(["--quick", "--out", str(out)]) == 0
    payload = json.loads(out.read_text())
    rows = {r["rows"]: r for r in payload["products"]}
    assert rows[1]["kernel_us"] > 0 and rows[5]["speedup"] > 0
    assert "kernel_us" not in rows[97]  # past MAX_ROWS only MKL runs
    modes = ["torch", "kernels, modules", "kernels, whole blocks", "kernels, whole forward"]
    assert [(s["model"], s["kernels"]) for s in payload["steps"]] == [(m, k) for m in ("target", "draft") for k in modes]
    assert all(s["step_ms"] > 0 and s["verify_ms"] > 0 for s in payload["steps"])


def test_native_ab_quick(benches, tmp_path):
    """HEAD's kernels against this checkout's in one process: both libraries run
    the forwards (equal logits: the checkout's kernels compute HEAD's chains)."""
    from hybridspec.kernels.cpu import native as cpu_native
    if not cpu_native.available():
        pytest.skip("the native kernels cannot run on this machine")
    if subprocess.run(["git", "-C", str(BENCHES), "rev-parse", "HEAD"], capture_output=True).returncode:
        pytest.skip("not a git checkout")
    out = tmp_path / "native_ab.json"
    library = cpu_native.library()
    assert bench_main("native_ab")(["--quick", "--out", str(out)]) == 0
    assert cpu_native.library() is library  # this checkout's library is back in use
    rows = json.loads(out.read_text())["rows"]
    assert [(r["batch"], r["forward"]) for r in rows] == [(1, "plain"), (1, "verify"), (1, "verify (plain steps)")]
    assert all(r["base_ms"] > 0 and r["new_ms"] > 0 and r["new/base"] > 0 for r in rows)
    assert all(r["same_bits"] for r in rows[:2])


def test_exact_bf16_quick(benches, tmp_path):
    """Both storages of a bf16-valued model: the same logits and tokens, about half the parameters' memory."""
    from hybridspec.kernels.cpu import native as cpu_native
    if not cpu_native.available():
        pytest.skip("the native kernels cannot run on this machine")
    out = tmp_path / "exact_bf16.json"
    assert bench_main("exact_bf16")(["--quick", "--batches", "1", "--repeats", "2", "--out", str(out)]) == 0
    payload = json.loads(out.read_text())
    assert payload["steps"] and all(row["same_bits"] for row in payload["steps"])
    assert payload["generate"] and all(row["same_tokens"] for row in payload["generate"])
    for row in payload["memory"]:
        assert row["float32_mib"] / 2 < row["bfloat16_mib"] < 0.55 * row["float32_mib"]  # the vectors stay float32


def run_on_gpu_path(name: str, out: Path, monkeypatch) -> list[dict]:
    """Run bench `name` --quick, which puts the GPU path on CPU (HYBRIDSPEC_BACKEND=triton, restored
    after), and return its JSON rows."""
    monkeypatch.setenv("HYBRIDSPEC_BACKEND", "auto")
    assert bench_main(name)(["--quick", "--out", str(out)]) == 0
    return json.loads(out.read_text())["rows"]


needs_interpreter = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs TRITON_INTERPRET=1")


@needs_interpreter
def test_cuda_graphs_quick(benches, tmp_path, monkeypatch):
    """Without CUDA: the graphs' static path against eager, interpreted on CPU."""
    rows = run_on_gpu_path("cuda_graphs", tmp_path / "cuda_graphs.json", monkeypatch)
    assert [(r["batch"], r["mode"]) for r in rows] == [(1, "plain"), (1, "speculative"), (1, "decode forward")]
    assert all(r["same_tokens"] and r["graphs_ms"] > 0 for r in rows)
    assert all(r["graph_replays"] > 0 for r in rows[:2])


@needs_interpreter
def test_gpu_launches_quick(benches, tmp_path, monkeypatch):
    """The GPU path's operation count per forward, on CPU (interpreted): the same for a decode step and a
    verify forward (no per-input or per-row loop on that path)."""
    rows = run_on_gpu_path("gpu_launches", tmp_path / "gpu_launches.json", monkeypatch)
    assert [r["forward"] for r in rows] == ["decode step", "verify, 5 inputs"]
    assert all(r["triton_launches"] > 0 and r["ops"] > r["triton_launches"] for r in rows)
    assert rows[0]["launches"] == rows[1]["launches"]


def test_targets_quick(benches, tmp_path, monkeypatch):
    """Every bench the targets table reads runs and its JSON still has what the
    table takes: a figure and a verdict in every row. The benches run in this
    process from the command lines `run_bench` makes (each bench's own quick test runs
    it too; a process each would only add interpreter and torch start-ups)."""
    bench_main("targets")
    targets = sys.modules["targets"]
    commands = []

    def in_process(command, check, cwd):
        commands.append(command)
        assert check and Path(cwd) == BENCHES and command[0] == sys.executable
        assert bench_main(Path(command[1]).stem)(command[2:]) in (0, None)

    monkeypatch.setattr(targets, "subprocess", SimpleNamespace(run=in_process))  # targets' calls only
    out = tmp_path / "targets.json"
    assert targets.main(["--quick", "--out", str(out)]) == 0
    assert [Path(c[1]).name for c in commands] == [f"{run.bench}.py" for run in targets.RUNS]
    payload = json.loads(out.read_text())
    assert set(payload["runs"]) == {run.bench for run in targets.RUNS}
    assert {r["bench"] for r in payload["rows"]} == set(payload["runs"])
    for row in payload["rows"]:
        assert isinstance(row["figure"], float) and row["met"] in (True, False)
    assert (tmp_path / "targets" / "round_cost.json").exists()  # each bench's own JSON kept beside the summary
    growth = [r for r in payload["rows"] if r["target"].startswith("decode growth")]
    assert len(growth) == 2 and all(r["where"].startswith(("32 ->", "64 ->")) for r in growth)


def test_targets_verdicts(benches, monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHES))
    import targets
    assert targets.row("t", "w", 1.31, 1.3, at_most=True)["met"] is False
    assert targets.row("t", "w", 1.3, 1.3, at_most=True)["met"] is True
    assert targets.row("t", "w", 1.49, 1.5, at_most=False)["met"] is False
    assert targets.row("t", "w", None, 1.5, at_most=False)["met"] is None  # no figure (tokens differ): no verdict
    rows = targets.snapshot_rows({"snapshot_overhead": [
        {"batch": 4, "ring_slots": 6, "extra_fraction": 0.01}, {"batch": 4, "ring_slots": 10, "extra_fraction": 0.2}]})
    assert [(r["figure"], r["met"]) for r in rows] == [(0.2, False)]  # the engine's CPU ring, not the smaller one


def test_bench_listing_says_what_each_measures(capsys):
    """`hybridspec bench` lists every bench with the first line of its docstring."""
    from hybridspec.cli.bench import available, summary
    from hybridspec.cli.main import main
    assert main(["bench"]) == 0
    out = capsys.readouterr().out
    names = available()
    assert names and "common" not in names
    for name in names:
        line = summary(name)
        assert line.endswith(".") and len(line) <= 100, (name, line)  # one sentence, one line
        assert any(row.split() and row.split()[0] == name and row.rstrip().endswith(line)
                   for row in out.splitlines()), (name, out)


def test_tensor_parallel_quick(benches, tmp_path):
    """TP = 1 at one and two threads, and both ranks of TP = 2: every rank holds half the KV pages
    and about half the weights and states (embeddings, norms and one group's B and C replicated)."""
    import torch
    out = tmp_path / "tp.json"
    before = torch.get_num_threads()
    assert bench_main("tensor_parallel")(["--quick", "--repeats", "1", "--out", str(out)]) == 0
    assert torch.get_num_threads() == before
    rows = json.loads(out.read_text())["rows"]
    variants = {(r["variant"], r["rank"]) for r in rows}
    assert variants == {("TP=1, 1 thread", 0), ("TP=1, 2 threads", 0), ("TP=2, 1 thread per rank", 0),
                        ("TP=2, 1 thread per rank", 1)}
    assert all(r["ms"] > 0 and r["min_ms"] <= r["ms"] <= r["max_ms"] for r in rows)
    one = next(r for r in rows if r["variant"] == "TP=1, 1 thread")
    for r in rows:
        if r["variant"].startswith("TP=2"):
            assert r["kv_mb"] == one["kv_mb"] / 2
            assert one["states_mb"] / 2 <= r["states_mb"] < 0.6 * one["states_mb"]
            assert one["weights_mb"] / 2 < r["weights_mb"] < one["weights_mb"]  # embeddings and norms replicated


def test_vllm_cpu_quick_without_vllm(benches, tmp_path):
    """Our side of the vLLM CPU comparison on a tiny model, vLLM's skipped with its reason."""
    out = tmp_path / "vllm_cpu.json"
    assert bench_main("vllm_cpu")(["--quick", "--weights", "float32", "--out", str(out)]) == 0
    payload = json.loads(out.read_text())
    assert payload["notes"] == ["float32: vLLM not run (no --vllm-python given)"]
    [row] = payload["rows"]
    assert row["runtime"] == "hybridspec" and row["vs hybridspec"] == 1.0 and row["new tok/s"] > 0
    assert row["tokens equal to hybridspec's"] == "8/8"
    assert row["prefill tok/s"] > 0 and len(row["one-token seconds"]["samples"]) == 1


def test_targets_read_the_llamacpp_table(benches, monkeypatch):
    """The llama.cpp rows: a ratio per part and run, and two threads against one for our decode;
    the run joins the targets only where llama_cpp is importable and LLAMA_CPP_SDIST names its sdist."""
    monkeypatch.syspath_prepend(str(BENCHES))
    import targets
    table = [dict(weights="float32", prompt=128, threads=t, ours_decode=10.0 * t, decode_ratio=1.1, prefill_ratio=0.9,
                  spec_ratio=1.4 + 0.2 * t) for t in (1, 2)]
    rows = targets.llamacpp_rows({"table": table})
    assert [(r["target"].split(",")[0], r["met"]) for r in rows] == [
        ("decode / llama.cpp", True), ("prefill / llama.cpp", False), ("decode / llama.cpp", True),
        ("prefill / llama.cpp", False), ("decode", True), ("speculative / llama.cpp plain decode", True),
        ("speculative / llama.cpp plain decode", True)]
    assert rows[4]["figure"] == 2.0 and rows[5]["figure"] == pytest.approx(1.6)
    table[0]["spec_ratio"] = 1.3
    assert not targets.llamacpp_rows({"table": table})[5]["met"]
    monkeypatch.delenv("LLAMA_CPP_SDIST", raising=False)
    assert targets.llamacpp_run() == ()


def test_targets_read_the_vllm_rows(benches, monkeypatch):
    """The vLLM rows: each of our variants over vLLM's new tokens per second at its weights' precision;
    the run joins the targets only where VLLM_PYTHON is set."""
    monkeypatch.syspath_prepend(str(BENCHES))
    import targets
    payload = {"rows": [dict(weights="float32", runtime="hybridspec", **{"new tok/s": 90.0}),
                        dict(weights="float32", runtime="vLLM CPU", **{"new tok/s": 100.0}),
                        dict(weights="bfloat16", runtime="hybridspec", **{"new tok/s": 90.0}),
                        dict(weights="bfloat16", runtime="hybridspec, compute=bfloat16", **{"new tok/s": 160.0}),
                        dict(weights="bfloat16", runtime="vLLM CPU", **{"new tok/s": 150.0})]}
    rows = targets.vllm_rows(payload)
    assert [(r["where"], round(r["figure"], 3), r["met"]) for r in rows] == [
        ("float32, hybridspec", 0.9, False), ("bfloat16, hybridspec", 0.6, False),
        ("bfloat16, hybridspec, compute=bfloat16", 1.067, True)]
    assert targets.vllm_rows({"rows": payload["rows"][:1]}) == []  # vLLM not run: no rows
    monkeypatch.delenv("VLLM_PYTHON", raising=False)
    assert targets.vllm_run() == ()
    monkeypatch.setenv("VLLM_PYTHON", "/some/python")
    assert targets.vllm_run()[0].args == ("--vllm-python", "/some/python")


def test_suffix_lookup_quick(benches, tmp_path):
    """Both drafters timed at every context, the suffix drafter's trie built once; acceptance rows for both,
    the same tokens from each (greedy: plain decoding's), the second suffix pass drafting from the first's."""
    out = tmp_path / "suffix.json"
    assert bench_main("suffix_lookup")(["--quick", "--out", str(out)]) == 0
    payload = json.loads(out.read_text())
    assert [r["context"] for r in payload["cost"]] == [256, 1024]
    assert all(0 < r["ngram_min_ms"] <= r["ngram_ms"] <= r["ngram_max_ms"] and
               0 < r["suffix_min_ms"] <= r["suffix_ms"] <= r["suffix_max_ms"] and r["suffix_build_ms"] > 0
               for r in payload["cost"])
    rows = {r["drafter"]: r for r in payload["acceptance"]}
    assert list(rows) == ["ngram", "suffix", "suffix (2nd pass, global trie)"]
    assert all(r["same_tokens"] and r["tokens_per_round"] >= 1 for r in rows.values())
    assert rows["suffix (2nd pass, global trie)"]["acceptance"] > rows["suffix"]["acceptance"]


def test_drafters_quick(benches, tmp_path):
    """Plain and two drafters at a fixed γ and auto on one agentic prompt: every variant's tokens are
    plain's, each row's figures are in range, and the agentic prompt repeats the target's own output."""
    out = tmp_path / "drafters.json"
    assert bench_main("drafters")(["--quick", "--out", str(out)]) == 0
    payload = json.loads(out.read_text())
    rows = payload["rows"]
    assert [r["variant"] for r in rows] == ["plain", "ngram, γ=3", "ngram, γ=auto", "suffix, γ=3", "suffix, γ=auto"]
    assert all(r["workload"] == "agentic" and r["batch"] == 1 and r["same_tokens"] for r in rows)
    assert rows[0]["speedup"] == 1.0 and rows[0]["acceptance"] is None and rows[0]["tokens_per_round"] == 1.0
    for r in rows[1:]:
        assert 0.0 <= r["acceptance"] <= 1.0 and r["tokens_per_round"] >= 1.0
        assert r["tokens_per_round"] <= 4.0 or r["gamma"] == "auto"  # γ = 3: at most 3 drafts and a bonus token
        assert r["tok_s_min"] <= r["tok_s"] <= r["tok_s_max"] and r["speedup"] > 0 and r["draft_ms_per_round"] >= 0


def test_drafters_workloads_come_from_held_out_files(benches, monkeypatch):
    """Code and prose prompts are full-length cuts of the files tools/train_embedded.py holds out
    (its own split, imported); prose prompts hold docstring and comment text, not code."""
    monkeypatch.syspath_prepend(str(BENCHES))
    import drafters
    held_text = [f.read_bytes() for f in drafters.heldout_files()]
    for prompt in drafters.workload_prompts("code", 40, None, 8):
        assert len(prompt) == drafters.PROMPT_LEN and any(bytes(prompt) in t for t in held_text)
    prose = [drafters.prose_text(t) for t in held_text]
    for prompt in drafters.workload_prompts("prose", 40, None, 8):
        assert len(prompt) == drafters.PROMPT_LEN and any(bytes(prompt) in p for p in prose)
        assert b"\ndef " not in bytes(prompt)


def test_tree_quick(benches, tmp_path):
    """A chain, a tree of as many verify inputs and the engine's own choice on the embedded pair: the
    same tokens, a summary row, the auto row."""
    out = tmp_path / "tree.json"
    assert bench_main("tree")(["--quick", "--out", str(out)]) == 0
    payload = json.loads(out.read_text())
    assert [r["variant"] for r in payload["rows"]] == ["chain γ=2", "tree 2 γ=2", "auto"]
    assert all(r["same_tokens"] and r["tok_s"] > 0 and r["tokens_per_round"] >= 1 for r in payload["rows"])
    (row,) = payload["summary"]
    assert row["tpr_ratio"] == pytest.approx(payload["rows"][1]["tokens_per_round"] / payload["rows"][0]["tokens_per_round"])
    assert row["auto"] in ("chain γ=2", "tree 2 γ=2") and {t["met"] for t in payload["targets"]} <= {True, False}
    (auto,) = payload["auto"]
    assert 0 <= auto["tree_share"] <= 1 and auto["auto_tok_s"] > 0
