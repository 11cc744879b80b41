"""Tensor parallel (`hybridspec.tp`) on CPU: 2 gloo ranks spawned per test.
Every family's sharded float64 logits equal one process's and both ranks see
the same bits; speculative output under TP equals plain output under TP for
every checkpoint policy, fixed and adaptive γ, greedy and coupled; prefix
cache and preemption keep each request's tokens; every shard's state equals a
prefill of the committed tokens after every step; the rollback suite passes.
A model that cannot be split says which field and why, before anything runs."""
import pytest
import torch

import hybridspec as hs
from hybridspec.errors import ConfigError
from hybridspec.tp import shard_weights
from oracles import bamba
from tp_ranks import FAMILIES, run_ranks


def test_every_family_sharded_over_two_ranks_gives_one_process_logits():
    ranks = run_ranks("family_logits")
    for name in FAMILIES:
        mine, other = ranks[0][name], ranks[1][name]
        assert torch.equal(mine["sharded"], other["sharded"]), name  # every rank the same bits
        torch.testing.assert_close(mine["sharded"], mine["single"], rtol=0, atol=1e-12, msg=name)
        assert torch.equal(mine["hidden_sharded"], other["hidden_sharded"]), name
        torch.testing.assert_close(mine["hidden_sharded"], mine["hidden_single"], rtol=0, atol=1e-12, msg=name)
        assert mine["tokens"][0] == mine["tokens"][1], name


def test_speculative_decoding_under_tensor_parallel_is_exact():
    ranks = run_ranks("speculative", timeout=600)
    for rank in ranks:
        assert all(same for same, _ in rank["runs"].values()), {k: v for k, v in rank["runs"].items() if not v[0]}
        assert all(drafted > 0 for _, drafted in rank["runs"].values())
        assert rank["tight"] and rank["preemptions"] > 0 and rank["prefix_hits"] > 0
        assert rank["problems"] == []
    assert ranks[0]["runs"] == ranks[1]["runs"]


def test_speculative_decoding_of_a_sharded_gated_deltanet_hybrid_is_exact():
    ranks = run_ranks("gdn_speculative", timeout=600)
    for rank in ranks:
        assert all(same for same, _ in rank["runs"].values()), {k: v for k, v in rank["runs"].items() if not v[0]}
        assert all(drafted > 0 for _, drafted in rank["runs"].values())
        assert rank["problems"] == []
    assert ranks[0]["runs"] == ranks[1]["runs"]


def test_a_sharded_load_reads_only_its_slices(tmp_path):
    """hs.load(path, tensor_parallel_size=2): each rank maps the safetensors file and
    copies its slices out, reading well under the file (every tensor copied reads
    all of it; a column-parallel tensor's rows of 8 KB still touch every page, so
    a rank reads about two thirds here); its logits equal one process's."""
    bamba(seed=0, num_layers=2, hidden=512, kv_heads=2).save_pretrained(tmp_path)
    for rank in run_ranks("mapped_load", path=str(tmp_path)):
        assert rank["whole"] > 0.95 * rank["size"], rank
        assert rank["sliced"] < 0.75 * rank["size"], rank
        torch.testing.assert_close(rank["sharded"], rank["single"], rtol=0, atol=1e-12)


def test_a_corrupt_file_fails_a_mapped_read_as_a_whole_one(tmp_path):
    from hybridspec.adapters.model_files import read_weights
    from hybridspec.errors import ModelFilesError
    bamba(seed=0).save_pretrained(tmp_path)
    file = tmp_path / "model.safetensors"
    file.write_bytes(file.read_bytes()[:-100])
    for mapped in (False, True):
        with pytest.raises(ModelFilesError, match="model.safetensors is not a readable safetensors file"):
            read_weights(tmp_path, "cpu", mapped=mapped)


def test_the_rollback_suite_passes_under_tensor_parallel():
    for rank in run_ranks("rollback_suite", timeout=600):
        assert [r for r in rank if not r[1]] == []


def test_vocab_parallel_tables_split_the_rows_and_pad_a_vocabulary_the_ranks_do_not_divide():
    from hybridspec.adapters import bamba as adapter
    config = adapter.config_from_dict(bamba(seed=0).config.to_dict())
    table = torch.arange(97 * 3, dtype=torch.float64).view(97, 3)
    shards = [shard_weights(config, {"embed_tokens.weight": table, "lm_head.weight": -table}, rank, 2)[1]
              for rank in range(2)]
    for name, sign in (("embed_tokens.weight", 1), ("lm_head.weight", -1)):
        first, second = (shard[name] for shard in shards)
        assert first.shape == second.shape == (49, 3)
        assert torch.equal(torch.cat([first, second[:48]]), sign * table)
        assert not second[48].any()  # the padding row: logits the gather drops, an id no lookup reaches


def test_sizes_that_do_not_divide_are_refused_naming_the_field():
    from hybridspec.adapters import bamba as adapter
    hf = bamba(seed=0)
    config = adapter.config_from_dict(hf.config.to_dict())
    weights = {}
    with pytest.raises(ConfigError, match="attention num_kv_heads=2 is not divisible by tensor_parallel_size=4"):
        shard_weights(config, weights, 0, 4)
    with pytest.raises(ConfigError, match="tensor_parallel_size=2 needs a torch.distributed process group"):
        hs.from_hf(hf, tensor_parallel_size=2)
    with pytest.raises(ConfigError, match="tensor_parallel_size=2 but the target is not sharded"):
        hs.Engine(hs.from_hf(hf), tensor_parallel_size=2)


def test_a_server_under_tensor_parallel_answers_with_the_offline_text():
    prompts = ["def add(a, b):", "import os\n", "class Stack:"]
    (texts, offline, idle), follower_idle = run_ranks("served", timeout=300, prompts=prompts)
    assert texts == offline
    assert idle and follower_idle  # the client that left mid-stream was aborted on every rank, its pages back


def test_torchrun_launches_generate_over_two_ranks(tmp_path):
    """`torchrun --nproc-per-node 2 -m hybridspec generate --tensor-parallel-size 2`:
    rank 0 prints the text one process prints; without torchrun the flag says how."""
    import json
    import subprocess
    import sys
    from pathlib import Path
    args = ["generate", "def add(a, b):", "-n", "12", "--no-baseline", "--json"]
    torchrun = Path(sys.executable).with_name("torchrun")
    command = [str(torchrun), "--standalone", "--nproc-per-node", "2", "-m", "hybridspec", *args,
               "--tensor-parallel-size", "2"]
    launched = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert launched.returncode == 0, launched.stderr[-2000:]
    single = subprocess.run([sys.executable, "-m", "hybridspec", *args], capture_output=True, text=True, timeout=300)
    assert single.returncode == 0, single.stderr[-2000:]
    assert json.loads(launched.stdout)["text"] == json.loads(single.stdout)["text"], (launched.stdout, single.stdout)
    alone = subprocess.run([sys.executable, "-m", "hybridspec", *args, "--tensor-parallel-size", "2"],
                           capture_output=True, text=True, timeout=300)
    assert alone.returncode == 2 and "torchrun --nproc-per-node 2 -m hybridspec" in alone.stderr


def test_a_step_that_raises_on_one_rank_fails_and_reverts_on_every_rank():
    first, second = run_ranks("one_rank_fault")
    for place in first:
        assert (first[place]["raised"], second[place]["raised"]) == ("PeerRankError", "RuntimeError"), place
        for rank in (first, second):
            assert rank[place]["unchanged"] and rank[place]["tokens"], (place, rank[place])
