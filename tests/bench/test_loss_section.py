"""The ``loss`` section of ``cpshard bench``: a quick run on two spawned ranks (JSON and the
rendered block): both losses measured side by side, agreeing, the chunked one holding less."""

from __future__ import annotations


def test_quick_run_reports_the_loss_section(run_bench):
    proc, data = run_bench(*"--world 2 --ops loss --quick --repeats 2".split())
    assert "# loss: one rank's cross entropy" in proc.stdout
    r = data["loss"]
    assert (r["tokens"], r["vocab"], r["hidden"], r["dtype"]) == (256, 8192, 128, "float32")
    assert r["chunk_tokens"] == 256  # the default budget holds the quick case's logits at once
    for name in ("cp_cross_entropy", "cp_linear_cross_entropy"):
        assert r[f"{name}_fwd_bwd_s"] > 0 and len(r[f"{name}_fwd_bwd_repeats_s"]) == 2
    # the materialised loss holds the logits, their log-softmax and their gradient at least
    assert r["cp_cross_entropy_peak_bytes"] >= 2 * r["logits_bytes"]
    assert r["peak_ratio"] == r["cp_cross_entropy_peak_bytes"] / r["cp_linear_cross_entropy_peak_bytes"]
    assert r["peak_ratio"] > 1
