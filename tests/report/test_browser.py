"""The report in a real browser: tools/report_screenshot.sh renders it in headless Chromium
and the screenshot shows the figures: colored pixels, which a page of text and broken images
does not have. Skipped where no chromium is installed (Debian: apt-get install chromium), unless
MAXMOE_REQUIRE_BROWSER=1: .ci/run installs Chromium and sets it, so in CI a missing browser
fails instead of skipping."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
from matplotlib.image import imread

from maxmoe.cli import main
from tests.report.fake_runs import write_run

SCRIPT = Path(__file__).resolve().parents[2] / "tools" / "report_screenshot.sh"
BROWSER = shutil.which("chromium") or shutil.which("chromium-browser")
REQUIRED = os.environ.get("MAXMOE_REQUIRE_BROWSER") == "1"


def colored_fraction(png: Path) -> float:
    """Share of pixels with a saturated color (max - min channel > 0.25): figures, not text
    (the shares measured on the test's pages: docs/performance/observability.md, "Run
    report")."""
    rgb = imread(png)[..., :3]
    return float(np.mean(rgb.max(axis=-1) - rgb.min(axis=-1) > 0.25))


def screenshot(page: Path, out: Path) -> Path:
    done = subprocess.run(["bash", str(SCRIPT), str(page), str(out), "1280,4000"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return out


@pytest.mark.skipif(BROWSER is None and not REQUIRED,
                    reason="no chromium on PATH (apt-get install chromium)")
def test_the_report_renders_its_figures_in_headless_chromium(tmp_path):
    run = write_run(tmp_path / "run", truncate=True)
    assert main(["report", str(run)]) == 0
    page = run / "report.html"
    shown = colored_fraction(screenshot(page, tmp_path / "report.png"))
    # the same page with its figures taken out: what a browser shows when they do not render
    bare = tmp_path / "bare.html"
    text = re.sub(r"<svg.*?</svg>", "", page.read_text(), flags=re.DOTALL)
    bare.write_text(re.sub(r'src="data:[^"]*"', 'src="missing.png"', text))
    blank = colored_fraction(screenshot(bare, tmp_path / "bare.png"))
    assert blank < 0.005 and shown > 0.02, (shown, blank)


def test_the_screenshot_script_says_when_it_cannot_run(tmp_path):
    done = subprocess.run(["bash", str(SCRIPT), str(tmp_path / "none.html"),
                           str(tmp_path / "x.png")], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and done.stderr.count("\n") == 1, done.stderr
