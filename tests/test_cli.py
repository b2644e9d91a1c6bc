"""The ``remat`` command, run in-process through ``main(argv)``."""

from __future__ import annotations

import importlib
import itertools
import json
import subprocess
import sys
import time
import warnings
from functools import partial

import pytest
import torch
from torch.nn import functional as F

from remat import cli
from remat.automatic import Checkpointable
from remat.models import CATALOGUE, ModelSpec, mlp_chain
from remat.plan.profile import ChainProfile

TINY = "tiny"
WIDTH = 16
BATCH = 8


def _features(batch_size: int, device: torch.device) -> tuple[torch.Tensor, ...]:
    return (torch.randn(batch_size, WIDTH, device=device),)


def _noise_like(inputs: tuple[torch.Tensor, ...]) -> torch.Tensor:
    return torch.randn_like(inputs[0])


TINY_SPEC = ModelSpec(
    name=TINY,
    description="six MLP blocks of width 16 (test model)",
    factory=partial(mlp_chain, depth=6, width=WIDTH),
    make_input=_features,
    make_target=_noise_like,
    loss_fn=F.mse_loss,
)


@pytest.fixture
def tiny_catalogue(monkeypatch: pytest.MonkeyPatch) -> str:
    """Adds a tiny model to the catalogue, for fast commands."""
    monkeypatch.setitem(CATALOGUE, TINY, TINY_SPEC)
    return TINY


@pytest.fixture
def steady_clock(monkeypatch: pytest.MonkeyPatch) -> None:
    """Makes ``time.perf_counter`` advance 1 ms per call: measured times are repeatable."""
    ticks = itertools.count()
    monkeypatch.setattr(time, "perf_counter", lambda: next(ticks) * 1e-3)


@pytest.fixture(autouse=True)
def _no_terminal_width(monkeypatch: pytest.MonkeyPatch) -> None:
    """The tables at the width of a captured stream, whatever COLUMNS the environment has (xdist sets 80)."""
    monkeypatch.delenv("COLUMNS", raising=False)


def run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    code = cli.main(argv)
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def assert_one_error_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("remat: error: ")
    assert "Traceback" not in err
    return lines[0]


# ---------------------------------------------------------------------- explain
@pytest.mark.parametrize("model", ["gpt2", "resnet_small"])
def test_explain_prints_the_dump_for_a_zoo_model(model: str, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(["explain", model, "--batch", "2"], capsys)
    assert code == cli.EXIT_OK
    assert "every stage recomputed under remat.policies.save_matmuls" in out
    rows = {line.split()[0]: line.split() for line in out.splitlines() if line.strip()}
    matmul = "addmm" if model == "gpt2" else "convolution"
    assert rows[matmul][2] == "0"  # run again in backward: never, its output is kept
    assert int(rows[matmul][3]) > 0  # handed to the recomputes instead


def test_explain_json_with_a_policy_and_every_operation(
    tiny_catalogue: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, _ = run(["explain", tiny_catalogue, "--policy", "recompute:gelu", "--json"], capsys)
    assert code == cli.EXIT_OK
    document = json.loads(out)
    again = [op["op"] for op in document["ops"] if op["phase"] == "recompute" and op["status"] == "recomputed"]
    assert again and {name for name in again if not name.startswith(("aten.t.", "aten.view", "aten.detach"))} == {
        "aten.gelu.default"
    }
    assert document["totals"]["kept_bytes"] > 0


def test_explain_of_a_looping_model_shows_one_step_not_the_first_call(capsys: pytest.CaptureFixture[str]) -> None:
    # the model's first call finds its chain (and, with a budget, measures): not in the step explained
    code, out, _ = run(["explain", "cli_factories:blocks_with_input", "--json"], capsys)
    assert code == cli.EXIT_OK
    ops = json.loads(out)["ops"]
    products = [op for op in ops if op["phase"] == "forward" and op["op"].startswith("aten.addmm")]
    assert len(products) == 6  # one per block


def test_budgets_as_bytes_and_percentages(tiny_catalogue: str, capsys: pytest.CaptureFixture[str]) -> None:
    documents = []
    for budget in ("0.5", "50%"):
        code, out, _ = run(["plan", tiny_catalogue, "--batch", str(BATCH), "--budget", budget, "--json"], capsys)
        assert code == cli.EXIT_OK
        documents.append(json.loads(out))
    assert documents[0]["budget_bytes"] == documents[1]["budget_bytes"]
    in_bytes = str(documents[0]["budget_bytes"])
    code, out, _ = run(["plan", tiny_catalogue, "--batch", str(BATCH), "--budget", in_bytes, "--json"], capsys)
    assert code == cli.EXIT_OK and json.loads(out)["budget_bytes"] == int(in_bytes)


def test_hugging_face_settings_take_lists_and_quoted_commas() -> None:
    from remat.cli.loading import _settings

    assert _settings("depths=[1,1,1,1],hidden_sizes=[8,16],hidden_act='a,b',n=2") == [
        "depths=[1,1,1,1]",
        "hidden_sizes=[8,16]",
        "hidden_act='a,b'",
        "n=2",
    ]


def test_explain_of_the_plan_for_a_budget(tiny_catalogue: str, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(["explain", tiny_catalogue, "--budget", "min", "--ops"], capsys)
    assert code == cli.EXIT_OK
    assert "the plan for a budget of min" in out
    assert "recompute " in out  # the --ops listing has recomputed operations


# ---------------------------------------------------------------------- models
def test_models_lists_every_catalogue_name(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(["models"], capsys)
    assert code == cli.EXIT_OK
    for name in CATALOGUE:
        assert name in out
    assert "11.2M" in out  # resnet18's parameters, counted without allocating them


def test_help_and_version_return_zero(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(["--help"], capsys)
    assert code == 0
    assert "exit codes:" in out and "bench" in out
    code, out, _ = run(["--version"], capsys)
    assert code == 0
    assert out.startswith("remat ")


# ---------------------------------------------------------------------- plan
def test_plan_json_agrees_with_the_library(
    tiny_catalogue: str, steady_clock: None, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, _ = run(["plan", tiny_catalogue, "--batch", str(BATCH), "--budget", "0.5", "--json"], capsys)
    assert code == cli.EXIT_OK
    document = json.loads(out)

    # the library's own plan of the same model and batch
    model = TINY_SPEC.factory()
    torch.manual_seed(1)
    inputs, target = TINY_SPEC.make_batch(BATCH)
    # (the command's step drops the output once the loss is computed, as remat bench's does)
    wrapper = Checkpointable(model, 0.5, loss_fn=lambda output: F.mse_loss(output, target), output_kept=False)
    wrapper.measure(*inputs)
    planned = wrapper.compute_sequence()

    assert document["budget_bytes"] == planned.budget_bytes
    assert document["predicted_peak_bytes"] == planned.predicted_peak_bytes
    assert document["forward_counts"] == list(planned.forward_counts)
    assert document["kept_stages"] == [i for i, count in enumerate(planned.forward_counts) if count == 1]
    assert document["predicted_overhead"] == pytest.approx(planned.overhead)
    assert max(document["forward_counts"]) > 1, "a budget of 0.5 must make something recompute"

    # and the document agrees with itself
    profile = ChainProfile.from_dict(document["profile"])
    stages = document["schedule"]["stages"]
    assert [stage["name"] for stage in stages] == list(profile.names)
    assert [stage["forward_runs"] for stage in stages] == document["forward_counts"]
    assert [stage["index"] for stage in stages if stage["kept"]] == document["kept_stages"]
    assert (
        document["schedule"]["predicted_peak_bytes"] + document["measured"]["fixed_bytes"]
        == (document["predicted_peak_bytes"])
    )
    assert document["predicted_peak_bytes"] <= document["budget_bytes"] < document["no_recompute_peak_bytes"]


def test_plan_prints_the_stage_table(tiny_catalogue: str, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(["plan", tiny_catalogue, "--budget", "0.5"], capsys)
    assert code == cli.EXIT_OK
    for text in ("stage", "runs", "recomputed", "kept", "budget:", "predicted peak:", "predicted overhead:"):
        assert text in out


def test_plan_of_a_factory_with_a_sample_input(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(["plan", "cli_factories:tiny_mlp_with_input", "--json"], capsys)
    assert code == cli.EXIT_OK
    document = json.loads(out)
    assert document["input_shapes"] == [[8, WIDTH]]
    assert document["loss"] == "the output's own loss, else its sum"


def test_plan_of_any_module(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(["plan", "cli_factories:blocks_with_input", "--budget", "0.5", "--json"], capsys)
    assert code == cli.EXIT_OK
    document = json.loads(out)
    assert document["predicted_peak_bytes"] <= document["budget_bytes"]
    assert max(document["forward_counts"]) > 1


def test_plan_of_a_factory_with_an_input_shape(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(
        ["plan", "cli_factories:tiny_mlp", "--input-shape", str(WIDTH), "--batch", "4", "--json"], capsys
    )
    assert code == cli.EXIT_OK
    assert json.loads(out)["input_shapes"] == [[4, WIDTH]]


def test_plan_of_a_hugging_face_architecture_from_its_config(capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("transformers")
    argv = ["plan", "--hf", "gpt2", "--hf-config", "n_layer=3,n_embd=32", "--budget", "0.6", "--json"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the use_cache note
        code, out, _ = run(argv, capsys)
    assert code == cli.EXIT_OK
    document = json.loads(out)
    assert document["model"] == "hf:gpt2" and document["loss"] == "the model's own loss (from labels)"
    names = document["profile"]["names"]
    assert [n for n in names if "transformer.h." in n] == [f"transformer.h.{i}" for i in range(3)]
    assert document["predicted_peak_bytes"] <= document["budget_bytes"]


def test_plan_with_policies_sizes_their_store_options(tiny_catalogue: str, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["plan", tiny_catalogue, "--batch", str(BATCH), "--budget", "0.5", "--json"]
    code, out, _ = run([*argv, "--policy", "save_matmuls", "--policy", "save_nothing"], capsys)
    assert code == cli.EXIT_OK
    document = json.loads(out)
    profile = ChainProfile.from_dict(document["profile"])
    assert [option.name for option in profile.store_options] == ["save_matmuls", "save_nothing"]
    assert document["predicted_peak_bytes"] <= document["budget_bytes"]
    code, _, err = run([*argv, "--policy", "save:nonsense_op"], capsys)
    assert code != cli.EXIT_OK and "nonsense_op" in err


def test_plan_and_bench_with_elementwise_saves(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("transformers")
    model = ["--hf", "gpt2", "--hf-config", "n_layer=2,n_embd=32"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the use_cache note
        documents = []
        for extra in ([], ["--elementwise"]):
            code, out, _ = run(["plan", *model, "--budget", "1.0", "--json", *extra], capsys)
            assert code == cli.EXIT_OK
            documents.append(json.loads(out))
        json_path = tmp_path / "bench.json"
        argv = ["bench", *model, "--budgets", "0.5", "--steps", "1", "--elementwise", "--json", str(json_path)]
        code, out, _ = run(argv, capsys)
    # each block leaves its GELU's factors and product, and its dropout's output, to backward
    plain, elementwise = (document["profile"]["saved_bytes"] for document in documents)
    assert sum(elementwise) < sum(plain)
    assert documents[1]["profile"]["metadata"]["elementwise"] is True
    assert code == cli.EXIT_OK and "remat @ 0.5" in out
    assert json.loads(json_path.read_text())["metadata"]["elementwise"] is True
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        code, _, err = run(["plan", *model, "--elementwise", "--policy", "save_matmuls"], capsys)
    assert code == cli.EXIT_USAGE and "--elementwise with --policy" in err


def test_plan_nested_splits_the_blocks_into_their_submodules(capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("transformers")
    argv = ["plan", "--hf", "gpt2", "--hf-config", "n_layer=2,n_embd=32", "--budget", "0.4", "--json", "--nested"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the use_cache note
        code, out, _ = run(argv, capsys)
    assert code == cli.EXIT_OK
    document = json.loads(out)
    names = document["profile"]["names"]
    # the blocks' own submodules are the stages: attention and MLP apart
    assert any(n.startswith("transformer.h.0.attn.") for n in names)
    assert any(n.startswith("transformer.h.1.mlp.") for n in names)
    assert "transformer.h.0" not in names
    assert document["predicted_peak_bytes"] <= document["budget_bytes"]
    assert max(document["forward_counts"]) > 1


def test_an_unknown_hugging_face_architecture_lists_them(capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("transformers")
    code, _, err = run(["plan", "--hf", "lama"], capsys)
    assert code == cli.EXIT_UNKNOWN_MODEL
    assert "llama" in assert_one_error_line(err)


def test_infeasible_budget_exits_2_with_the_minimum(tiny_catalogue: str, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run(["plan", tiny_catalogue, "--budget", "1kB"], capsys)
    assert code == cli.EXIT_BUDGET_TOO_SMALL == 2
    line = assert_one_error_line(err)
    assert "minimum feasible budget is" in line and "bytes" in line and "MiB" in line


# ---------------------------------------------------------------------- errors
def test_unknown_model_lists_the_catalogue(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run(["plan", "resnet9000"], capsys)
    assert code == cli.EXIT_UNKNOWN_MODEL
    line = assert_one_error_line(err)
    assert "resnet9000" in line and "resnet_small" in line and "gpt2" in line


@pytest.mark.parametrize(
    "command", [["plan", TINY, "--budget", "12 parsecs"], ["bench", TINY, "--budgets", "0.5,lots"]]
)
def test_unreadable_budget_lists_the_accepted_forms(
    command: list[str], tiny_catalogue: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code, _, err = run(command, capsys)
    assert code == cli.EXIT_BAD_BUDGET
    line = assert_one_error_line(err)
    assert "512MiB" in line and "fraction" in line


@pytest.mark.parametrize(
    ("model", "expected"),
    [
        ("no_such_module_for_remat:factory", "cannot import"),
        ("cli_factories:missing", "no attribute"),
        ("cli_factories:NOT_CALLABLE", "not a function"),
        ("cli_factories:not_a_module", "must return an nn.Module"),
        ("cli_factories:raises", "ValueError: boom"),
    ],
)
def test_bad_factories(model: str, expected: str, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run(["plan", model, "--input-shape", str(WIDTH)], capsys)
    assert code == cli.EXIT_BAD_MODEL
    assert expected in assert_one_error_line(err)


def test_model_failing_on_its_input(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run(["plan", "cli_factories:tiny_mlp", "--input-shape", "3,5"], capsys)
    assert code == cli.EXIT_BAD_MODEL
    assert "failed on its input" in assert_one_error_line(err)


@pytest.mark.parametrize("factory", ["cuda_out_of_memory", "cpu_out_of_memory", "python_out_of_memory"])
def test_out_of_memory(factory: str, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run(["bench", f"cli_factories:{factory}", "--input-shape", "4"], capsys)
    assert code == cli.EXIT_OUT_OF_MEMORY
    assert "out of memory" in assert_one_error_line(err)


@pytest.mark.parametrize(
    "argv",
    [
        ["plan", "cli_factories:tiny_mlp"],  # no sample input and no --input-shape
        ["plan", "cli_factories:tiny_mlp", "--input-shape", "3,-2"],
        ["plan", TINY, "--input-shape", "16"],
        ["plan", "cli_factories:tiny_mlp_with_input", "--batch", "4"],
        ["bench", TINY, "--steps", "0"],
        ["frobnicate"],
        [],
        ["plan"],  # neither a MODEL nor --hf
        ["plan", TINY, "--hf", "llama"],  # both
        ["plan", "--hf-config", "num_hidden_layers=2"],  # settings without --hf
        ["plan", "--hf", "llama", "--hf-config", "num_layerz=2"],  # no such setting
        ["plan", "--hf", "llama", "--hf-config", "num_hidden_layers"],  # not KEY=VALUE
        ["plan", "--hf", "gpt2", "--hf-config", "n_layer=abc"],  # a value the config refuses
        ["explain", TINY, "--threads", "0"],
        ["plan", "--hf", "llama", "--batch", "4"],
        ["explain", TINY, "--policy", "keep_some"],
        ["explain", TINY, "--policy", "recompute:no_such_op"],
        ["explain", TINY, "--policy", "save_all", "--budget", "0.5"],
    ],
)
def test_usage_errors(argv: list[str], tiny_catalogue: str, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run(argv, capsys)
    assert code == cli.EXIT_USAGE
    assert_one_error_line(err)


def test_exit_codes_are_distinct() -> None:
    codes = [value for name, value in vars(cli).items() if name.startswith("EXIT_") and name != "EXIT_OK"]
    assert len(codes) == len(set(codes))
    for name, value in vars(cli).items():
        if name.startswith("EXIT_"):
            assert f"{value}  " in cli.__doc__ or f"{value} " in cli.__doc__


def documented_exit_codes(doc: str) -> dict[int, str]:
    """The rows of the exit-code table in a docstring: code -> meaning."""
    lines = doc[doc.index("Exit codes:") :].splitlines()
    rules = [index for index, line in enumerate(lines) if line.startswith("===")]
    assert len(rules) >= 2, "the exit-code table has no top and bottom rule"
    rows: dict[int, str] = {}
    for line in lines[rules[0] + 1 : rules[1]]:
        code, _, meaning = line.partition(" ")
        assert code.isdigit() and meaning.strip(), f"not a table row: {line!r}"
        assert int(code) not in rows, f"exit code {code} documented twice"
        rows[int(code)] = meaning.strip()
    return rows


def test_the_documented_exit_codes_are_exactly_the_constants() -> None:
    constants = {value: name for name, value in vars(cli).items() if name.startswith("EXIT_")}
    documented = documented_exit_codes(cli.__doc__ or "")
    assert set(documented) == set(constants)
    from remat.cli.codes import EXIT_CODES

    assert documented == {entry.code: entry.meaning for entry in EXIT_CODES}
    assert {entry.name for entry in EXIT_CODES} == set(constants.values())
    epilog = cli.main.__globals__["_EPILOG"]
    for code, meaning in documented.items():
        assert f"  {code} " in epilog and meaning.replace("``", "") in " ".join(epilog.split())


# ---------------------------------------------------------------------- optional dependencies
def test_missing_rich_prints_the_install_hint(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(sys.modules, "rich", None)
    monkeypatch.setitem(sys.modules, "rich.console", None)
    code, _, err = run(["models"], capsys)
    assert code == cli.EXIT_MISSING_DEPENDENCY == 1
    assert "pip install 'remat[cli]'" in assert_one_error_line(err)


def test_missing_matplotlib_prints_the_install_hint(
    tiny_catalogue: str, tmp_path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    code, _, err = run(["bench", tiny_catalogue, "--plot", str(tmp_path / "figure.png")], capsys)
    assert code == cli.EXIT_MISSING_DEPENDENCY
    assert "pip install 'remat[cli]'" in assert_one_error_line(err)
    assert not (tmp_path / "figure.png").exists()


# ---------------------------------------------------------------------- bench
def test_bench_writes_json_markdown_and_png(tiny_catalogue: str, tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    json_path, markdown_path, plot_path = tmp_path / "bench.json", tmp_path / "out" / "bench.md", tmp_path / "bench.png"
    code, out, _ = run(
        [
            "bench",
            tiny_catalogue,
            "--batch",
            str(BATCH),
            "--budgets",
            "1.0,0.5,min,1B",
            "--steps",
            "2",
            "--threads",
            "1",
            "--json",
            str(json_path),
            "--markdown",
            str(markdown_path),
            "--plot",
            str(plot_path),
        ],
        capsys,
    )
    assert code == cli.EXIT_OK
    for strategy in (
        "no recompute",
        "checkpoint_sequential sqrt(n)",
        "remat @ 0.5",
        "remat @ min",
        "remat @ ckpt-seq memory",
    ):
        assert strategy in out
    assert "remat @ 1B: infeasible" in out

    document = json.loads(json_path.read_text())
    rows = {row["strategy"]: row for row in document["rows"]}
    assert list(rows) == [
        "no recompute",
        "checkpoint_sequential sqrt(n)",
        "remat @ 1.0",
        "remat @ 0.5",
        "remat @ min",
        "remat @ 1B",
        "remat @ ckpt-seq memory",
    ]
    assert rows["remat @ 1B"]["error"] and rows["remat @ 1B"]["measured_peak_bytes"] is None
    for row in rows.values():
        if row["kind"] == "remat" and row["error"] is None:
            assert row["measured_peak_bytes"] <= row["budget_bytes"], row
            assert row["fits_budget"] is True
            assert len(row["step_times_s"]) == 2
    assert rows["remat @ min"]["measured_peak_bytes"] < rows["no recompute"]["measured_peak_bytes"]
    assert document["metadata"]["threads"] == 1
    assert document["chosen_strategy"] == "remat @ min"
    assert set(document["timelines"]) == {"no recompute", "remat @ min"}

    assert markdown_path.read_text().startswith("| strategy |")
    assert plot_path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bench_with_a_policy_plans_remat_with_it(
    tiny_catalogue: str, tmp_path, capsys: pytest.CaptureFixture[str]
) -> None:
    json_path = tmp_path / "bench.json"
    argv = ["bench", tiny_catalogue, "--batch", str(BATCH), "--budgets", "0.5,min", "--steps", "1"]
    code, out, _ = run([*argv, "--policy", "save_matmuls", "--json", str(json_path)], capsys)
    assert code == cli.EXIT_OK and "remat @ 0.5" in out
    document = json.loads(json_path.read_text())
    assert document["metadata"]["policies"] == ["save_matmuls"]


def test_bench_cannot_write_output(tiny_catalogue: str, tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    code, _, err = run(
        ["bench", tiny_catalogue, "--budgets", "min", "--steps", "1", "--json", str(blocker / "x.json")], capsys
    )
    assert code == cli.EXIT_CANNOT_WRITE
    assert "cannot write" in assert_one_error_line(err)


@pytest.mark.parametrize(
    ("option", "name", "message"),
    [("--plot", "figure.txt", "its suffix must be one of"), ("--json", "file/x.json", "is not a directory")],
)
def test_bench_checks_its_outputs_before_any_work(
    option: str, name: str, message: str, tiny_catalogue: str, tmp_path, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    (tmp_path / "file").write_text("")
    ran = []
    monkeypatch.setattr(importlib.import_module("remat.cli.main"), "_run_bench", lambda *a, **k: ran.append(1))
    code, out, err = run(["bench", tiny_catalogue, "--steps", "1", option, str(tmp_path / name)], capsys)
    assert code == cli.EXIT_CANNOT_WRITE and not ran and not out.strip()
    assert message in assert_one_error_line(err)


def test_plan_takes_min_and_debug_after_the_subcommand(tiny_catalogue: str, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(["plan", tiny_catalogue, "--budget", "min", "--json", "--debug"], capsys)
    assert code == cli.EXIT_OK
    document = json.loads(out)
    assert document["requested_budget"] == "min"
    assert document["predicted_peak_bytes"] <= document["budget_bytes"]
    # --debug shows the error's traceback, wherever it stands on the line, and keeps its exit code
    code, _, err = run(["plan", tiny_catalogue, "--budget", "1kB", "--debug"], capsys)
    assert code == cli.EXIT_BUDGET_TOO_SMALL
    assert "Traceback (most recent call last)" in err and "BudgetTooSmall" in err
    assert err.rstrip().splitlines()[-1].startswith("remat: ")


def test_python_dash_m_runs_the_command() -> None:
    result = subprocess.run([sys.executable, "-m", "remat", "--version"], capture_output=True, text=True, check=False)
    assert result.returncode == 0
    assert result.stdout.startswith("remat ")


@pytest.mark.parametrize("columns", [80, 200])
def test_tables_fit_the_terminal_without_cutting_figures(
    columns: int, tiny_catalogue: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("COLUMNS", str(columns))
    for argv in (["plan", tiny_catalogue, "--budget", "0.5"], ["bench", tiny_catalogue, "--steps", "1"]):
        code, out, _ = run(argv, capsys)
        assert code == cli.EXIT_OK
        lines = out.splitlines()
        assert lines and max(len(line) for line in lines) <= columns
        assert "…" not in out  # no figure or header cut short


def test_the_torchrun_group_frees_what_uses_it_before_it_is_destroyed(monkeypatch: pytest.MonkeyPatch) -> None:
    # NOTE [freeing the group's users before the group]: an object in a reference cycle made
    # within the block (as a DistributedDataParallel is) is freed before the group is destroyed
    import gc
    import weakref

    import torch.distributed as dist

    from remat.cli.launch import torchrun_group

    class User:
        pass

    seen_at_destroy: list[bool] = []
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group", lambda backend: None)
    monkeypatch.setattr(dist, "get_rank", lambda: 1)
    was_enabled = gc.isenabled()
    gc.disable()  # only the block's own collection may free the cycle
    try:
        with torchrun_group("cpu") as rank:
            user = User()
            user.itself = user  # type: ignore[attr-defined]
            alive = weakref.ref(user)
            monkeypatch.setattr(dist, "destroy_process_group", lambda: seen_at_destroy.append(alive() is not None))
            del user
    finally:
        if was_enabled:
            gc.enable()
    assert rank == 1
    assert seen_at_destroy == [False]
