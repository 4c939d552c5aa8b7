"""The ``mixers`` section of ``cpshard bench``: a quick run on two spawned ranks (JSON and the
rendered block)."""

from __future__ import annotations


def test_quick_run_reports_the_mixers_section(run_bench):
    proc, data = run_bench(*"--world 2 --ops mixers --quick --repeats 2 --warmup 0 --iters 1".split())
    assert "# mixers:" in proc.stdout
    r = data["mixers"]
    assert (r["world"], r["seq_len"], r["kernel"]) == (2, 512, 4)
    for who in ("ours", "base"):
        assert r[f"{who}_fwd_bwd_s"] > 0 and len(r[f"{who}_fwd_bwd_repeats_s"]) == 2
    # the conv receives kernel - 1 rows per run at most; the carry far less than the inputs
    assert 0 < r["ours_conv_bytes_received"] < r["base_bytes_received"]
    assert 0 < r["ours_carry_bytes_received"] < r["base_bytes_received"]
    assert r["sequential_estimate_s"] == 2 * r["recurrence_alone_s"] > 0
    assert "# mixers: Mamba's selective scan" in proc.stdout
    scan = r["selective_scan"]
    assert scan["ours_fwd_bwd_s"] > 0 and scan["base_fwd_bwd_s"] > 0
    assert 0 < scan["ours_carry_bytes_received"] < scan["base_bytes_received"]
    assert "# mixers: MiniMax's lightning attention" in proc.stdout
    lightning = r["lightning"]
    assert lightning["ours_fwd_bwd_s"] > 0 and lightning["base_fwd_bwd_s"] > 0
    assert 0 < lightning["ours_carry_bytes_received"] < lightning["base_bytes_received"]
