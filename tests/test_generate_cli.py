"""`hybridspec generate`: the embedded default, the --draft / --policy / --verify /
--tokenizer options, the JSON report and the errors (a few tokens each)."""
from __future__ import annotations

import io
import json
import string
import subprocess
import sys

import pytest
import torch

import hybridspec as hs
from hybridspec.cli.main import main
from hybridspec.adapters.embedded import embedded_paths
from hybridspec.errors import ConfigError, UsageError
from hybridspec.cli.generate import (DEFAULT_PROMPT, GENERATED_MARK, SUMMARY_WIDTH, check_length, parse_policy,
                                     wrap_phrases)


def save_bamba(path, vocab=256, hidden=32, layers=2, seed=0):
    from transformers import BambaConfig, BambaForCausalLM
    config = BambaConfig(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers, attn_layer_indices=[1],
                         intermediate_size=2 * hidden, num_attention_heads=2, num_key_value_heads=2,
                         mamba_n_heads=2, mamba_d_state=8, mamba_n_groups=1, mamba_chunk_size=16,
                         max_position_embeddings=512,
                         pad_token_id=0, bos_token_id=None, eos_token_id=None)
    torch.manual_seed(seed)
    BambaForCausalLM(config).save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("pair")
    return save_bamba(root / "target", hidden=48, layers=3, seed=0), save_bamba(root / "draft", seed=1)


def run_json(capsys, argv):
    assert main(["generate", *argv, "--json"]) == 0
    captured = capsys.readouterr()
    return json.loads(captured.out), captured.err


def test_embedded_default_runs(capsys):
    target_dir, draft_dir = embedded_paths()
    assert hs.load(target_dir).vocab_size == 256 and hs.load(draft_dir).vocab_size == 256
    assert main(["generate", "-n", "6"]) == 0
    out, err = capsys.readouterr()
    assert out.startswith(DEFAULT_PROMPT)
    assert "acceptance rate" in err and "tokens per round" in err and "speedup" in err
    assert "same tokens as plain: yes" in err


def test_json_report_with_model_draft(capsys, pair):
    target, draft = pair
    report, err = run_json(capsys, ["def f(x):", "--model", target, "--draft", draft, "-n", "9", "--gamma", "3"])
    assert report["schema"] == "hybridspec.generate/v1"
    assert report["prompt"] == "def f(x):" and report["prompt_tokens"] == len(b"def f(x):")
    assert len(report["token_ids"]) == 9 and report["finish_reason"] == "length"
    assert report["text"] == bytes(report["token_ids"]).decode("utf-8", errors="replace")
    spec, plain = report["speculative"], report["plain"]
    assert spec["new_tokens"] == plain["new_tokens"] == 9
    assert spec["stats"]["drafted_tokens"] > 0 and spec["stats"]["rounds"] >= 3  # at most gamma + 1 per round
    assert report["speedup"] == pytest.approx(spec["tokens_per_s"] / plain["tokens_per_s"])
    assert report["same_as_plain"] is True  # greedy speculative == greedy plain
    assert plain["stats"]["drafted_tokens"] == 0
    assert spec["runs"] == plain["runs"] == 3 and len(spec["tokens_per_s_runs"]) == 3
    low, high = report["speedup_range"]
    assert low <= high and "interleaved" in report["speedup_method"]
    assert err == ""  # stderr is not a terminal: no progress bars


def test_a_layer_skip_draft_from_the_command_line(capsys, pair):
    target, _ = pair
    report, _ = run_json(capsys, ["def f(x):", "--model", target, "--draft", "layers:1", "-n", "8", "--gamma", "3"])
    assert report["draft"] == "layers:1 (layer-skip draft)" and report["same_as_plain"] is True
    assert report["speculative"]["stats"]["drafted_tokens"] > 0
    assert main(["generate", "x", "--model", target, "--draft", "layers:0", "-n", "2"]) == 2


def test_ngram_and_plain_only(capsys, pair):
    target, _ = pair
    prompt = string.printable
    report, _ = run_json(capsys, [prompt, "--model", target, "--draft", "ngram", "-n", "16"])
    assert report["draft"].startswith("ngram") and report["same_as_plain"] is True
    # A round drafts iff its pending token occurred earlier. The last round drafts nothing (one token left),
    # and a run without drafts starts a round at every token: so some draft <=> some token 0..n-3 repeats.
    context, tokens = list(prompt.encode()), report["token_ids"]
    repeats = any(t in context + tokens[:i] for i, t in enumerate(tokens[:-2]))
    assert (report["speculative"]["stats"]["drafted_tokens"] > 0) == repeats
    report, _ = run_json(capsys, ["ab", "--model", target, "--draft", "none", "-n", "5"])
    assert report["speculative"] is None and report["speedup"] is None and len(report["token_ids"]) == 5
    report, _ = run_json(capsys, ["ab", "--model", target, "--draft", "none", "-n", "2", "--threads", "1"])
    assert report["threads"] == 1
    assert main(["generate", "ab", "--model", target, "--draft", "none", "-n", "3"]) == 0
    assert "plain decoding:" in capsys.readouterr().err


def test_tree_drafts_give_plain_output(capsys, pair):
    target, draft = pair
    report, _ = run_json(capsys, ["def f(x):", "--model", target, "--draft", draft, "-n", "9", "--tree", "2"])
    assert report["same_as_plain"] is True and report["plain"]["stats"]["drafted_tokens"] == 0
    assert report["speculative"]["stats"]["drafted_tokens"] > 0
    # 'auto' needs an adaptive γ: refused before generating
    assert main(["generate", "x", "--model", target, "--draft", draft, "-n", "2", "--tree", "auto", "--gamma", "3"]) == 2
    assert "pass num_draft_tokens='auto'" in capsys.readouterr().err


def test_coupled_sampling_matches_plain_and_repeats(capsys, pair):
    target, draft = pair
    argv = ["x = ", "--model", target, "--draft", draft, "-n", "8", "--temperature", "0.9", "--top-p", "0.95",
            "--top-k", "50", "--seed", "7", "--verify", "coupled", "--policy", "k2"]
    first, _ = run_json(capsys, argv)
    second, _ = run_json(capsys, argv)
    assert first["same_as_plain"] is True
    assert first["token_ids"] == second["token_ids"] and first["sampling"]["seed"] == 7


def test_sampling_draws_a_seed_and_so_repeats_plain_decoding(capsys, pair):
    """Without --seed a sampled run draws one (printed); a seeded request is verified coupled under the
    default --verify rejection, so the speculative tokens are plain decoding's."""
    target, draft = pair
    report, _ = run_json(capsys, ["x", "--model", target, "--draft", draft, "-n", "4", "--temperature", "1.0"])
    assert isinstance(report["sampling"]["seed"], int) and report["same_as_plain"] is True


def test_policy_strings():
    assert parse_policy("k1") == hs.CheckpointPolicy(snapshot_every=1)
    assert parse_policy("K0") == hs.CheckpointPolicy(snapshot_every=0)
    assert parse_policy("auto") == "auto"
    assert parse_policy("snapshot_every=2,ring_slots=4,log_inputs=0") == \
        hs.CheckpointPolicy(snapshot_every=2, ring_slots=4, log_inputs=False)
    assert parse_policy("ring_slots=none,log_inputs=1") == hs.CheckpointPolicy(ring_slots=None, log_inputs=True)
    for bad in ("k", "kx", "every=2", "snapshot_every=two", "log_inputs=2", "ring_slots=1", ""):
        with pytest.raises(ConfigError):
            parse_policy(bad)


def test_policy_is_used(capsys, pair):
    target, draft = pair
    report, _ = run_json(capsys, ["abc", "--model", target, "--draft", draft, "-n", "8", "--gamma", "4",
                                  "--policy", "snapshot_every=0,log_inputs=1"])
    stats = report["speculative"]["stats"]
    assert report["same_as_plain"] is True
    # k=0 keeps two slots per sequence; with almost nothing accepted, partial rounds are log-replayed
    assert stats["log_replayed_tokens"] + stats["snapshot_hits"] > 0


def test_tokenizer_option(capsys, tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    words = ["[UNK]", "</s>", "def", "return", "x", "y", "(", ")", ":", "+", "1"]
    backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]", eos_token="</s>").save_pretrained(
        tmp_path / "tok")
    target = save_bamba(tmp_path / "model", vocab=len(words))
    report, _ = run_json(capsys, ["def x : return x + 1", "--model", target, "--tokenizer", str(tmp_path / "tok"),
                                  "-n", "6"])
    assert report["prompt_tokens"] == 7 and report["draft"].startswith("ngram")
    assert report["tokenizer"] == str(tmp_path / "tok")
    tokens = report["token_ids"]
    assert len(tokens) == 6 or tokens[-1] == 1  # length, or stopped at the tokenizer's EOS
    assert report["finish_reason"] == ("stop" if 1 in tokens else "length")


def test_errors(capsys, pair, tmp_path):
    target, _ = pair
    assert main(["generate", "x", "--model", str(tmp_path / "missing"), "-n", "2"]) == 2
    assert "config.json" in capsys.readouterr().err
    wide = save_bamba(tmp_path / "wide", vocab=300)
    assert main(["generate", "x", "--model", wide, "-n", "2"]) == 2
    assert "--tokenizer" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # read with the arguments, before any model loads
        main(["generate", "x", "--model", target, "--gamma", "0", "-n", "2"])
    assert "--gamma: '0' is not a positive integer" in capsys.readouterr().err
    assert main(["generate", "x", "--model", target, "--policy", "sometimes", "-n", "2"]) == 2
    assert "--policy" in capsys.readouterr().err
    assert main(["generate", "x", "--model", target, "--top-p", "0", "-n", "2"]) == 2
    assert "--top-p 0.0 must be in (0, 1]" in capsys.readouterr().err
    assert main(["generate", "x", "--model", target, "--threads", "0", "-n", "2"]) == 2
    assert "--threads" in capsys.readouterr().err


def test_version():
    child = subprocess.run([sys.executable, "-m", "hybridspec.cli.main", "--version"], capture_output=True, text=True,
                           timeout=60)
    assert child.returncode == 0 and child.stdout.strip() == f"hybridspec {hs.__version__}" and child.stderr == ""


def test_prompt_from_stdin_and_stop_string(capsys, monkeypatch, pair):
    target, draft = pair
    monkeypatch.setattr(sys, "stdin", io.StringIO("def g(y):\n"))
    report, _ = run_json(capsys, ["-", "--model", target, "--draft", draft, "--max-tokens", "12", "--repeats", "1"])
    assert report["prompt"] == "def g(y):\n" and report["prompt_tokens"] == 10
    stop = report["text"][3:5]
    monkeypatch.setattr(sys, "stdin", io.StringIO("def g(y):\n"))
    cut, _ = run_json(capsys, ["-", "--model", target, "--draft", draft, "--max-tokens", "12", "--stop", stop,
                               "--repeats", "1"])
    assert cut["text"] == report["text"][:report["text"].index(stop)] and cut["stop_reason"] == stop
    assert cut["finish_reason"] == "stop" and cut["same_as_plain"] is True


def test_no_baseline_skips_the_plain_runs(capsys, pair):
    target, draft = pair
    assert main(["generate", "ab", "--model", target, "--draft", draft, "-n", "6", "--no-baseline"]) == 0
    out, err = capsys.readouterr()
    assert out.startswith("ab") and "plain decoding: skipped (--no-baseline), no speedup measured" in err
    assert "x (" not in err
    report, _ = run_json(capsys, ["ab", "--model", target, "--draft", draft, "-n", "6", "--no-baseline"])
    assert report["plain"] is None and report["speedup"] is None and report["speculative"]["runs"] == 1


def test_bars_only_on_a_terminal_and_never_with_json(capsys, monkeypatch, pair):
    target, draft = pair
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    argv = ["ab", "--model", target, "--draft", draft, "-n", "6", "--repeats", "2"]
    assert main(["generate", *argv]) == 0
    out, err = capsys.readouterr()
    assert "speculative run 1/2" in err and "plain run 2/2" in err
    assert err.rindex("run 2/2") < err.index("acceptance rate")  # statistics come after the bars
    assert out.startswith("ab")
    report, err = run_json(capsys, argv)
    assert err == "" and report["speculative"]["runs"] == 2


def test_bars_on_a_terminal_even_when_stdout_is_one_too(capsys, monkeypatch, pair):
    """Bars follow stderr alone; the run whose text streams to the terminal has none."""
    target, draft = pair
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    monkeypatch.setattr(sys.stdout, "isatty", lambda: True)
    assert main(["generate", "ab", "--model", target, "--draft", draft, "-n", "6", "--repeats", "2"]) == 0
    out, err = capsys.readouterr()
    assert out.startswith("ab")  # streamed
    assert "plain run 1/2" in err and "speculative run 2/2" in err and "plain run 2/2" in err
    assert "speculative run 1/2" not in err  # the streamed run


def test_statistics_lines_break_between_phrases(capsys, pair):
    target, draft = pair
    assert main(["generate", "ab", "--model", target, "--draft", draft, "-n", "6", "--repeats", "2"]) == 0
    lines = capsys.readouterr().err.splitlines()
    assert lines[0].startswith("---") and any(line.startswith("speedup ") for line in lines)
    assert all(len(line) <= SUMMARY_WIDTH for line in lines), lines
    assert "same tokens as plain: yes" in lines


def test_wrap_phrases_breaks_only_after_a_comma_or_semicolon():
    line = "; ".join(f"phrase {i}, with words" for i in range(20))
    parts = wrap_phrases(line, width=60)
    assert len(parts) > 1 and all(len(part) <= 60 for part in parts)
    assert all(part.rstrip().endswith((",", ";")) for part in parts[:-1])
    assert " ".join(part.strip() for part in parts) == line
    assert wrap_phrases("x" * 150) == ["x" * 150]  # one phrase longer than the width stays whole


def test_count_flags_are_checked(capsys, pair):
    target, _ = pair
    assert main(["generate", "x", "--model", target, "--repeats", "0"]) == 2
    assert "--repeats=0 must be >= 1" in capsys.readouterr().err
    assert main(["generate", "x", "--model", target, "--threads", "0"]) == 2
    assert "--threads=0 must be >= 1" in capsys.readouterr().err


def test_bf16_weights_run_in_float32_by_default_on_cpu(capsys, tmp_path):
    """On a CPU the model computes in float32 unless --dtype says otherwise (a bf16
    stored linear weights stay bfloat16 in memory, test_exact_16bit)."""
    from transformers import BambaForCausalLM
    path = save_bamba(tmp_path / "bf16")
    BambaForCausalLM.from_pretrained(path).to(torch.bfloat16).save_pretrained(path)
    report, _ = run_json(capsys, ["ab", "--model", path, "--draft", "none", "-n", "3"])
    assert report["dtype"] == "float32"
    report, _ = run_json(capsys, ["ab", "--model", path, "--draft", "none", "-n", "3", "--dtype", "bfloat16"])
    assert report["dtype"] == "bfloat16"


def test_the_generated_text_follows_a_marker_line(capsys, pair):
    target, draft = pair
    argv = ["ab", "--model", target, "--draft", draft, "-n", "6", "--repeats", "1"]
    report, _ = run_json(capsys, argv)
    assert main(["generate", *argv]) == 0
    assert capsys.readouterr().out == f"ab\n{GENERATED_MARK}\n{report['text']}\n"
    assert main(["generate", "ab\n", *argv[1:]]) == 0  # a prompt that ends its line gets no second newline
    assert capsys.readouterr().out.startswith(f"ab\n{GENERATED_MARK}\n")


class FlushLog(io.StringIO):
    """A stdout that is no terminal and remembers what had been flushed at each flush."""

    def __init__(self):
        super().__init__()
        self.flushed = []

    def flush(self):
        self.flushed.append(self.getvalue())


def test_text_reaches_a_file_as_it_is_made(monkeypatch, pair):
    """Redirected stdout gets the text in pieces while the first run decodes, all
    of it before the next run starts (an interrupted command leaves what it made)."""
    import hybridspec.cli.generate as generate
    target, draft = pair
    out, seen = FlushLog(), []
    real = generate.timed_generate
    monkeypatch.setattr(generate, "timed_generate", lambda *a, **k: seen.append(out.getvalue()) or real(*a, **k))
    monkeypatch.setattr(sys, "stdout", out)
    assert main(["generate", "ab", "--model", target, "--draft", draft, "-n", "12", "--gamma", "1",
                 "--repeats", "1"]) == 0
    head = f"ab\n{GENERATED_MARK}\n"
    assert out.flushed[0] == head and out.flushed[-1] == out.getvalue()
    pieces = [f for f in out.flushed if head < f < out.getvalue()]
    assert len(pieces) >= 2, out.flushed  # γ=1: at most two tokens a round, streamed round by round
    assert seen[-1] == out.getvalue()  # the plain run started after the streamed text was all written


def test_a_prompt_too_long_names_the_request(capsys, pair):
    target, _ = pair  # max_position_embeddings=512
    assert main(["generate", "x" * 500, "--model", target, "-n", "20"]) == 2
    err = capsys.readouterr().err
    assert "the prompt is 500 tokens and -n/--max-new-tokens asks for 20 more" in err
    assert "context limit of 512 tokens" in err and "pass -n 12 or less" in err and "max_new_tokens=4" not in err


@pytest.mark.parametrize("prompt,new,fixes", [
    (500, 20, ["pass -n 12 or less", "shorten the prompt to at most 492 tokens"]),
    (600, 20, ["shorten the prompt to at most 492 tokens"]),
    (600, 600, ["shorten the prompt and pass -n below 512"]),
])
def test_check_length_gives_the_fixes_that_exist(prompt, new, fixes):
    check_length(512 - new, new, 512)  # fits exactly
    with pytest.raises(UsageError) as error:
        check_length(prompt, new, 512)
    assert str(error.value).endswith("; " + " or ".join(fixes))
