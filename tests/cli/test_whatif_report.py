"""`plan whatif --report`: the HTML file is self-contained and, opened in headless Chromium, shows
its four charts; the pipeline timeline's simulation agrees with the cost model's formula.

Chromium is Debian's `chromium` package (.ci/run installs it). When it is missing, the test tries
to install it (as root, with apt-get) and is skipped, saying why, only when that fails.
"""

import os
import re
import shutil
import subprocess

import pytest

from planner.cli import main
from planner.report.html_report import schedule_order, simulate
from tests.conftest import EXAMPLES

GPT = str(EXAMPLES / "gpt.py")
SWEEP = ["whatif", GPT, "--gpus", "1,2,4", "--gpu", "a100-80gb,h100-sxm-80gb", "--memory-limit", "1.2",
         "--global-batch", "64", "--tokens", "1e9", "--price", "a100-80gb=1.8,h100-sxm-80gb=3.5", "--deadline-days", "1"]


def _chromium() -> str:
    for name in ("chromium", "chromium-browser"):
        if shutil.which(name):
            return shutil.which(name)
    why = "not installed"
    if shutil.which("apt-get") and hasattr(os, "geteuid") and os.geteuid() == 0:
        try:
            subprocess.run("apt-get update -qq && apt-get install -y -qq chromium", shell=True, check=True,
                           capture_output=True, timeout=900)
        except (subprocess.SubprocessError, OSError) as exc:
            why = f"not installed, and `apt-get install chromium` failed: {exc}"
        if shutil.which("chromium"):
            return shutil.which("chromium")
    else:
        why = "not installed, and this user cannot apt-get install it"
    pytest.skip(f"headless Chromium is needed to open the report: chromium is {why}")


def _headless(chromium: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [chromium, "--headless", "--disable-gpu", "--no-sandbox", "--no-first-run", "--hide-scrollbars", *args],
        capture_output=True, text=True, timeout=120,
    )


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    path = tmp_path_factory.mktemp("report") / "report.html"
    assert main([*SWEEP, "--report", str(path)]) == 0
    return path


def test_report_is_self_contained(report):
    text = report.read_text(encoding="utf-8")
    assert text.startswith("<!DOCTYPE html>")
    # nothing fetched: no src/href to the network, no <script>, no <link> (namespaces are not fetches)
    assert not re.search(r"""(?:src|href)\s*=\s*["']?(?:https?:)?//""", text)
    assert "<script" not in text and "<link" not in text
    for heading in ("Answers", "Every configuration", "Throughput", "Time and cost to train", "Memory per GPU",
                    "Pipeline schedule", "Assumptions"):
        assert f">{heading}" in text, heading
    assert "$1.80" in text and "TFLOP/s" in text and "best measured matmul rate" in text  # prices, hardware, efficiency


def test_report_opens_in_chromium_with_its_charts(report, tmp_path):
    chromium = _chromium()
    dom = _headless(chromium, "--dump-dom", report.as_uri())
    assert dom.returncode == 0, dom.stderr[-2000:]
    svgs = re.findall(r"<svg\b.*?</svg>", dom.stdout, flags=re.S)
    assert len(svgs) == 4, f"expected 4 charts, found {len(svgs)}"  # throughput, time/cost, memory, pipeline
    for svg in svgs:
        assert len(svg) > 5000 and svg.count("<path") > 20  # drawn, not empty
        assert re.search(r'width="[\d.]+pt"', svg) and re.search(r'height="[\d.]+pt"', svg)
    # the rendered page is not blank: a screenshot with many colours
    png = tmp_path / "page.png"
    shot = _headless(chromium, f"--screenshot={png}", "--window-size=1200,3000", report.as_uri())
    assert shot.returncode == 0 and png.exists(), shot.stderr[-2000:]
    from PIL import Image

    with Image.open(png) as im:
        colours = im.convert("RGB").getcolors(maxcolors=1 << 20)
    assert colours is not None and len(colours) > 200


def test_timeline_simulation_matches_the_cost_model():
    # balanced stages, forward 1, backward 2: (m - 1) T + p T for GPipe / 1F1B, m T + (p - 1) T / v interleaved
    for p, m, v, schedule in ((4, 8, 1, "1f1b"), (4, 8, 1, "gpipe"), (4, 8, 2, "interleaved"), (4, 16, 4, "interleaved")):
        ops = simulate([1.0] * p, [2.0] * p, m, v, schedule)
        end = max(s + d for rank in ops for s, d, _ in rank)
        assert end == pytest.approx(m * 3 + (p * 3 - 3) / v), (p, m, v, schedule)
        assert all(len(rank) == 2 * m * v for rank in ops)


def test_1f1b_order_has_the_warm_up():
    order = schedule_order(4, 8, 1, "1f1b")
    assert [k for k, _, _ in order[0][:4]] == ["F", "F", "F", "F"] and order[0][4][0] == "B"
    assert [k for k, _, _ in order[3][:3]] == ["F", "B", "F"]
