"""`cpshard bench`: a tiny end-to-end run (spawned ranks, JSON output) and the argument checks."""

from __future__ import annotations

import importlib.util
import json

import pytest

from cpshard.bench.cases import halo_windows, ragged_counts
from cpshard.bench.cli import parse_config
from cpshard.bench.config import DEFAULT_OPS, FULL_OPS, BenchConfig
from cpshard.cli import main


def test_tiny_run_writes_json_and_plot(run_bench, tmp_path):
    png = tmp_path / "figures.png"
    proc, data = run_bench(
        *"--world 2 --ops ragged,halo --sizes 64 --repeats 2 --warmup 1 --iters 2".split(),
        "--hidden",
        "256",
        "--plot",
        str(png),
        timeout=180,
    )
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"  # matplotlib comes with the test environment
    assert "[2/2]" in proc.stderr  # the progress line
    assert "# ragged:" in proc.stdout and "# halo:" in proc.stdout and "speedup" in proc.stdout
    assert data["machine"]["world"] == 2 and data["machine"]["backend"] == "gloo"
    assert data["config"]["sizes"] == [64]
    rows = {r["op"]: r for r in data["results"]}
    assert set(rows) == {"ragged", "halo"}
    for row in rows.values():
        assert row["tokens"] == 64 and row["world"] == 2
        for who in ("ours", "base"):
            for mode in ("fwd_bwd", "fwd"):
                assert row[f"{who}_{mode}_s"] > 0
                assert len(row[f"{who}_{mode}_repeats_s"]) == 2
                assert row[f"{who}_{mode}_peak_bytes"] > 0
        assert row["floor_fwd_s"] > 0 and row["floor_bwd_s"] > 0
        assert row["fwd_bwd_speedup"] > 0 and row["ours_fwd_bwd_algbw_GBps"] > 0
    assert rows["ragged"]["counts"] == ragged_counts(64, 2)
    assert rows["halo"]["halo"] == 32
    assert data["strategies"] == []


def test_blockdiag_section_quick_run(run_bench):
    """W=3: the S=2L case runs on a 2-rank subgroup while rank 2 waits, then all 3 ranks."""
    proc, data = run_bench(
        *"--world 3 --ops blockdiag --quick --repeats 2 --warmup 0 --iters 1".split()
    )
    assert "[2/2]" in proc.stderr and "# blockdiag:" in proc.stdout
    rows = data["blockdiag"]
    assert [(r["world"], r["seq_len"]) for r in rows] == [(2, 256), (3, 768)]
    for r in rows:
        assert r["ours_fwd_bwd_s"] > 0 and r["base_fwd_bwd_s"] > 0 and r["speedup"] > 0
        assert r["ours_fwd_bwd_peak_bytes"] > 0 and r["base_fwd_bwd_peak_bytes"] > 0
        assert (r["heads"], r["kv_heads"], r["head_dim"]) == (8, 2, 64)


@pytest.mark.parametrize(
    "args",
    [
        ["--world", "1"],
        ["--world", "two"],
        ["--ops", "ragged,bogus"],
        ["--ops", ""],
        ["--sizes", "0"],
        ["--sizes", "12,x"],
        ["--repeats", "0"],
        ["--warmup", "-1"],
        ["--hidden", "0"],
        ["--dtype", "int8"],
        ["--backend", "mpi"],
        ["--timeout", "0"],
        ["--json", "/no/such/folder/out.json"],
        ["--unknown-flag"],
    ],
)
def test_parser_rejects_bad_values(args, capsys):
    with pytest.raises(SystemExit) as info:
        parse_config(args)
    assert info.value.code == 2
    assert "error" in capsys.readouterr().err


def test_parser_accepts_and_normalises():
    cfg = parse_config(
        ["--world", "3", "--ops", "halo,ragged,halo", "--sizes", "1k,64", "--iters", "3"]
    )
    assert (
        cfg.world == 3
        and cfg.ops == ("halo", "ragged")
        and cfg.sizes == (1024, 64)
        and cfg.iters == 3
    )
    assert parse_config([]).ops == BenchConfig().ops == DEFAULT_OPS and not parse_config([]).full
    full = parse_config(["--full"])
    assert full.full and full.ops == parse_config(["--ops", "all"]).ops == FULL_OPS
    assert set(DEFAULT_OPS) < set(FULL_OPS) and "planning" not in FULL_OPS
    assert parse_config(["--full", "--ops", "attention"]).ops == ("attention",)


def test_plot_without_matplotlib_is_a_clear_error(tmp_path, capsys, monkeypatch):
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "matplotlib" else find_spec(name, *a)
    )
    with pytest.raises(SystemExit) as info:
        parse_config(["--plot", str(tmp_path / "a.png")])
    assert info.value.code == 2
    assert "matplotlib" in capsys.readouterr().err


def test_console_entry_needs_a_command(capsys):
    assert main([]) == 2
    assert "bench" in capsys.readouterr().err
    with pytest.raises(SystemExit) as info:
        main(["bench", "--help"])
    assert info.value.code == 0


def test_config_validates_directly():
    with pytest.raises(ValueError, match="world"):
        BenchConfig(world=1)
    with pytest.raises(ValueError, match="sizes"):
        BenchConfig(sizes=())


@pytest.mark.parametrize("world", [2, 3, 4, 5, 8])
@pytest.mark.parametrize("mean", [1, 7, 64, 1000])
def test_ragged_counts(world, mean):
    counts = ragged_counts(mean, world)
    assert len(counts) == world and sum(counts) == mean * world and min(counts) >= 0
    if mean >= 64:
        assert 1.5 <= max(counts) / mean <= 1.7


def test_halo_windows():
    assert halo_windows(3, 4, 2) == [(0, 0), (2, 4), (6, 8)]
    assert halo_windows(3, 4, 6) == [(0, 0), (0, 4), (2, 8)]


def test_kernels_command_runs_and_writes_json(tmp_path, capsys):
    """`cpshard kernels`: the single-process kernel benchmark, one tiny pass on the CPU."""
    out = tmp_path / "kernels.json"
    argv = "kernels --size-mib 1 --repeats 1 --warmup 0 --threads 1 --dtypes float32".split()
    assert main([*argv, "--json", str(out)]) == 0
    cases = {r["case"] for r in json.loads(out.read_text())["rows"]}
    assert {"copy_ (baseline)", "pack_ragged padded dim1", "unpack_ragged exact  dim0"} <= cases
    assert "document_segments full" in cases and "pack_ragged" in capsys.readouterr().out


def test_single_process_commands_have_their_own_help(capsys):
    for command in ("kernels", "nccl-world1"):
        with pytest.raises(SystemExit) as info:
            main([command, "--help"])
        assert info.value.code == 0
        assert f"usage: cpshard {command}" in capsys.readouterr().out
