"""``sacplan plan --tp/--dp-shard/--mixed-precision`` (sacplan/cli_mesh.py): usage errors and one 2-D plan."""

from __future__ import annotations

import json

import pytest
import torch.distributed as dist

from sacplan.cli import main


@pytest.mark.parametrize(
    "extra,match",
    [
        (["--tp", "2", "--world-size", "4"], "drop --world-size"),
        (["--dp-shard", "2", "--ddp"], "drop --ddp"),
        (["--tp", "0"], "--tp must be at least 1"),
        (["--mixed-precision", "bf16", "--dtype", "fp32", "--world-size", "2"], "drop --dtype"),
        (["--mixed-precision", "bf16"], "give --dp-shard"),
    ],
)
def test_usage_errors(extra, match, capsys):
    assert main(["plan", "llama-tiny", "-q", "--device", "cpu", *extra]) == 2
    err = capsys.readouterr().err
    assert match in err and "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_non_llama_preset_is_refused(capsys):
    assert main(["plan", "cnn-tiny", "-q", "--tp", "2"]) == 2
    assert "Llama presets only" in capsys.readouterr().err


def test_plan_on_a_2d_mesh_with_mixed_precision(capsys):
    """Per-rank stats of FSDP 2 x TP 2: a plan for world size 4 under a budget between min and no-AC."""
    assert main(["plan", "llama-tiny", "-q", "--device", "cpu", "--tp", "2", "--dp-shard", "2",
                 "--mixed-precision", "bf16", "--budget", "1.15MiB", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["world_size"] == 4 and d["decisions"] and d["predicted_peak_bytes"] <= 1.15 * 2**20
    assert not dist.is_initialized()
    assert main(["plan", "llama-tiny", "-q", "--device", "cpu", "--tp", "2", "--world-size", "2", "--mixed-precision",
                 "bf16"]) == 2


def test_mixed_precision_on_the_simulated_path(capsys):
    """--world-size N --mixed-precision bf16: shard_stats with FSDP2's policy (fp32 master shards)."""
    assert main(["plan", "llama-tiny", "-q", "--device", "cpu", "--world-size", "2", "--mixed-precision", "bf16",
                 "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["world_size"] == 2
