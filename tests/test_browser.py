"""The app in a real browser: ``streamlit run`` in a subprocess, Debian's Chromium driven by
Playwright through model → run → ranges → scales → error → overview → export. Asserts that the
plots rendered and that no exception box appeared; screenshots go to ``test-artifacts/``."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import zipfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from helpers import free_port, save_checkpoint, tiny_llama, wait_healthy
from playwright.sync_api import TimeoutError as PlaywrightTimeoutError
from playwright.sync_api import expect

ROOT = Path(__file__).resolve().parents[1]
ARTIFACTS = ROOT / "test-artifacts"
LAYER_REGEX = r"re:encoder\.layer\.0\.attention\.self\.(query|key|value)$"  # one fused unit
SLOW_MS = 240_000
TOKEN = "browser-tests-token-0123456789"
"""The servers' token (a token file), so each tab signs in as a person opening the printed address does."""
SESSION_TTL_S = 2
"""Streamlit's reconnect window for the test servers: a closed tab's session ends this soon."""
UNSEEN_RUN_MS = 20_000
"""How long ``_settle`` waits to see the rerun an action started finish; a rerun so short that the
page never showed it running has finished by then, and the app being idle is what the caller needs
(a slow rerun shows as running and is waited for to the end)."""
RUN_COUNTER = """
window.__finishedRuns = 0;
new MutationObserver((records) => {
  records.forEach((record, i) => {
    const next = records.slice(i + 1).find((later) => later.target === record.target);
    const now = next ? next.oldValue : record.target.getAttribute("data-test-script-state");
    if (now === "notRunning" && record.oldValue !== "notRunning") window.__finishedRuns += 1;
  });
}).observe(document, {subtree: true, attributes: true, attributeOldValue: true,
                      attributeFilter: ["data-test-script-state"]});
"""
"""Counts the script runs the tab has seen finish: Streamlit's root element carries the run state
(``data-test-script-state``: initial, running, notRunning, ...), and each change to notRunning is
one run over. Installed before the app loads, so no run is missed however short."""
IDLE = """(after) => window.__finishedRuns > after &&
  document.querySelector('[data-testid="stApp"]')?.getAttribute("data-test-script-state") === "notRunning"
"""

pytestmark = [pytest.mark.browser, pytest.mark.slow]


@contextmanager
def _served_app(base: Path, name: str, *flags: str, started: list | None = None) -> Iterator[str]:
    """``bash scripts/app.sh`` as a team's server runs it (``python -m lab.serve``, loopback by the
    project config, signed in with a token: ``TOKEN``, from a token file) on a free port, with the
    test run's temporary folder as data and model root, an output root of its own, a short reconnect
    window and its own temporary folder (where the sessions' upload folders go); the log goes to
    ``test-artifacts/<name>.log``. ``started`` gets the server's process (to read its CPU time)."""
    port = free_port()
    outputs, tmp = base / f"{name}-outputs", base / f"{name}-tmp"
    outputs.mkdir(exist_ok=True)
    tmp.mkdir(exist_ok=True)
    (base / "token").write_text(TOKEN)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TMPDIR": str(tmp)}
    command = [sys.executable, "-m", "lab.serve", "--server.headless", "true", "--server.port", str(port)]
    command += ["--browser.gatherUsageStats", "false", "--server.disconnectedSessionTTL", str(SESSION_TTL_S)]
    command += ["--data-root", str(base), "--model-root", str(base), "--output-root", str(outputs), *flags]
    command += ["--token-file", str(base / "token")]
    ARTIFACTS.mkdir(exist_ok=True)
    log = (ARTIFACTS / f"{name}.log").open("w")
    server = subprocess.Popen(command, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    if started is not None:
        started.append(server)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, server)
        yield url
    finally:
        server.terminate()
        try:
            server.wait(timeout=20)
        except subprocess.TimeoutExpired:
            server.kill()
        log.close()


@pytest.fixture(scope="module")
def served_base(tmp_path_factory) -> Path:
    return tmp_path_factory.getbasetemp()


@pytest.fixture(scope="module")
def app_url(served_base) -> Iterator[str]:
    with _served_app(served_base, "streamlit") as url:
        yield url


@pytest.fixture
def page(browser, app_url):
    """A new tab, so a new Streamlit session: each test starts from the app's defaults, as a
    person opening the app does."""
    tab = browser.new_page(viewport={"width": 1400, "height": 1000})
    tab.add_init_script(RUN_COUNTER)
    _sign_in(tab, app_url)
    yield tab
    tab.close()


def _sign_in(tab, url: str) -> None:
    """Open the app at ``url`` as a person given the server's printed address does: with its token."""
    tab.goto(f"{url}/?token={TOKEN}")
    tab.get_by_text("Observer Lab").first.wait_for(timeout=SLOW_MS)


def _go(tab, title: str) -> None:
    """Open the page ``title`` and wait until its script run is over."""
    tab.locator('[data-testid="stSidebarNav"]').get_by_text(title, exact=True).click()
    tab.get_by_role("heading", name=title, exact=True).first.wait_for(timeout=SLOW_MS)
    _settle(tab)


def _runs(tab) -> int:
    """How many script runs the tab has seen finish (``RUN_COUNTER``)."""
    return tab.evaluate("window.__finishedRuns")


def _settle(tab, after: int = -1) -> None:
    """Wait until the app is not running a script (a click while a run is still going can be
    answered with the widget values of before that run).

    After an action that reruns the script, pass ``after=_runs(tab)`` read before the action: its
    rerun may not have started yet when this is called, and the app idle before it must not count.
    Without ``after``, the caller knows the run it waits for has started (what it drew is on screen)."""
    try:
        tab.wait_for_function(IDLE, arg=after, timeout=UNSEEN_RUN_MS)
    except PlaywrightTimeoutError:  # a rerun too short to show in the run-state attribute is over too
        tab.wait_for_function(IDLE, arg=-1, timeout=SLOW_MS)


def _see(tab, text: str) -> None:
    """Wait for ``text`` (drawn by the run that follows the last action), then for that run to end."""
    _wait_visible(tab, tab.get_by_text(text).first, repr(text))
    _settle(tab)


def _wait_visible(tab, locator, what: str) -> None:
    """Wait for ``locator``; when it never shows, fail with what the page shows instead (its error
    and exception boxes, the ticked boxes and the end of its text) and a screenshot, so a failure
    on CI says why without a rerun (a failure that said only "Timeout" took a session to explain:
    the "What to analyse" boxes had come back unticked, see ``lab.ui.bound``)."""
    try:
        locator.wait_for(timeout=SLOW_MS)
    except PlaywrightTimeoutError:
        _shot(tab, "failed")
        raise AssertionError(f"{what} did not show within {SLOW_MS // 1000} s; {_page_state(tab)}") from None


def _page_state(tab) -> str:
    """The page as a person would read it, for a failure message."""
    boxes = tab.locator('[data-testid="stException"], [data-testid="stAlertContentError"]').all_inner_texts()
    ticked = [
        f"{box.inner_text().strip()}={'on' if box.locator('input').is_checked() else 'off'}"
        for box in tab.locator('[data-testid="stCheckbox"]').all()
    ]
    state = tab.locator('[data-testid="stApp"]').get_attribute("data-test-script-state")
    text = " ".join(tab.locator('[data-testid="stMain"]').inner_text().split())
    return (
        f"script {state}, {_runs(tab)} run(s) seen; errors: {boxes}; checkboxes: {ticked}; "
        f"page text ends: ...{text[-1500:]}"
    )


def _shot(tab, name: str) -> None:
    tab.screenshot(path=str(ARTIFACTS / f"{name}.png"), full_page=True)


def _no_exception(tab) -> None:
    assert tab.locator('[data-testid="stException"]').count() == 0
    assert tab.locator('[data-testid="stAlertContentError"]').count() == 0


def _plots(tab, at_least: int = 1) -> int:
    tab.locator(".js-plotly-plot").nth(at_least - 1).wait_for(timeout=SLOW_MS)
    return tab.locator(".js-plotly-plot").count()


def _fill(tab, label: str, value: str) -> None:
    """Type into the box labelled ``label`` and press Enter, waiting as long as a slow rerun may
    take for the box and, when the value changed, for the rerun it starts to end (on a busy 2-core
    CI machine a rerun that reruns a capture can take longer than 30 s)."""
    box = tab.get_by_label(label, exact=True)
    _wait_visible(tab, box, f"the box {label!r}")
    changed = box.input_value(timeout=SLOW_MS) != value
    runs = _runs(tab)
    box.fill(value, timeout=SLOW_MS)
    box.press("Enter")
    if not changed:
        return
    _settle(tab, after=runs)
    if box.input_value() != value:  # a rerun still under way when it was typed reset the box: type it again
        runs = _runs(tab)
        box.fill(value, timeout=SLOW_MS)
        box.press("Enter")
        _settle(tab, after=runs)


def _pick_layers(tab, pattern: str, count: int) -> None:
    """On the Model page: select exactly the ``count`` layers ``pattern`` matches, and a small
    calibration set (4 samples of 32 tokens)."""
    _fill(tab, "Filter (glob like `*.dense`, `re:` for a regex, or a word)", pattern)
    _see(tab, f"Select all {count} shown")
    tab.get_by_role("button", name="Clear selection").click()
    _see(tab, "0 layer(s) selected.")
    tab.get_by_role("button", name=f"Select all {count} shown").click()
    _see(tab, f"{count} layer(s) selected.")
    _fill(tab, "Samples", "4")
    _fill(tab, "Sequence length (tokens)", "32")
    expect(tab.get_by_label("Samples", exact=True)).to_have_value("4")
    expect(tab.get_by_label("Sequence length (tokens)", exact=True)).to_have_value("32")


def test_model_run_ranges_export_in_a_browser(page):
    tab = page
    _see(tab, "Go to Model")
    _shot(tab, "0_home")

    _go(tab, "Model")
    tab.get_by_text("Layers to analyse").wait_for(timeout=SLOW_MS)
    _pick_layers(tab, LAYER_REGEX, 3)
    _no_exception(tab)
    _shot(tab, "1_model")

    _go(tab, "Run")
    tab.get_by_role("button", name="Run", exact=True).click()
    _see(tab, "Results for 6 tensors")
    _no_exception(tab)
    _shot(tab, "2_run")

    for title, shot, minimum in (
        ("Ranges", "3_ranges", 2),
        ("Scales", "4_scales", 1),
        ("Error", "5_error", 2),
        ("Overview", "6_overview", 1),
    ):
        _go(tab, title)
        assert _plots(tab, minimum) >= minimum
        _no_exception(tab)
        _shot(tab, shot)

    _go(tab, "Choose & export")
    tab.get_by_role("button", name="Observer Lab JSON").wait_for(timeout=SLOW_MS)
    tab.get_by_role("button", name="compressed-tensors (zip)").wait_for(timeout=SLOW_MS)
    assert tab.get_by_role("button", name="compressed-tensors (zip)").count() == 1
    _no_exception(tab)
    _shot(tab, "7_export")


def _choose(tab, label: str, option: str) -> None:
    """Pick ``option`` (not the one shown) in the Streamlit select box labelled ``label`` and wait
    for the rerun it starts to end."""
    runs = _runs(tab)
    tab.get_by_label(label, exact=True).filter(visible=True).click()
    tab.get_by_role("option", name=option, exact=True).click()
    _settle(tab, after=runs)


def test_kv_cache_states_in_a_browser(page):
    tab = page
    _go(tab, "Model")
    tab.get_by_text("tiny-llama (built-in decoder sample)").click()
    _see(tab, "Key/value states (KV cache)")
    tab.get_by_text("Key/value states (KV cache)").click()
    _see(tab, "Attention blocks (keys and values per head, as the KV cache holds them)")
    runs = _runs(tab)
    tab.get_by_text("Input activations", exact=True).click()
    _settle(tab, after=runs)
    _pick_layers(tab, r"re:model\.layers\.0\.self_attn\.[qkv]_proj", 3)  # one fused unit
    _no_exception(tab)
    _shot(tab, "8_model_kv")

    _go(tab, "Run")
    tab.get_by_role("tab", name="KV cache (keys, values)").click()
    _choose(tab, "Granularity", "per head (attn_head)")
    tab.get_by_role("button", name="Run", exact=True).click()
    _see(tab, "Results for 7 tensors")  # three weights, and two blocks' keys and values
    _no_exception(tab)

    _go(tab, "Ranges")
    _choose(tab, "Layer · tensor", "model.layers.0.self_attn · k")
    _see(tab, "Per-head ranges")
    assert _plots(tab, 3) >= 3
    tab.get_by_text("Per-head ranges").scroll_into_view_if_needed()
    _no_exception(tab)
    _shot(tab, "9_ranges_kv")


def _download(tab, button: str, target: Path) -> Path:
    with tab.expect_download(timeout=SLOW_MS) as info:
        tab.get_by_role("button", name=button).click()
    info.value.save_as(str(target))
    return target


def test_demo_walk_in_a_browser(page, tmp_path):
    """What a person giving a demo does: one click on the first screen, every page, the exports,
    an import, the report, then another model chosen without re-running (issue 15)."""
    tab = page
    _go(tab, "Overview")
    tab.get_by_role("button", name="Run the demo").click()
    _see(tab, "minilm: 12 tensors")
    assert _plots(tab, 1) >= 1
    _no_exception(tab)
    _shot(tab, "10_demo_overview")

    _go(tab, "Ranges")
    _plots(tab, 2)
    _choose(tab, "Layer · tensor", "encoder.layer.0.attention.self.key · input")
    _see(tab, "Per-token vs per-channel abs-max")
    _no_exception(tab)
    for title, minimum in (("Scales", 1), ("Error", 2)):  # the input is int8 per tensor: scale bars only
        _go(tab, title)
        _plots(tab, minimum)
        box = tab.locator('[data-testid="stSelectbox"]').filter(has_text="Layer · tensor").first
        shown = box.inner_text() + " ".join(field.input_value() for field in box.locator("input").all())
        assert "encoder.layer.0.attention.self.key · input" in shown
        _no_exception(tab)
        _shot(tab, f"11_demo_{title.lower()}")

    _go(tab, "Choose & export")
    tab.get_by_role("button", name="Observer Lab JSON").wait_for(timeout=SLOW_MS)
    exported = _download(tab, "Observer Lab JSON", tmp_path / "demo.json")
    document = json.loads(exported.read_text())
    assert document["source"]["name"] == "minilm" and len(document["entries"]) == 12
    archive = _download(tab, "compressed-tensors (zip)", tmp_path / "ct.zip")
    with zipfile.ZipFile(archive) as files:
        assert {"quantization_config.json", "qparams.safetensors"} <= set(files.namelist())
    recipe = _download(tab, "Recipe (YAML)", tmp_path / "recipe.yaml").read_text()
    assert "QuantizationModifier:" in recipe and "encoder.layer.0.attention.self.key" in recipe
    tab.get_by_role("button", name="Save checkpoint").wait_for(timeout=SLOW_MS)
    _shot(tab, "12_demo_export")
    for entry in document["entries"]:
        entry["chosen"]["observer"] = "memoryless_minmax"
    changed = tmp_path / "changed.json"
    changed.write_text(json.dumps(document))
    tab.get_by_text("Import a previous export").click()
    tab.locator('input[type="file"]').set_input_files(str(changed))
    _see(tab, "Restored 12 choice(s) from changed.json.")
    again = json.loads(_download(tab, "Observer Lab JSON", tmp_path / "again.json").read_text())
    assert {e["chosen"]["observer"] for e in again["entries"]} == {"memoryless_minmax"}
    tab.get_by_role("button", name="Build HTML report").click()
    report = _download(tab, "Download HTML report", tmp_path / "report.html")
    assert "plotly" in report.read_text()[:2_000_000]
    _no_exception(tab)
    _shot(tab, "12_demo_export")

    _go(tab, "Model")
    tab.get_by_text("tiny-llama (built-in decoder sample)").click()
    _see(tab, "These results are of 'minilm'")
    _go(tab, "Choose & export")
    _see(tab, "These results are of 'minilm'")
    stale = json.loads(_download(tab, "Observer Lab JSON", tmp_path / "stale.json").read_text())
    assert stale["source"]["name"] == "minilm"
    _shot(tab, "13_demo_model_switched")


def test_moe_expert_without_tokens_exports_in_a_browser(page):
    """Issue 15.1: tiny-moe's never-routed expert 3 selected, Run, Choose & export: no
    traceback, a warning, and the export once the opt-in is ticked."""
    tab = page
    _go(tab, "Model")
    tab.get_by_text("tiny-moe (built-in MoE sample)").click()
    _see(tab, "Synthetic Mixtral-style MoE decoder")  # the caption of the model now open, not the one before
    for label in ("Weights", "Input activations"):  # the switch keeps what to analyse (it once unticked all)
        expect(tab.get_by_label(label, exact=True)).to_be_checked()
    _pick_layers(tab, "model.layers.0.mlp.experts.3", 3)
    _go(tab, "Run")
    tab.get_by_role("button", name="Run", exact=True).click()
    # the inputs' static scales are one per fused MoE kernel: every expert's gate, up and down come with it
    _see(tab, "Results for 24 tensors")
    _go(tab, "Choose & export")
    _see(tab, "saw no calibration tokens")
    assert tab.locator('[data-testid="stException"]').count() == 0
    assert tab.get_by_role("button", name="Observer Lab JSON").count() == 0
    _no_exception(tab)
    tab.get_by_text("Record them as uncalibrated (no qparams) and export the rest").click()
    tab.get_by_role("button", name="Observer Lab JSON").wait_for(timeout=SLOW_MS)
    tab.get_by_role("button", name="compressed-tensors (zip)").wait_for(timeout=SLOW_MS)
    _settle(tab)
    _no_exception(tab)
    _shot(tab, "14_moe_export")


def test_local_directory_and_knob_errors_in_a_browser(page, tmp_path):
    """Issue 15.3 and 15.8 as a person meets them: a typed directory path keeps "what to analyse"
    and the calibration settings; a knob outside its bounds is named and Run stays off."""
    directory = save_checkpoint(tiny_llama(), tmp_path / "llama")
    tab = page
    _go(tab, "Model")
    tab.get_by_text("Local directory", exact=True).click()
    _see(tab, "Enter a source to open.")
    _fill(tab, "Directory (config.json + weights)", str(directory))
    _see(tab, "Layers to analyse")
    for label in ("Weights", "Input activations"):
        assert tab.get_by_label(label, exact=True).is_checked()
    assert tab.get_by_label("Samples", exact=True).input_value() == "32"
    assert tab.get_by_label("Sequence length (tokens)", exact=True).input_value() == "128"
    _no_exception(tab)
    _shot(tab, "15_local_directory")

    _go(tab, "Run")
    _see(tab, "analysing weight, input")
    tab.get_by_text("percentile: ").first.click()
    knob = tab.get_by_role("spinbutton", name="percentile", exact=True)
    knob.fill("0")
    knob.press("Enter")
    _see(tab, "percentile.percentile must be a number in (0, 100], got 0")
    expect(tab.get_by_role("button", name="Run", exact=True)).to_be_disabled()
    _see(tab, "Run is off: fix the knob values above.")
    _shot(tab, "16_knob_error")
    runs = _runs(tab)
    knob.fill("99.9")
    knob.press("Enter")
    _settle(tab, after=runs)  # the button is there, disabled, before the rerun: wait for the rerun itself
    expect(tab.get_by_role("button", name="Run", exact=True)).to_be_enabled()
    expect(tab.get_by_text("Run is off: fix the knob values above.")).to_have_count(0)
    _no_exception(tab)


def test_calibration_set_from_a_local_path_in_a_browser(page, tmp_path):
    """Issue 24: a directory saved by datasets' save_to_disk as the calibration set (read without
    writing to datasets' cache): its preview on the Model page, then a run that says in one line
    what it calibrated on."""
    import datasets

    texts = [f"calibration record number {i}: the river runs to the sea, and the sea is wide" for i in range(6)]
    saved = tmp_path / "saved_set"
    datasets.Dataset.from_dict({"text": texts, "id": list(range(6))}).save_to_disk(str(saved))
    tab = page
    _go(tab, "Model")
    tab.get_by_text("Layers to analyse").wait_for(timeout=SLOW_MS)
    _pick_layers(tab, LAYER_REGEX, 3)
    runs = _runs(tab)
    tab.get_by_text("local path", exact=True).click()
    _settle(tab, after=runs)
    _see(tab, "Enter the path of a calibration file")
    _fill(tab, "File (.txt, .jsonl, .json, .csv, .parquet) or save_to_disk directory", str(saved))
    _see(tab, "Usable records")
    _see(tab, "Record 1: calibration record number 0")
    assert "reading text, in file order" in tab.get_by_text("Columns:").first.inner_text()
    _no_exception(tab)
    tab.get_by_text("Usable records").scroll_into_view_if_needed()
    _shot(tab, "17_model_calibration_set")

    _go(tab, "Run")
    tab.get_by_role("button", name="Run", exact=True).click()
    _see(tab, "Results for 6 tensors")
    _see(tab, "Calibrated on 4 samples")
    assert "from saved_set (fingerprint" in tab.get_by_text("Calibrated on 4 samples").first.inner_text()
    _no_exception(tab)
    _shot(tab, "18_run_calibration_set")


# ---------------------------------------------------------------- a server a team shares (issue 32)


def _listening_addresses(port: int) -> list[str]:
    """Where something listens on ``port``, from the kernel's socket table (nothing is connected to)."""
    import socket

    found = []
    for table, family in (("tcp", socket.AF_INET), ("tcp6", socket.AF_INET6)):
        for line in Path("/proc/net", table).read_text().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            address, local_port = local.split(":")
            if state == "0A" and int(local_port, 16) == port:  # 0A: LISTEN
                raw = b"".join(bytes.fromhex(address[i : i + 8])[::-1] for i in range(0, len(address), 8))
                found.append(socket.inet_ntop(family, raw))
    return found


def test_the_server_listens_on_loopback_only(app_url):
    port = int(app_url.rsplit(":", 1)[1])
    assert _listening_addresses(port) == ["127.0.0.1"]


@pytest.fixture
def outside() -> Iterator[Path]:
    """A folder outside every root the test server declared, holding what must never be shown."""
    import tempfile

    folder = Path(tempfile.mkdtemp(prefix="observer-lab-outside-", dir="/var/tmp"))
    (folder / "secret.json").write_text(json.dumps([{"text": "Record: the admin password is hunter2"}]))
    save_checkpoint(tiny_llama(), folder / "model")
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


def test_paths_outside_the_roots_are_refused_in_a_browser(page, served_base, outside):
    """A calibration file or a model directory outside the roots, typed as it is, through ``..``
    or through a symlink inside a root: one line naming the roots, and nothing of the file on the page."""
    link = served_base / "innocent-link.json"
    link.unlink(missing_ok=True)
    link.symlink_to(outside / "secret.json")
    tab = page
    _go(tab, "Model")
    tab.get_by_text("Layers to analyse").wait_for(timeout=SLOW_MS)
    runs = _runs(tab)
    tab.get_by_text("local path", exact=True).click()
    _settle(tab, after=runs)
    _see(tab, "Data roots:")
    label = "File (.txt, .jsonl, .json, .csv, .parquet) or save_to_disk directory"
    for typed in (str(outside / "secret.json"), f"{served_base}/../../../..{outside}/secret.json", str(link)):
        _fill(tab, label, typed)
        _see(tab, "is outside the data roots")
        assert "hunter2" not in tab.content() and tab.get_by_text("Usable records").count() == 0
    _shot(tab, "19_refused_calibration_path")

    tab.get_by_text("Local directory", exact=True).click()
    _fill(tab, "Directory (config.json + weights)", str(outside / "model"))
    _see(tab, "is outside the model roots")
    assert tab.get_by_text("Layers to analyse").count() == 0
    _shot(tab, "20_refused_model_directory")


def test_checkpoints_are_written_only_under_the_output_root_in_a_browser(page, served_base, outside):
    """Save checkpoint: a name escaping the output root creates nothing; a directory the lab did
    not write is never replaced, even with Replace ticked; the lab's own checkpoint is."""
    outputs = served_base / "streamlit-outputs"
    foreign = outputs / "team-notes"
    foreign.mkdir(exist_ok=True)
    (foreign / "plan.txt").write_text("keep me")
    tab = page
    _go(tab, "Overview")
    tab.get_by_role("button", name="Run the demo").click()
    _see(tab, "minilm: 12 tensors")
    _go(tab, "Choose & export")
    _see(tab, "Output root:")
    box = "Checkpoint directory"

    def save(name: str, expected: str) -> None:
        _fill(tab, box, name)
        runs = _runs(tab)
        tab.get_by_role("button", name="Save checkpoint").click()
        _settle(tab, after=runs)
        _see(tab, expected)

    save(f"../../../..{outside}/new-checkpoint", "is outside the output roots")
    assert not (outside / "new-checkpoint").exists()
    tab.get_by_text("Replace it if it is not empty").click()
    save("team-notes", "was not written by Observer Lab")
    assert sorted(p.name for p in foreign.iterdir()) == ["plan.txt"] and (foreign / "plan.txt").read_text() == "keep me"
    _shot(tab, "21_refused_checkpoint")
    save("demo-checkpoint", "packed layer(s) to")
    save("demo-checkpoint", "packed layer(s) to")  # replaced: the lab wrote it
    _no_exception(tab)
    assert (outputs / "demo-checkpoint" / "config.json").is_file()
    kept = sorted(p.name for p in outputs.iterdir() if not p.name.startswith("."))
    assert kept == ["demo-checkpoint", "runs", "team-notes"]  # runs/: the team's run history


def test_a_closed_session_leaves_no_upload_behind(browser, app_url, served_base):
    """A session's uploaded calibration file lives in its own folder, which goes once the tab is
    closed and Streamlit's reconnect window has passed."""
    sessions = served_base / "streamlit-tmp" / "observer_lab_sessions"
    before = set(sessions.glob("session-*")) if sessions.is_dir() else set()
    records = served_base / "upload-records.jsonl"
    lines = [json.dumps({"text": f"upload record {i}: the rivers run to the sea"}) for i in range(4)]
    records.write_text("\n".join(lines) + "\n")
    tab = browser.new_page(viewport={"width": 1400, "height": 1000})
    tab.add_init_script(RUN_COUNTER)
    _sign_in(tab, app_url)
    _go(tab, "Model")
    tab.get_by_text("Layers to analyse").wait_for(timeout=SLOW_MS)
    runs = _runs(tab)
    tab.get_by_text("uploaded file", exact=True).click()
    _settle(tab, after=runs)
    tab.locator('input[type="file"]').set_input_files(str(records))
    _see(tab, "Usable records")
    created = set(sessions.glob("session-*")) - before
    assert len(created) == 1 and (created.pop() / "calibration.jsonl").is_file()
    folder = next(iter(set(sessions.glob("session-*")) - before))
    tab.close()
    deadline = time.monotonic() + 60
    while folder.exists() and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not folder.exists(), "the closed session's upload folder is still there a minute later"


def test_two_sessions_share_one_computation_in_a_browser(browser, served_base):
    """Two people press "Run the demo" at once on a fresh server: one computes, the other waits for
    that computation and reads its result; both see the same analysis."""
    with _served_app(served_base, "shared") as url:
        tabs = []
        for _ in range(2):
            tab = browser.new_page(viewport={"width": 1400, "height": 1000})
            tab.add_init_script(RUN_COUNTER)
            _sign_in(tab, url)
            tab.get_by_role("button", name="Run the demo").wait_for(timeout=SLOW_MS)
            _settle(tab)
            tabs.append(tab)
        for tab in tabs:
            tab.get_by_role("button", name="Run the demo").click()
        captions = []
        for tab in tabs:
            _see(tab, "minilm: 12 tensors")
            captions.append(tab.get_by_text("minilm: 12 tensors").first.inner_text())
            _no_exception(tab)
        _shot(tabs[1], "22_shared_run")
        for tab in tabs:
            tab.close()
    computed = [c for c in captions if "reused from cache" in c]
    shared = [c for c in captions if "shared the run another session was computing" in c or "recent results" in c]
    assert len(computed) == 1 and len(shared) == 1, captions
    seconds = [c.split("computed in ", 1)[1].split(" s", 1)[0] for c in captions]
    assert seconds[0] == seconds[1]  # one analysis, computed once, read by both
