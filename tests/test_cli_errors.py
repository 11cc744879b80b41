"""Command-line errors: every user error exits with status 2 and one line on
stderr naming the bad value; Ctrl-C exits 130 and a closed stdout 141, both
quietly; an internal error keeps its traceback."""
from __future__ import annotations

import subprocess
import sys

import pytest
import torch

import hybridspec.cli.simulate
from hybridspec.cli.main import main
from oracles import bamba


def error_line(capsys, argv) -> str:
    assert main(argv) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in captured.err, captured.err
    return lines[0]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("model")
    bamba(seed=0, vocab=256, dtype=torch.float32).save_pretrained(path)
    return str(path)


def test_bad_model_paths(capsys, model_dir, tmp_path):
    line = error_line(capsys, ["generate", "x", "--model", str(tmp_path / "nope"), "-n", "2"])
    assert line.startswith("hybridspec generate: error: --model ") and "is not a directory" in line
    line = error_line(capsys, ["generate", "x", "--model", model_dir, "--draft", str(tmp_path), "-n", "2"])
    assert "--draft" in line and "config.json not found" in line and "--draft ngram" in line
    line = error_line(capsys, ["check", "--quick", "--model", str(tmp_path / "nope")])
    assert line.startswith("hybridspec check: error: --model ")


def test_bad_tokenizer_directories(capsys, model_dir, tmp_path):
    line = error_line(capsys, ["generate", "x", "--model", model_dir, "--tokenizer", "/nope", "-n", "2"])
    assert "--tokenizer /nope: no such directory" in line
    line = error_line(capsys, ["generate", "x", "--model", model_dir, "--tokenizer", str(tmp_path), "-n", "2"])
    assert "holds none of tokenizer.json" in line
    (tmp_path / "tokenizer.json").write_text("{broken")
    line = error_line(capsys, ["generate", "x", "--model", model_dir, "--tokenizer", str(tmp_path), "-n", "2"])
    assert "transformers cannot load a tokenizer" in line


@pytest.mark.parametrize("argv,line", [
    (["generate", "--temperature", "abc"], "hybridspec generate: error: --temperature: 'abc' is not a number"),
    (["generate", "-n", "many"], "hybridspec generate: error: -n/--max-new-tokens/--max-tokens: 'many' is not an "
                                 "integer"),
    (["generate", "--gamma", "x"], "hybridspec generate: error: --gamma: 'x' is not a positive integer or 'auto'"),
    (["generate", "--tree", "2,x"], "hybridspec generate: error: --tree: '2,x' is not a list of widths >= 1 like "
                                    "2,1 (invalid literal for int() with base 10: 'x')"),
    (["simulate", "--rounds", "1e3"], "hybridspec simulate: error: --rounds: '1e3' is not an integer"),
    (["check", "--threads", "two"], "hybridspec check: error: --threads: 'two' is not an integer"),
])
def test_argument_type_errors_are_one_line(capsys, argv, line):
    """argparse's own errors print the whole usage first; ours are the one line every user error is."""
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    captured = capsys.readouterr()
    assert captured.err == line + "\n" and captured.out == ""


@pytest.mark.parametrize("argv,words", [
    (["generate", "--verify", "sometimes"], ["hybridspec generate: error: --verify: invalid choice"]),
    (["generate", "--bogus"], ["unrecognized arguments: --bogus", "--help"]),
    ([], ["hybridspec: error:", "required", "--help"]),
    (["simulate", "--rounds"], ["hybridspec simulate: error: --rounds: expected one argument"]),
])
def test_other_argument_errors_are_one_line(capsys, argv, words):
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and "usage:" not in err and all(word in err for word in words), err


def test_a_bench_argument_error_is_one_line():
    child = subprocess.run([sys.executable, "-m", "hybridspec", "bench", "plain_decode", "--batches", "abc"],
                           capture_output=True, text=True, timeout=120)
    assert child.returncode == 2 and child.stdout == ""
    assert child.stderr == "plain_decode.py: error: --batches: 'abc' is not an integer\n"


def test_the_console_script_exits_2_with_one_line():
    child = subprocess.run([sys.executable, "-m", "hybridspec.cli.main", "generate", "--temperature", "abc"],
                           capture_output=True, text=True, timeout=120)
    assert child.returncode == 2 and child.stdout == ""
    assert child.stderr == "hybridspec generate: error: --temperature: 'abc' is not a number\n"


@pytest.mark.parametrize("flag", ["--json", "--plot"])
def test_outputs_into_a_missing_folder_fail_before_any_work(capsys, tmp_path, flag):
    line = error_line(capsys, ["simulate", "--rounds", "200", flag, str(tmp_path / "missing" / "out")])
    assert f"{flag} {tmp_path / 'missing' / 'out'}: the folder" in line and "does not exist" in line
    assert capsys.readouterr().out == ""


def test_output_path_that_is_a_folder(capsys, tmp_path):
    assert "is a folder" in error_line(capsys, ["simulate", "--rounds", "200", "--json", str(tmp_path)])


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_device_the_build_lacks(capsys):
    line = error_line(capsys, ["check", "--quick", "--device", "cuda"])
    assert "--device cuda:" in line and "--device cpu" in line
    assert "not a torch device" in error_line(capsys, ["check", "--quick", "--device", "gpu0"])


def test_cuda_graphs_on_a_cpu_device(capsys, monkeypatch):
    monkeypatch.delenv("HYBRIDSPEC_BACKEND", raising=False)
    line = error_line(capsys, ["generate", "--cuda-graphs", "--draft", "none", "-n", "2", "hello"])
    assert "cuda_graphs=True needs the Triton kernels" in line and "on cpu" in line


@pytest.mark.parametrize("raised,status", [(KeyboardInterrupt, 130), (BrokenPipeError, 141)])
def test_interrupt_and_closed_pipe(capsys, monkeypatch, raised, status):
    def stop(args):
        raise raised()

    monkeypatch.setattr(hybridspec.cli.simulate, "run", stop)
    assert main(["simulate"]) == status
    err = capsys.readouterr().err
    assert err == ("hybridspec simulate: interrupted\n" if raised is KeyboardInterrupt else "")


def test_internal_errors_keep_their_traceback(monkeypatch):
    def broken(args):
        raise RuntimeError("a bug")

    monkeypatch.setattr(hybridspec.cli.simulate, "run", broken)
    with pytest.raises(RuntimeError, match="a bug"):
        main(["simulate"])


def test_closed_stdout_ends_quietly():
    """`hybridspec simulate --json - | true`: the reader is gone before the report is written."""
    child = subprocess.Popen([sys.executable, "-m", "hybridspec.cli.main", "simulate", "--rounds", "200", "--json", "-"],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    child.stdout.close()
    err = child.stderr.read().decode()
    assert child.wait(timeout=120) == 141 and err == "", err


@pytest.mark.parametrize("argv,line", [
    (["--top-p", "1.5"], "--top-p 1.5 must be in (0, 1]; use 1.0 to turn it off"),
    (["--temperature", "-1"], "--temperature -1.0 must be finite and >= 0 (0 is greedy)"),
    (["--top-k", "-3"], "--top-k -3 must be an integer >= 0; use 0 to turn it off"),
    (["-n", "0"], "-n/--max-new-tokens 0 must be an integer >= 1"),
    (["-n", "-5"], "-n/--max-new-tokens -5 must be an integer >= 1"),
    (["--max-tokens", "-5"], "-n/--max-new-tokens -5 must be an integer >= 1"),
    (["--min-p", "2"], "--min-p 2.0 must be in [0, 1]; use 0.0 to turn it off"),
    (["--stop", "ok", "--stop", ""], "--stop needs a non-empty string; give each --stop its text, or leave it out"),
    (["--seed", "-2"], "--seed -2 must be an integer >= 0 and below 2^63; leave it out for a random seed"),
    (["--seed", str(2**63)], f"--seed {2**63} must be an integer >= 0 and below 2^63; leave it out for a random seed"),
    (["--policy", "sometimes"], "--policy 'sometimes': cannot read 'sometimes'; checkpoint policy:"),
    (["--policy", "ring_slots=1"], "--policy 'ring_slots=1': ring_slots=1 must be an integer >= 2 (the head and the "
                                   "final snapshot) or none to size the ring from the policy"),
])
def test_sampling_and_policy_flags_are_checked_before_the_model_loads(capsys, monkeypatch, argv, line):
    """SamplingParams' and the checkpoint policy's own checks, their errors naming the flag the user typed in its
    own terms, not the Python field."""
    import hybridspec.cli.generate as generate

    def load(*args):
        raise AssertionError("the model loaded before the arguments were checked")

    monkeypatch.setattr(generate, "build_llm", load)
    assert error_line(capsys, ["generate", "x", *argv]).startswith(f"hybridspec generate: error: {line}")


def test_help_lists_every_command():
    from hybridspec.cli.main import SUBCOMMANDS
    child = subprocess.run([sys.executable, "-m", "hybridspec", "--help"], capture_output=True, text=True, timeout=60)
    assert child.returncode == 0
    description = child.stdout.split("\n\n")[1]
    assert all(name in description for name in SUBCOMMANDS) and "serve" in SUBCOMMANDS, child.stdout
    assert "[serve] extra" in " ".join(child.stdout.split())


def test_a_missing_optional_dependency_names_its_extra():
    """A lean install (no transformers) running a benchmark that needs it: one line, the extra, no traceback."""
    code = ("import sys; sys.modules['transformers'] = None; from hybridspec.cli.main import main; "
            "sys.exit(main(['bench', 'plain_decode', '--quick']))")
    child = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert child.returncode == 2 and "Traceback" not in child.stderr, child.stderr
    assert child.stderr.startswith("hybridspec bench: error: transformers is not installed; it comes with the "
                                   "[hf] extra: pip install -e \".[hf]\"") and len(child.stderr.splitlines()) == 1


def test_serve_without_its_extra(capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "fastapi", None)
    line = error_line(capsys, ["serve"])
    assert line.startswith("hybridspec serve: error: fastapi is not installed") and "[serve]" in line


def test_a_missing_module_that_is_no_extra_keeps_its_traceback(monkeypatch):
    def broken(args):
        import hybridspec_no_such_module  # noqa: F401

    monkeypatch.setattr(hybridspec.cli.simulate, "run", broken)
    with pytest.raises(ModuleNotFoundError):
        main(["simulate"])


def test_bench_without_the_source_checkout(capsys, monkeypatch, tmp_path):
    import hybridspec.cli.bench as bench
    monkeypatch.setattr(bench, "BENCHES_DIR", tmp_path / "benches")
    for argv in (["bench"], ["bench", "plain_decode"]):
        line = error_line(capsys, argv)
        assert "source checkout's benches/ folder" in line and str(tmp_path / "benches") in line
