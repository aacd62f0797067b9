"""The run report as a browser draws it (issue #28): a small run's report.html rendered by
headless Chromium at a desktop width (1400 px) and a phone's (500 px).

A copy of the page gets a short script that measures the laid-out page and writes its
findings into the DOM, which ``--dump-dom`` prints: the page must not scroll sideways,
every legend entry must carry its line's colour (distinct within a chart), no chart text
may spill out of its plot or overlap another label, and nothing may be fetched. Chromium's
console (on stderr) must stay silent. Screenshots of both widths are written beside the
report (``$RLHFLAB_REPORT_SHOTS``, when set, gets a copy) for a person to look at.

Needs Debian's ``chromium`` package; the test skips without it, except under CI=true
(``.ci/run`` installs it), where a missing browser is a failure.
"""

import html
import json
import os
import re
import shutil
import subprocess

import pytest

from rlhflab.app.report import build_report
from rlhflab.config import load_config
from rlhflab.trainers.ppo import PPOTrainer

BROWSER = next(
    (shutil.which(b) for b in ("chromium", "chromium-browser", "google-chrome") if shutil.which(b)),
    None,
)
WIDTHS = (1400, 500)

CHECK = """<script>
window.addEventListener("load", function () {
  var out = {errors: [], legends: [], spills: [], overlaps: []};
  try {
    out.scrollWidth = document.documentElement.scrollWidth;
    out.innerWidth = window.innerWidth;
    out.resources = performance.getEntriesByType("resource").map(function (e) {
      return e.name;
    });
    document.querySelectorAll("figure.c").forEach(function (fig) {
      var title = fig.querySelector("figcaption").textContent, pairs = [];
      fig.querySelectorAll("ul.lg li[data-s]").forEach(function (li) {
        var sw = getComputedStyle(li.querySelector("svg.sw > *"));
        var mark = fig.querySelector('svg.pl [data-s="' + li.dataset.s + '"]');
        var ms = getComputedStyle(mark);
        pairs.push([sw.stroke !== "none" ? sw.stroke : sw.fill,
                    mark.tagName === "circle" ? ms.fill : ms.stroke]);
      });
      out.legends.push({title: title, pairs: pairs});
      var box = fig.querySelector("svg.pl").getBoundingClientRect(), labels = [];
      fig.querySelectorAll("svg.pl text").forEach(function (t) {
        var r = t.getBoundingClientRect();
        if (r.left < box.left - 0.5 || r.right > box.right + 0.5 ||
            r.top < box.top - 0.5 || r.bottom > box.bottom + 0.5)
          out.spills.push(title + ": " + t.textContent);
        labels.push([t.textContent, r]);
      });
      for (var a = 0; a < labels.length; a++)
        for (var b = a + 1; b < labels.length; b++) {
          var p = labels[a][1], q = labels[b][1];
          if (p.left < q.right && q.left < p.right && p.top < q.bottom && q.top < p.bottom)
            out.overlaps.push(title + ": " + labels[a][0] + " / " + labels[b][0]);
        }
    });
  } catch (e) { out.errors.push(String(e)); }
  var pre = document.createElement("pre");
  pre.id = "check-result";
  pre.textContent = JSON.stringify(out);
  document.body.appendChild(pre);
});
</script>"""


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    """A 6-iteration PPO run on the nano preset with a gold reward, the reference's
    answers and a monitor that fires every iteration, beside a demo summary and a compare
    table; its report.html."""
    if BROWSER is None:
        if os.environ.get("CI") == "true":
            pytest.fail("CI=true but no chromium: .ci/run installs it (apt-get install chromium)")
        pytest.skip("no chromium on PATH (Debian: apt-get install chromium); CI installs it")
    root = tmp_path_factory.mktemp("browser")
    base = {
        "device": "cpu",
        "model": {"policy": "preset:nano", "value_model": "shared"},
        "reward": {"functions": {"rlhflab.builtin.toy_rewards:vowel_reward": 1.0}},
        "rollout": {"prompts_per_iteration": 8, "max_new_tokens": 8},
        "ppo": {"iterations": 6, "epochs": 1, "lr": 1e-3},
        "log": {"output_dir": str(root / "run"), "progress": False, "sample_every": 2},
        "monitor": {
            "gold": "rlhflab.builtin.toy_rewards:vowel_reward",
            "entropy_ratio": 10,  # an alert every iteration: bands and a threshold drawn
            "phrases": ["Great question", "这是一个很好的问题"],
        },
    }
    PPOTrainer(load_config(base=base)).fit()
    evaluated = {"gold": 0.31, "proxy": 0.32, "accuracy": 0.5, "kl_to_reference": 0.4}
    summary = {"sft": evaluated, "ppo": evaluated, "ppo_best": evaluated}
    (root / "summary.json").write_text(json.dumps(summary))
    row = {"gold": 0.3, "proxy": 0.3, "kl_to_reference": 1.2, "wall_s": 35.4, "peak_mib": 612.0}
    (root / "compare.json").write_text(
        json.dumps({"rows": [{"method": "ppo", **row, "models": 4}]})
    )
    return build_report(root / "run")


def _chromium(*args: str, timeout: int = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [BROWSER, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.mark.parametrize("width", WIDTHS)
def test_report_lays_out_in_a_real_browser(report, width, tmp_path):
    page = tmp_path / "checked.html"
    page.write_text(
        report.read_text(encoding="utf-8").replace("</body>", CHECK + "</body>"), "utf-8"
    )
    done = _chromium(
        f"--window-size={width},1000",
        "--virtual-time-budget=3000",
        f"--user-data-dir={tmp_path / 'profile'}",
        "--enable-logging=stderr",
        "--v=0",
        "--dump-dom",
        page.as_uri(),
    )
    found = re.search(r'<pre id="check-result">(.*?)</pre>', done.stdout, re.S)
    assert found, f"chromium printed no result (rc {done.returncode}): {done.stderr[-2000:]}"
    out = json.loads(html.unescape(found.group(1)))
    assert out["errors"] == []
    assert out["innerWidth"] == width
    assert out["scrollWidth"] <= width, "the page scrolls sideways"
    assert out["resources"] == [], "the report fetched something"
    assert len(out["legends"]) >= 20
    for chart in out["legends"]:
        assert chart["pairs"], chart["title"]
        for swatch, line in chart["pairs"]:
            assert swatch == line, chart["title"]  # the legend shows the line's own colour
        colours = [line for _, line in chart["pairs"]]
        assert len(set(colours)) == len(colours), chart["title"]
    assert out["spills"] == [] and out["overlaps"] == []
    console = [ln for ln in done.stderr.splitlines() if ":CONSOLE" in ln]
    assert console == [], console

    # screenshots for a person to look at
    shot = report.with_name(f"report-{width}.png")
    _chromium(
        f"--window-size={width},2400",
        f"--user-data-dir={tmp_path / 'profile2'}",
        f"--screenshot={shot}",
        report.as_uri(),
    )
    assert shot.is_file() and shot.stat().st_size > 10_000
    keep = os.environ.get("RLHFLAB_REPORT_SHOTS")
    if keep:
        os.makedirs(keep, exist_ok=True)
        shutil.copy(shot, keep)
        shutil.copy(report, os.path.join(keep, "report.html"))
