"""Loading a hand-edited plan file: every malformed variant is one `BadInput` line naming the file
and the field (its dotted path) or the broken constraint; a plan written before the newer
defaulted fields existed still loads; a valid plan round-trips unchanged. Writing is atomic.
"""

import copy
import json
import os

import pytest

from planner import schema
from planner.errors import BadInput
from planner.files import atomic_open, atomic_write_text, check_output_path
from planner.model_file import load_model_file
from planner.plan import Plan
from planner.planning import PlanRequest, make_plan
from planner.search.space import Fixed
from tests.conftest import EXAMPLES


@pytest.fixture(scope="module")
def plan_data() -> dict:
    """A real plan (the MLP example on 4 GPUs as dp=2 x pp=2: two stages), as its JSON."""
    plan = make_plan(load_model_file(EXAMPLES / "mlp.py"), PlanRequest(gpus=4, fixed=Fixed(pp=2, dp=2)))
    data = json.loads(plan.to_json())
    p = data["parallel"]
    assert (p["dp"], p["tp"], p["pp"], len(data["stages"])) == (2, 1, 2, 2)
    return data


def _load(tmp_path, data) -> Plan:
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(data))
    return Plan.load(path)


def _refused(tmp_path, data) -> str:
    with pytest.raises(BadInput) as info:
        _load(tmp_path, data)
    message = str(info.value)
    assert len(message.splitlines()) == 1, message
    assert message.startswith(f"{tmp_path / 'plan.json'}: "), message
    return message[len(f"{tmp_path / 'plan.json'}: "):]


def _set(*keys_and_value):
    *keys, value = keys_and_value

    def edit(d):
        for k in keys[:-1]:
            d = d[k]
        d[keys[-1]] = value

    return edit


def _drop(*keys):
    def edit(d):
        for k in keys[:-1]:
            d = d[k]
        del d[keys[-1]]

    return edit


# (edit of the valid plan's JSON, the one-line message after "PATH: ")
MALFORMED = [
    (_drop("parallel", "dp"), "parallel.dp is missing"),
    (_drop("cluster"), "cluster is missing"),
    (_drop("stages", 1, "memory_bytes", "total"), "stages[1].memory_bytes.total is missing"),
    (_set("parallel", "dp", "two"), 'parallel.dp: expected a whole number, got "two"'),
    (_set("parallel", "dp", 2.5), "parallel.dp: expected a whole number, got 2.5"),
    (_set("parallel", "dp", True), "parallel.dp: expected a whole number, got true"),
    (_set("parallel", "dp", None), "parallel.dp: expected a whole number, got null"),
    (_set("parallel", "dp", 0), "parallel.dp: must be at least 1, got 0"),
    (_set("parallel", "tp", -2), "parallel.tp: must be at least 1, got -2"),
    (_set("parallel", "num_microbatches", 0), "parallel.num_microbatches: must be at least 1, got 0"),
    (_set("parallel", "sequence_parallel", "no"), 'parallel.sequence_parallel: expected true or false, got "no"'),
    (_set("parallel", "schedule", "zigzag"), 'parallel.schedule: "zigzag" is not one of gpipe, 1f1b, interleaved'),
    (_set("parallel", "recompute", "some"), 'parallel.recompute: "some" is not one of none, selective, alternate, full, mixed'),
    (_set("parallel", "zero", 4), "parallel.zero: 4 is not one of 0, 1, 2, 3"),
    (_set("parallel", "dp", 4), "parallel: dp 4 x tp 1 x pp 2 = 8, not cluster.num_gpus 4"),
    (_set("cluster", "num_gpus", 8), "parallel: dp 2 x tp 1 x pp 2 = 4, not cluster.num_gpus 8"),
    (_set("parallel", "dp_replicate", 3), "parallel: dp_replicate 3 does not divide dp 2"),
    (_set("training", "global_batch", 100), "not training.global_batch 100"),
    (_set("training", "precision", "fp64"), 'training.precision: "fp64" is not one of bf16, fp16, fp32, fp8'),
    (lambda d: d["stages"].pop(), "stages: 1 stage, not parallel.pp 2"),
    (_set("stages", 1, "rank", 5), "stages[1].rank: expected 1, got 5"),
    (_set("stages", 0, "layers", "fc1"), 'stages[0].layers: expected a list, got "fc1"'),
    (_set("stages", 0, "layers", [1]), "stages[0].layers[0]: expected a string, got 1"),
    (_set("parallel", [2, 2]), "parallel: expected an object, got a list of 2"),
    (_set("predicted", "breakdown_s", "compute", "slow"), 'predicted.breakdown_s.compute: expected a number, got "slow"'),
    (_set("model", "seq_len", "long"), 'model.seq_len: expected a whole number, got "long"'),
]


@pytest.mark.parametrize("edit, message", MALFORMED, ids=[m for _, m in MALFORMED])
def test_malformed_plan_is_one_line_naming_the_field(tmp_path, plan_data, edit, message):
    data = copy.deepcopy(plan_data)
    edit(data)
    got = _refused(tmp_path, data)
    assert message in got, got


def test_batch_constraint_message(tmp_path, plan_data):
    data = copy.deepcopy(plan_data)
    p = data["parallel"]
    data["training"]["global_batch"] += 1
    assert _refused(tmp_path, data) == (
        f"parallel: micro_batch {p['micro_batch']} x num_microbatches {p['num_microbatches']} x dp 2 = "
        f"{p['micro_batch'] * p['num_microbatches'] * 2}, not training.global_batch {data['training']['global_batch']}"
    )


@pytest.mark.parametrize(
    "content, message",
    [
        (b"\xff\xfe{}", "not UTF-8 text (byte 0xff at offset 0); expected a planner.Plan JSON file"),
        (b'{"schema": ', ":1: not valid JSON: Expecting value"),
        (b"", ":1: not valid JSON: Expecting value"),
        (b"[1, 2]", "not a planner.Plan file (schema: 'list')"),
        (b'{"schema": "planner.ModelProfile", "version": 1}', "not a planner.Plan file (schema: 'planner.ModelProfile')"),
        (b'{"schema": "planner.Plan", "version": 99}', "version 99 is newer than this tool reads"),
    ],
)
def test_not_a_plan_file(tmp_path, content, message):
    path = tmp_path / "plan.json"
    path.write_bytes(content)
    with pytest.raises(BadInput) as info:
        Plan.load(path)
    text = str(info.value)
    assert len(text.splitlines()) == 1 and text.startswith(str(path)) and message in text, text


def test_missing_file_and_directory(tmp_path):
    with pytest.raises(BadInput, match="no such file"):
        Plan.load(tmp_path / "absent.json")
    with pytest.raises(BadInput, match="is a directory"):
        Plan.load(tmp_path)


def test_valid_plan_round_trips(tmp_path, plan_data):
    plan = _load(tmp_path, plan_data)
    assert json.loads(plan.to_json()) == plan_data
    assert Plan.from_dict(json.loads(plan.to_json())) == plan
    # a UTF-8 byte-order mark (some editors write one) is not an error
    bom = tmp_path / "bom.json"
    bom.write_bytes(b"\xef\xbb\xbf" + plan.to_json().encode())
    assert Plan.load(bom) == plan


def test_old_plan_without_newer_fields_loads(tmp_path, plan_data):
    """Fields added with defaults (HSDP, TP and EP overlap, the alternate recompute policy, assumptions,
    warnings, skipped configurations) may be absent from a plan written before them."""
    data = copy.deepcopy(plan_data)
    for key in ("dp_replicate", "tp_overlap", "ep_overlap"):
        del data["parallel"][key]
    for stage in data["stages"]:
        del stage["alternate_layers"]
    for key in ("assumptions", "warnings"):
        del data[key]
    del data["solver"]["skipped"]
    plan = _load(tmp_path, data)
    assert (plan.parallel.dp_replicate, plan.parallel.tp_overlap, plan.parallel.ep_overlap) == (1, False, False)
    assert all(stage.alternate_layers == () for stage in plan.stages)
    assert plan.assumptions == () and plan.solver.skipped == {}
    assert plan.parallel.dp * plan.parallel.tp * plan.parallel.pp == plan.cluster.num_gpus


def test_unknown_fields_are_ignored(tmp_path, plan_data):
    """A field this version does not know (from a newer minor release) does not stop the load."""
    data = copy.deepcopy(plan_data)
    data["parallel"]["context_parallel"] = 1
    assert _load(tmp_path, data).parallel.dp == 2


def test_optional_fields_take_null(tmp_path, plan_data):
    data = copy.deepcopy(plan_data)
    data["data_parallel"] = None
    data["model"]["seq_len"] = None
    plan = _load(tmp_path, data)
    assert plan.data_parallel is None and plan.model.seq_len is None


# -- writing ---------------------------------------------------------------------------------------
def test_write_new_file_is_atomic_and_refuses_bad_paths(tmp_path):
    out = tmp_path / "plan.json"
    schema.write_new_file(out, "{}")
    assert out.read_text() == "{}\n"
    with pytest.raises(BadInput, match="already exists; pass --force"):
        schema.write_new_file(out, "{1}")
    os.chmod(out, 0o640)
    schema.write_new_file(out, '{"a": 1}', force=True)
    assert out.read_text() == '{"a": 1}\n'
    assert out.stat().st_mode & 0o777 == 0o640  # an overwritten file keeps its mode
    assert [p.name for p in tmp_path.iterdir()] == ["plan.json"]  # no temporary file left
    with pytest.raises(BadInput, match=f"^{tmp_path}: is a directory"):
        schema.write_new_file(tmp_path, "{}", force=True)
    with pytest.raises(BadInput, match=f"^{tmp_path / 'no'}: no such directory"):
        schema.write_new_file(tmp_path / "no" / "plan.json", "{}")
    with pytest.raises(BadInput, match=f"^{out}: not a directory"):
        schema.write_new_file(out / "plan.json", "{}")


def test_failed_write_leaves_the_old_file(tmp_path):
    out = tmp_path / "rows.csv"
    out.write_text("old\n")
    with pytest.raises(RuntimeError):
        with atomic_open(out, newline="") as f:
            f.write("half a row")
            raise RuntimeError("the writer failed")
    assert out.read_text() == "old\n"
    assert [p.name for p in tmp_path.iterdir()] == ["rows.csv"]
    atomic_write_text(out, "a,b\r\n", newline="")
    assert out.read_bytes() == b"a,b\r\n"  # written as given (csv's line ends kept)


def test_write_through_a_symlink_replaces_its_target(tmp_path):
    target = tmp_path / "real.json"
    target.write_text("old")
    link = tmp_path / "link.json"
    link.symlink_to(target)
    atomic_write_text(link, "new")
    assert link.is_symlink() and target.read_text() == "new"


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only directories")
def test_unwritable_directory_is_refused(tmp_path):
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o555)
    try:
        with pytest.raises(BadInput, match=f"^{locked}: directory not writable"):
            check_output_path(locked / "plan.json")
    finally:
        locked.chmod(0o755)
