"""`plan whatif`: every row is what `plan` prints for that configuration; CSV and JSON outputs;
the derived answers; bad input as one line with exit code 2."""

import csv
import json
import math

import pytest

from planner.cli import main
from planner.errors import EXIT_BAD_INPUT, EXIT_INFEASIBLE
from planner.plan import Plan
from tests.conftest import EXAMPLES

GPT = str(EXAMPLES / "gpt.py")
# A memory limit at which the GPT does not fit on 1 GPU, takes a 2-stage pipeline on 2 and data
# parallelism on 4 (with a 1 GiB reserve per device): every kind of row.
SWEEP = [GPT, "--gpus", "1,2,4", "--gpu", "a100-80gb,h100-sxm-80gb", "--memory-limit", "1.2", "--global-batch", "64"]


def _json(capsys, *args) -> dict:
    code = main([*args, "--json"])
    out = capsys.readouterr()
    assert code == 0, out.err
    return json.loads(out.out)


@pytest.fixture(scope="module")
def sweep_json(tmp_path_factory):
    """The sweep, run once for the module, as --json (stdout) and --csv (a file)."""
    import contextlib
    import io

    path = tmp_path_factory.mktemp("whatif") / "out.csv"
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        code = main(["whatif", *SWEEP, "--tokens", "1e9", "--price", "a100-80gb=1.8,h100-sxm-80gb=3.5", "--csv", str(path), "--json"])
    assert code == 0
    return json.loads(buf.getvalue()), path


def _row(data: dict, gpu: str, n: int) -> dict:
    (row,) = [r for r in data["points"] if r["gpu"] == gpu and r["num_gpus"] == n]
    return row


@pytest.mark.parametrize("gpu,n", [("h100-sxm-80gb", 2), ("a100-80gb", 4), ("h100-sxm-80gb", 4)])
def test_rows_agree_with_plan(capsys, sweep_json, gpu, n):
    data, _ = sweep_json
    row = _row(data, gpu, n)
    plan = Plan.from_dict(_json(capsys, GPT, "--gpus", str(n), "--gpu", gpu, "--memory-limit", "1.2", "--global-batch", "64"))
    pr = plan.predicted
    assert row["fits"] is True
    assert row["plan"] == plan.parallel.one_line()
    assert row["global_batch"] == plan.training.global_batch and row["micro_batch"] == plan.parallel.micro_batch
    for key in ("step_time_s", "samples_per_s", "tokens_per_s", "mfu"):
        assert row[key] == pytest.approx(getattr(pr, key), rel=1e-9), key
    assert row["peak_memory_bytes"] == pr.peak_memory_bytes
    assert row["memory_limit_bytes"] == plan.cluster.memory_limit_bytes


def test_pipeline_row_is_in_the_sweep(sweep_json):
    data, _ = sweep_json
    assert "pp=2" in _row(data, "h100-sxm-80gb", 2)["plan"]


def test_row_that_does_not_fit_agrees_with_plan(capsys, sweep_json):
    data, _ = sweep_json
    row = _row(data, "a100-80gb", 1)
    assert row["fits"] is False and row["step_time_s"] is None
    assert row["plan"].startswith("does not fit: needs") and row["peak_memory_bytes"] > row["memory_limit_bytes"]
    assert main([GPT, "--gpus", "1", "--gpu", "a100-80gb", "--memory-limit", "1.2", "--global-batch", "64"]) == EXIT_INFEASIBLE
    capsys.readouterr()


def test_default_global_batch_agrees_with_plan(capsys):
    data = _json(capsys, "whatif", GPT, "--gpus", "8", "--gpu", "a100-80gb")
    plan = Plan.from_dict(_json(capsys, GPT, "--gpus", "8", "--gpu", "a100-80gb"))
    row = data["points"][0]
    assert row["plan"] == plan.parallel.one_line() and row["global_batch"] == plan.training.global_batch
    assert row["step_time_s"] == pytest.approx(plan.predicted.step_time_s, rel=1e-9)


def test_sweep_holds_one_global_batch_and_rows_match_plan(capsys):
    """8-64 GPUs without --global-batch: one batch in every row (throughput, scaling, days and
    cost compare like with like), and each row is `plan --global-batch` that batch."""
    data = _json(capsys, "whatif", GPT, "--gpus", "8,16,32,64", "--gpu", "h100-sxm-80gb")
    batches = {r["global_batch"] for r in data["points"]}
    assert batches == {data["global_batch"]} and all(r["batch_note"] == "" for r in data["points"])
    assert any("the same at every count" in a for a in data["assumptions"])
    for n in (16, 64):
        row = _row(data, "h100-sxm-80gb", n)
        plan = Plan.from_dict(_json(capsys, GPT, "--gpus", str(n), "--global-batch", str(data["global_batch"])))
        assert row["plan"] == plan.parallel.one_line()
        assert row["step_time_s"] == pytest.approx(plan.predicted.step_time_s, rel=1e-9)
    # --scale-batch: the batch grows with the GPUs, as many samples per GPU at every count
    scaled = _json(capsys, "whatif", GPT, "--gpus", "8,16", "--gpu", "h100-sxm-80gb", "--scale-batch")
    per_gpu = {r["global_batch"] / r["num_gpus"] for r in scaled["points"]}
    assert len(per_gpu) == 1 and _row(scaled, "h100-sxm-80gb", 16)["global_batch"] == 2 * data["global_batch"]


def test_time_cost_and_answers(sweep_json):
    data, _ = sweep_json
    seq = data["model"]["seq_len"]
    prices = {"a100-80gb": 1.8, "h100-sxm-80gb": 3.5}
    ok = [r for r in data["points"] if r["fits"]]
    assert len(ok) == 4
    for r in ok:
        assert r["steps"] == math.ceil(1e9 / (r["global_batch"] * seq))
        assert r["days_to_train"] == pytest.approx(r["steps"] * r["step_time_s"] / 86400)
        assert r["cost_usd"] == pytest.approx(r["days_to_train"] * 24 * r["num_gpus"] * prices[r["gpu"]])
    cheapest = min(ok, key=lambda r: r["cost_usd"])
    fastest = min(ok, key=lambda r: r["days_to_train"])
    assert (data["cheapest"]["gpu"], data["cheapest"]["num_gpus"]) == (cheapest["gpu"], cheapest["num_gpus"])
    assert (data["fastest"]["gpu"], data["fastest"]["num_gpus"]) == (fastest["gpu"], fastest["num_gpus"])
    assert {m["gpu"]: m["num_gpus"] for m in data["min_gpus"]} == {"a100-80gb": 2, "h100-sxm-80gb": 2}
    for r in ok:  # efficiency against the type's smallest fitting count (2 GPUs)
        base = _row(data, r["gpu"], 2)
        assert r["scaling_efficiency"] == pytest.approx(r["samples_per_s"] / base["samples_per_s"] / (r["num_gpus"] / 2))


def test_csv_has_one_row_per_configuration(sweep_json):
    data, path = sweep_json
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 6 == len(data["points"])
    assert list(rows[0]) == list(data["points"][0])
    assert [(r["gpu"], int(r["num_gpus"])) for r in rows] == [(p["gpu"], p["num_gpus"]) for p in data["points"]]
    assert float(rows[1]["step_time_s"]) == pytest.approx(data["points"][1]["step_time_s"])


def test_deadline_pick_is_the_cheapest_that_meets_it(capsys):
    data = _json(capsys, "whatif", *SWEEP, "--steps", "100000", "--price", "a100-80gb=1,h100-sxm-80gb=3",
                 "--deadline-days", "0.02")
    meet = [r for r in data["points"] if r["fits"] and r["days_to_train"] <= 0.02]
    if meet:
        best = min(meet, key=lambda r: r["cost_usd"])
        assert (data["deadline_pick"]["gpu"], data["deadline_pick"]["num_gpus"]) == (best["gpu"], best["num_gpus"])
    else:
        assert data["deadline_pick"] is None and "none finishes" in data["deadline_note"]


def test_min_gpus_beyond_the_sweep_and_headroom(capsys):
    data = _json(capsys, "whatif", GPT, "--gpus", "1", "--gpu", "h100-sxm-80gb", "--memory-limit", "1.2", "--global-batch", "64")
    (m,) = data["min_gpus"]
    assert m["num_gpus"] == 2 and m["in_sweep"] is False and "pp=2" in m["plan"]
    assert data["headroom"] is None  # one cluster, but nothing fits on it
    data = _json(capsys, "whatif", GPT, "--gpus", "2", "--gpu", "h100-sxm-80gb", "--memory-limit", "1.3", "--global-batch", "64")
    h = data["headroom"]
    assert h["memory_free_bytes"] > 0 and h["max_micro_batch"] >= h["micro_batch"]
    assert 1.0 <= h["model_scale"] < 100 and 1.0 <= h["seq_scale"]
    assert h["max_params"] >= data["model"]["num_params"]


BAD = [
    (["--gpus", "8", "--gpu", "h100"], "did you mean h100-nvl-94gb or h100-pcie-80gb or h100-sxm-80gb"),
    (["--gpus", "8", "--gpu", "a100-80gb,h100-sxm"], "did you mean"),
    (["--gpus", ""], "--gpus: empty list"),
    (["--gpus", "8,,16"], "empty entry"),
    (["--gpus", "8,x"], "'x' is not a whole number"),
    (["--gpus", "0"], "'0' is not a whole number"),
    (["--gpus", "8,8"], "listed twice"),
    (["--gpus", "8", "--gpu", ","], "empty entry"),
    (["--gpus", "8", "--price", "h200=3"], "'h200' is not in the sweep"),
    (["--gpus", "8", "--gpu", "a100-80gb", "--price", "a100-80gb:1.8"], "is not TYPE=DOLLARS_PER_GPU_HOUR"),
    (["--gpus", "8", "--gpu", "a100-80gb", "--price", "a100-80gb=cheap"], "is not a number"),
    (["--gpus", "8", "--gpu", "a100-80gb", "--price", "a100-80gb=-1"], "must be a positive number"),
    (["--gpus", "8", "--gpu", "a100-80gb,h200", "--price", "a100-80gb=1"], "no price for h200"),
    (["--gpus", "8", "--tokens", "1e9", "--steps", "10"], "not both"),
    (["--gpus", "8", "--tokens", "lots"], "is not a number"),
    (["--gpus", "8", "--deadline-days", "3"], "needs the training length"),
    (["--gpus", "8", "--report", "/no/such/dir/r.html"], "no such directory"),
    (["--gpus", "8", "--compile"], "--compile: plan for --trainer torchtitan"),
]


@pytest.mark.parametrize("args,message", BAD, ids=[m for _, m in BAD])
def test_bad_input_is_one_line_exit_2(capsys, args, message):
    assert main(["whatif", GPT, *args]) == EXIT_BAD_INPUT
    out = capsys.readouterr()
    assert out.out == ""
    assert len(out.err.strip().splitlines()) == 1 and message in out.err, out.err


def test_tokens_need_a_sequence(capsys):
    assert main(["whatif", str(EXAMPLES / "mlp.py"), "--gpus", "1", "--tokens", "1e9"]) == EXIT_BAD_INPUT
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "use --steps" in err


def test_terminal_table(capsys):
    assert main(["whatif", *SWEEP, "--steps", "1000"]) == 0
    out = capsys.readouterr().out
    assert "What if: gpt" in out and "fewest a100-80gb that train it: 2" in out
    assert out.count("does not fit") >= 2 and "cheapest" in out and "fastest" in out


def test_a_gpus_sources_are_printed_as_written(capsys):
    """The assumptions name each GPU's sources in brackets; one that begins in lower case (the
    MI250X's memory: "[rocm-smi ...]") is printed, not taken for terminal markup and dropped."""
    assert main(["whatif", str(EXAMPLES / "mlp.py"), "--gpus", "1", "--gpu", "mi250x", "--steps", "10"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "[rocm-smi --showmeminfo vram on an MI250X GCD" in out


def test_existing_report_and_csv_are_not_overwritten(capsys, tmp_path):
    for flag, name in (("--report", "r.html"), ("--csv", "r.csv")):
        target = tmp_path / name
        target.write_text("mine")
        code = main(["whatif", str(EXAMPLES / "gpt.py"), "--gpus", "2", flag, str(target)])
        err = capsys.readouterr().err.strip()
        assert code == 2 and "--force" in err and len(err.splitlines()) == 1
        assert target.read_text() == "mine"


def test_fp8_sweep_marks_gpus_without_fp8(capsys):
    data = _json(capsys, "whatif", GPT, "--gpus", "2", "--gpu", "a100-80gb,h100-sxm-80gb", "--precision", "fp8")
    a100, h100 = _row(data, "a100-80gb", 2), _row(data, "h100-sxm-80gb", 2)
    assert a100["fits"] is False and "no FP8 matmul peak" in a100["plan"]
    assert h100["fits"] is True
    mins = {m["gpu"]: m for m in data["min_gpus"]}
    assert mins["a100-80gb"]["num_gpus"] is None and "no FP8 matmul peak" in mins["a100-80gb"]["plan"]


def test_a_sweep_for_another_trainer_is_what_plan_says_for_it(capsys):
    """--trainer megatron in plan whatif: each row is plan's for the same trainer, and the header
    says which."""
    args = ["--gpu", "h100-sxm-80gb", "--global-batch", "64", "--trainer", "megatron"]
    data = _json(capsys, "whatif", str(EXAMPLES / "llama.py"), "--gpus", "8", *args)
    plan = Plan.from_dict(_json(capsys, str(EXAMPLES / "llama.py"), "--gpus", "8", *args))
    row = _row(data, "h100-sxm-80gb", 8)
    assert plan.training.trainer == "megatron"
    assert row["plan"] == plan.parallel.one_line()
    assert row["step_time_s"] == pytest.approx(plan.predicted.step_time_s, rel=1e-9)
    assert main(["whatif", str(EXAMPLES / "llama.py"), "--gpus", "8", *args]) == 0
    assert "for --trainer megatron" in capsys.readouterr().out
