"""``cpshard parity`` (cpshard.parity): the verdicts on models that train the same under CP as
in one process, and the diagnoses of set-ups that do not.

* transformers Llama (through the command, with ``--json`` and its exit code), Qwen3-VL and a
  user's own decoder calling ``cpshard.cp_attention``: exact; the transformers models' loss is
  the chunked ``cp_linear_cross_entropy`` from the final hidden states (as ``CPTrainer``
  computes it), the user's decoder's ``cp_cross_entropy`` of its logits (the reason said);
* a user's decoder whose attention calls plain SDPA, and BLOOM (its own attention code):
  refused, naming the attention module;
* Mamba2 and Bamba (Mamba2 and attention), tiny from their default configs: exact;
* labels shifted per shard: differs, the labelled-token count named;
* a per-rank mean loss: differs, the loss named while the logits and count are exact;
* FSDP2 over the flattened (2, 2) mesh with a loss lacking the CP factor: gradients 1/cp;
* the command as the console script runs it: exit 1 with the diagnosis for the plain-SDPA
  decoder, exit 2 (the option named, nothing run) for arguments that name nothing runnable.

The broken set-ups live in ``tests/helpers.py`` and are loaded as ``module:function``, as a
user's would be. Cases run on the session's rank pools.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from cpshard.parity import BatchSpec, Case, ModelSpec, Setup, run_parity
from tests.helpers import REPO

pytest.importorskip("transformers")

BATCH = BatchSpec(lengths="uniform:2-12", docs=3, rows=2)


def _run(pools, model: str, cases: list[Case], loss: str | None = None):
    return run_parity(Setup(ModelSpec.parse(model), BATCH, loss), cases, pools=pools)


def test_command_exits_0_for_llama_and_writes_json(tmp_path: Path) -> None:
    out = tmp_path / "parity.json"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "cpshard.parity.cli",
            "--model",
            "LlamaForCausalLM",
            "--worlds",
            "2",
            "--layouts",
            "blockdiag,balanced",
            "--json",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
    )
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    assert "2/2 cases exact" in done.stdout, done.stdout
    assert "; loss: cp_linear_cross_entropy\n" in done.stdout, done.stdout
    report = json.loads(out.read_text())
    assert {c["loss_fn"] for c in report["cases"]} == {"cp_linear_cross_entropy"}
    assert report["exact"] and [c["verdict"] for c in report["cases"]] == ["exact", "exact"]
    for case in report["cases"]:
        assert case["count"] == case["ref_count"] > 0 and abs(case["grad_norm_ratio"] - 1) < 1e-9
        assert len(case["cost"]) == 2 and len(case["kv_bytes"]) == 2


def test_exact_models(pools, tmp_path: Path) -> None:
    import transformers

    config = transformers.Qwen3Config(
        vocab_size=40, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, head_dim=8,
        architectures=["Qwen3ForCausalLM"],
    )
    config.save_pretrained(tmp_path)  # a config file: used as it is
    models = ("Qwen3VLForConditionalGeneration", "tests.helpers:cp_aware_decoder", str(tmp_path))
    for model in models:
        report = _run(pools, model, [Case("head_tail", 2), Case("balanced", 2)])
        assert report.exact, [(r.case, r.verdict, r.diagnosis) for r in report.results]
        chunked = model != "tests.helpers:cp_aware_decoder"
        for r in report.results:
            assert r.loss_fn == ("cp_linear_cross_entropy" if chunked else "cp_cross_entropy"), r
            assert (r.loss_reason is None) == chunked, r


def test_plain_sdpa_attention_is_located(pools) -> None:
    """A decoder whose attention calls SDPA itself is refused under CP, naming that module."""
    report = _run(
        pools, "tests.helpers:plain_sdpa_decoder", [Case("blockdiag", 2), Case("stripe", 2)]
    )
    assert not report.exact
    for r in report.results:
        assert r.verdict == "refused", (r.case, r.verdict, r.diagnosis)
        assert "module 'blocks.0.attn'" in r.diagnosis, r.diagnosis
        assert "mixes tokens along the sequence without cpshard" in r.diagnosis, r.diagnosis


def test_the_first_module_that_differs_is_located(pools) -> None:
    report = _run(pools, "tests.helpers:shard_positions_decoder", [Case("blockdiag", 2)])
    (r,) = report.results
    assert r.verdict == "differs" and r.first_layer == "pos", (r.case, r.first_layer, r.diagnosis)
    assert "forward differs first at module 'pos'" in r.diagnosis, r.diagnosis


def test_labels_shifted_per_shard_name_the_count(pools) -> None:
    report = _run(
        pools, "LlamaForCausalLM", [Case("head_tail", 2)], "tests.helpers:labels_shifted_per_shard"
    )
    (r,) = report.results
    assert r.verdict == "differs" and r.count != r.ref_count and r.first_layer is None, r
    assert "labelled-token count" in r.diagnosis, r.diagnosis


def test_per_rank_mean_loss_names_the_loss(pools) -> None:
    report = _run(
        pools, "LlamaForCausalLM", [Case("blockdiag", 2)], "tests.helpers:per_rank_mean_loss"
    )
    (r,) = report.results
    assert r.loss_fn == "tests.helpers:per_rank_mean_loss", r  # the loss given runs
    assert r.verdict == "differs" and r.count == r.ref_count and r.logits_err < 1e-12, r
    assert "a per-rank mean?" in r.diagnosis and "gradients differ" in r.diagnosis, r.diagnosis


def test_fsdp_without_cp_factor_names_the_factor(pools) -> None:
    report = _run(
        pools,
        "LlamaForCausalLM",
        [Case("balanced", 4, dp=2, fsdp="flat")],
        "tests.helpers:loss_without_cp_factor",
    )
    (r,) = report.results
    assert r.verdict == "differs" and abs(r.grad_norm_ratio - 0.5) < 1e-9, r
    assert "(= 1/cp)" in r.diagnosis, r.diagnosis


def test_sliding_window_and_hybrid_models_exact(pools) -> None:
    """Sliding-window families check exact; a hybrid model (Gated DeltaNet) runs under CP and
    checks exact within its own float32 internals (transformers computes its recurrence and
    norms in float32 whatever the model's dtype; at the default tolerance that rounding is what
    it reports)."""
    for model in ("MistralForCausalLM", "Qwen2ForCausalLM"):
        report = _run(pools, model, [Case("stripe", 2), Case("blockdiag", 2)])
        assert report.exact, [(r.case, r.verdict, r.diagnosis) for r in report.results]
    setup = Setup(ModelSpec.parse("Qwen3_5ForCausalLM"), BATCH, None, tol=1e-6)
    report = run_parity(setup, [Case("blockdiag", 2), Case("balanced", 2)], pools=pools)
    assert report.exact, [(r.case, r.verdict, r.diagnosis) for r in report.results]
    report = _run(pools, "Qwen3_5ForCausalLM", [Case("blockdiag", 2)])
    assert not report.exact  # at float64's 1e-9 the float32 internals show, first in a norm
    assert "layernorm" in report.results[0].diagnosis, report.results[0].diagnosis


def test_models_with_their_own_attention_are_refused_naming_the_module(pools) -> None:
    """BLOOM (its own ALiBi attention code, not transformers' attention functions) is refused
    under CP, the diagnosis naming its attention module and class, the rank said once."""
    report = _run(pools, "BloomForCausalLM", [Case("blockdiag", 2), Case("head_tail", 2)])
    assert not report.exact
    for r in report.results:
        assert r.verdict == "refused", (r.case, r.verdict, r.diagnosis)
        said = "module 'transformer.h.0.self_attention' (BloomAttention) cannot run under CP"
        assert said in r.diagnosis, r.diagnosis
        assert r.diagnosis.count("rank 0:") == 2, r.diagnosis  # the case's rank, the error's


def test_mamba2_hybrids_exact(pools) -> None:
    """Mamba2 and a Mamba2-attention hybrid (Bamba), built tiny from their default configs, check
    exact within transformers' float32 internals (its own scan and norms compute in float32
    whatever the model's dtype)."""
    for model in ("Mamba2ForCausalLM", "BambaForCausalLM"):
        setup = Setup(ModelSpec.parse(model), BATCH, None, tol=1e-6)
        report = run_parity(setup, [Case("balanced", 2)], pools=pools)
        assert report.exact, [(r.case, r.verdict, r.diagnosis) for r in report.results]


def test_refusals_and_crashes_are_reported_as_such() -> None:
    """A cpshard error on the ranks is a refusal with its reason, anything else a crash."""
    from cpshard.parity.verdict import judge

    case = Case("stripe", 2)
    said = "cpshard.cp_attention: rank 1: window=4 is shorter than the longest document prefix"
    refused = judge(case, [{"error": said, "error_type": "ValueError"}] * 2, 1e-9)
    assert refused.verdict == "refused" and said in refused.diagnosis, refused
    crashed = judge(case, [{"ok": 1}, {"error": "boom", "error_type": "RuntimeError"}], 1e-9)
    assert crashed.verdict == "crashed" and "rank 1: RuntimeError: boom" in crashed.diagnosis


def test_failures_outside_cpshard_are_crashes(pools) -> None:
    """The ranks' step failing (a loss that does not load) and the model failing in one
    process (the reference)."""
    report = _run(pools, "tests.helpers:cp_aware_decoder", [Case("blockdiag", 2)], "no.such:loss")
    (r,) = report.results
    assert r.verdict == "crashed" and "rank 0: ValueError: loss: cannot load" in r.diagnosis, r
    report = _run(pools, "tests.helpers:REPO", [Case("blockdiag", 2)])
    (r,) = report.results
    assert r.verdict == "crashed" and "the single-process reference raised" in r.diagnosis, r


def test_fsdp_meshes_exact(pools) -> None:
    cases = [Case("balanced", 4, dp=2, fsdp=mode) for mode in ("flat", "hsdp", "dp")]
    report = _run(pools, "LlamaForCausalLM", cases)
    assert report.exact, [(r.case, r.verdict, r.diagnosis) for r in report.results]


# --------------------------------------------------------------------------- the command


def _command(*args: str) -> subprocess.CompletedProcess:
    """``cpshard ARGS`` as the installed console script runs it (its entry point, from this
    checkout's package)."""
    script = "import sys; from cpshard.cli import main; sys.exit(main())"
    return subprocess.run(
        [sys.executable, "-c", script, *args],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
    )


def test_console_script_is_the_entry_point_run_here() -> None:
    assert 'cpshard = "cpshard.cli:main"' in (REPO / "pyproject.toml").read_text()


def test_command_exits_1_naming_the_module_that_mixes_without_cpshard() -> None:
    done = _command(
        "parity", "--model", "tests.helpers:plain_sdpa_decoder", "--worlds", "2",
        "--layouts", "blockdiag",
    )  # fmt: skip
    assert done.returncode == 1, done.stdout + done.stderr[-3000:]
    said = "blockdiag W=2: refused: rank 0: ValueError: cpshard CP attention: rank 0:"
    assert said in done.stdout and "0/1 cases exact" in done.stdout, done.stdout
    assert "its module 'blocks.0.attn' is" in done.stdout, done.stdout


def test_command_exits_2_for_a_bad_argument() -> None:
    done = _command("parity", "--model", "LlamaForCausalLM", "--layouts", "diagonal")
    assert done.returncode == 2, done.stdout + done.stderr[-3000:]
    assert "--layouts: unknown diagonal; choose from blockdiag" in done.stderr, done.stderr
    assert "cases exact" not in done.stdout, done.stdout  # nothing ran


@pytest.mark.parametrize(
    "args, said",
    [
        (["--lengths", "bogus"], "--lengths: expected uniform:LO-HI"),
        (["--rows", "0"], "--rows: must be >= 1, got 0"),
        (["--docs", "x"], "--docs: 'x' is not an integer"),
        (["--tol", "-1"], "--tol: must be finite and >= 0"),
        (["--tol", "nan"], "--tol: must be finite and >= 0"),
        (["--worlds", "0"], "--worlds: world sizes must be >= 1"),
        (["--mesh", "2by2"], "--mesh: expected DPxCP"),
        (["--fsdp", "zero"], "--fsdp: unknown zero"),
        (["--model", "NoSuchModelForCausalLM"], "--model: 'NoSuchModelForCausalLM' is not a"),
        (["--model", "tests.helpers:no_such_factory"], "--model: cannot load"),
        (["--loss", "no_such_module:loss"], "--loss: cannot load"),
        (["--batch", "tests.helpers:no_such_collator"], "--batch: cannot load"),
    ],
)
def test_bad_arguments_exit_2_before_any_case_runs(args: list[str], said: str, capsys) -> None:
    """Arguments that name nothing runnable are refused as arguments (exit 2, the option
    named), not run as cases that crash or 'differ' (a negative tolerance would call every
    case different and blame a module)."""
    from cpshard.cli import main

    argv = ["parity", "--model", "LlamaForCausalLM", *args]
    try:
        status = main(argv)
    except SystemExit as exc:  # argparse's own exit for an option it cannot parse
        status = exc.code
    err = capsys.readouterr().err
    assert status == 2 and said in err, (status, err)


def test_setup_refuses_a_tolerance_that_is_not_finite_and_non_negative() -> None:
    for tol in (-1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="tol: must be finite and >= 0"):
            Setup(ModelSpec.parse("LlamaForCausalLM"), BATCH, None, tol)
