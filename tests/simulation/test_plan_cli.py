"""``cpshard plan`` end to end and its argument errors."""

from __future__ import annotations

import json

import pytest

from cpshard.cli import main


def test_plan_writes_every_figure(tmp_path, capsys) -> None:
    path = tmp_path / "plan.json"
    argv = ["plan", "--world", "8", "--seq-len", "2k", "--docs", "pareto:16", "--heads", "8",
            "--kv-heads", "2", "--head-dim", "16", "--layers", "4", "--json", str(path)]  # fmt: skip
    assert main(argv) == 0
    out = capsys.readouterr()
    assert "shard() planning: median" in out.out and "[8/8]" in out.err
    data = json.loads(path.read_text())
    assert data["setup"]["world"] == 8 and data["setup"]["seq_len"] == 2048
    assert [r["rank"] for r in data["ranks"]] == list(range(8))
    fields = {
        "tokens", "cost_over_mean", "rows_received", "rows_sent", "key_rows",
        "key_buffer_bytes", "strategy_bytes", "busiest_bytes", "strategy", "plan_ms",
    }  # fmt: skip
    assert all(fields <= set(r) for r in data["ranks"])
    assert sum(r["tokens"] for r in data["ranks"]) == 2048
    busiest = data["summary"]["busiest_bytes"]
    assert max(r["strategy_bytes"]["needed_rows"] for r in data["ranks"]) == busiest["needed_rows"]
    assert data["summary"]["strategy"] == min(busiest, key=busiest.__getitem__)


def test_plan_on_a_mesh_and_sampled_ranks(tmp_path) -> None:
    path = tmp_path / "plan.json"
    argv = ["plan", "--mesh", "2x4", "--seq-len", "512", "--docs", "one", "--heads", "8",
            "--head-dim", "8", "--strategy", "hierarchical", "--ranks", "0,7", "--json",
            str(path)]  # fmt: skip
    assert main(argv) == 0
    data = json.loads(path.read_text())
    assert [r["rank"] for r in data["ranks"]] == [0, 7]
    assert set(data["summary"]["busiest_bytes"]) == {"needed_rows", "hierarchical"}


@pytest.mark.parametrize(
    "args, message",
    [
        (["--world", "2000"], "--world"),
        (["--world", "4", "--seq-len", "1x"], "--seq-len"),
        (["--world", "4", "--mesh", "2x3"], "--world"),
        (["--world", "4", "--strategy", "hierarchical"], "--strategy"),
        (["--world", "4", "--docs", "pareto:0"], "--docs"),
        (["--world", "4", "--ranks", "4"], "--ranks"),
        (["--world", "4"], "--heads and --head-dim"),
        (["--world", "4", "--model", "NoSuchModelAnywhere"], "--model"),
        (["--world", "4", "--heads", "6", "--kv-heads", "4", "--head-dim", "8"], "--kv-heads"),
        (["--world", "4", "--heads", "4", "--head-dim", "8", "--json", "/no/such/dir/x.json"],
         "--json"),
        (["--seq-len", "64", "--heads", "4", "--head-dim", "8"], "--world"),
    ],
)  # fmt: skip
def test_plan_argument_errors_name_the_option(capsys, args: list[str], message: str) -> None:
    if "--seq-len" not in args:
        args = [*args, "--seq-len", "64"]
    with pytest.raises(SystemExit) as exc:
        main(["plan", *args])
    assert exc.value.code == 2
    assert message in capsys.readouterr().err
