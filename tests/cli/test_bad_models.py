"""`plan profile` on malformed model files: exit code 2 and ONE line on stderr that names the file
and says what is wrong; ``--debug`` lets the exception (and its traceback) through instead.

Each fixture in ``bad_models/`` is a small model file with one mistake; its docstring says which.
"""

import subprocess
import sys
from pathlib import Path

import pytest

from planner.cli import main
from planner.errors import EXIT_BAD_INPUT, BadInput

BAD = Path(__file__).resolve().parent / "bad_models"
ROOT = Path(__file__).resolve().parents[2]


# (file in bad_models/, a substring the one-line error must contain, extra CLI arguments)
CASES = [
    ("does_not_exist.py", "no such model file", ()),
    (".", "not a file", ()),  # the bad_models folder itself
    ("syntax_error.py", "syntax_error.py:6: syntax error", ()),
    ("null_bytes.py", "null bytes", ()),
    ("missing_import.py", "module 'not_a_real_pkg' is not installed", ()),
    ("raises_at_import.py", "raised RuntimeError: MY_CLUSTER_CONFIG is not set while being imported (raises_at_import.py:8)", ()),
    ("exits_at_import.py", "called exit(3) while being imported", ()),
    ("no_build_model.py", "missing required function build_model()", ()),
    ("no_sample_batch.py", "missing required function sample_batch()", ()),
    ("build_model_not_callable.py", "build_model must be a function, got OrderedDict", ()),
    ("loss_fn_not_callable.py", "loss_fn must be a function, got str", ()),
    ("build_model_raises.py", "build_model() raised ValueError: width must be even, got 7 (build_model_raises.py:10)", ()),
    ("build_model_wants_args.py", "build_model() raised TypeError: build_model() missing 1 required positional argument: 'width'", ()),
    ("build_model_returns_dict.py", "build_model() returned OrderedDict, expected a torch.nn.Module", ()),
    ("item_in_build_model.py", "build_model() raised RuntimeError: Tensor.item() cannot be called on meta tensors", ("--meta",)),
    ("sample_batch_raises.py", "sample_batch(1) raised KeyError: 'validation' (sample_batch_raises.py:12)", ()),
    ("sample_batch_no_args.py", "sample_batch(1) raised TypeError: sample_batch() takes 0 positional arguments", ()),
    ("sample_batch_not_tuple.py", "sample_batch(1) must return (inputs, targets), got Tensor", ()),
    ("sample_batch_three_items.py", "must return (inputs, targets), got tuple of length 3", ()),
    ("inputs_string.py", "inputs must be a Tensor, a tuple of Tensors or a dict of keyword arguments, got str", ()),
    ("forward_rejects_batch.py", "the model's forward rejected the batch from sample_batch()", ()),
    ("loss_fn_raises.py", "loss_fn raised NotImplementedError: TODO: write the contrastive loss (loss_fn_raises.py:15)", ()),
    ("loss_fn_not_scalar.py", "loss_fn must return a scalar tensor", ("--batch-size", "2")),
    ("output_without_logits.py", "cannot find the predictions in the model's output (dict)", ()),
]


def _path(name: str) -> Path:
    return (BAD / name).resolve()


@pytest.mark.parametrize("name, expected, extra", CASES)
def test_bad_model_file_gives_one_line_error(name, expected, extra, capsys):
    path = _path(name)
    code = main(["profile", str(path), *extra])
    out, err = capsys.readouterr()
    assert code == EXIT_BAD_INPUT, f"exit code {code}; stderr: {err!r}"
    lines = err.splitlines()
    assert len(lines) == 1, f"stderr is not one line:\n{err}"
    line = lines[0]
    assert line.startswith("error: "), line
    assert str(path) in line, f"the error does not name {path}: {line}"
    assert expected in line, f"{expected!r} not in {line!r}"
    assert ":None" not in line, f"a missing line number leaked into the message: {line}"
    assert out == "", f"nothing belongs on stdout after an error, got {out!r}"


def test_all_fixtures_have_a_case():
    named = {c.values[0] if hasattr(c, "values") else c[0] for c in CASES}
    fixtures = {p.name for p in BAD.glob("*.py")}
    assert fixtures <= named, f"fixtures without a test case: {sorted(fixtures - named)}"


def test_debug_lets_the_exception_through():
    path = _path("build_model_raises.py")
    with pytest.raises(BadInput, match="build_model.. raised ValueError") as info:
        main(["profile", str(path), "--debug"])
    # The user's exception is chained, so the traceback shows the line in their file.
    cause = info.value.__cause__
    assert isinstance(cause, ValueError) and "width must be even" in str(cause)
    frames = [f for f in _walk_tb(cause.__traceback__) if Path(f).resolve() == path]
    assert frames, "the chained traceback does not reach the user's file"


def _walk_tb(tb):
    while tb is not None:
        yield tb.tb_frame.f_code.co_filename
        tb = tb.tb_next


def test_debug_import_error_keeps_the_cause():
    with pytest.raises(BadInput) as info:
        main(["profile", str(_path("missing_import.py")), "--debug"])
    assert isinstance(info.value.__cause__, ModuleNotFoundError)
    assert info.value.__cause__.name == "not_a_real_pkg"


@pytest.mark.parametrize(
    "name, expected",
    [
        # torch's FakeTensorMode logs a traceback through `logging` when a meta kernel fails: the
        # process's real stderr must still be one line (capsys does not see that handler).
        ("forward_rejects_batch.py", "the model's forward rejected the batch"),
        # sys.exit() inside the user's file must not end the planner with the user's code.
        ("exits_at_import.py", "called exit(3) while being imported"),
    ],
)
def test_bad_model_in_a_real_process(name, expected):
    path = _path(name)
    proc = subprocess.run(
        [sys.executable, "-m", "planner.cli", "profile", str(path)],
        capture_output=True, text=True, cwd=ROOT, timeout=300,
    )
    assert proc.returncode == EXIT_BAD_INPUT, proc.stderr
    lines = proc.stderr.splitlines()
    assert len(lines) == 1, f"stderr is not one line:\n{proc.stderr}"
    assert lines[0].startswith("error: ") and str(path) in lines[0] and expected in lines[0], lines[0]
    assert proc.stdout == ""
