"""The HTML player in a real headless Chromium (Debian's, driven by Selenium).

For a hybrid trace (full attention + sliding window) and a pressure trace
(evictions, preemptions): keys and the sliders move to the right op, and the
page then shows the block states, ref counts, free-queue order and hovered
block details that kvref's manager holds at that op. No console error, no
network request. `.ci/run` installs Chromium (apt-get) and Selenium (the
[test] extra); without Chromium these tests skip and say why.
"""

import json
import os
import shutil
import tempfile
from pathlib import Path

import pytest

from kvref.viz.details import block_details
from kvref.viz.html_player import write_player
from kvref.viz.player import TracePlayer, read_trace
from kvref.viz.pool import block_state

from .helpers import long_pressure_trace

TRACES = Path(__file__).parent / "traces"
CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
DRIVER = shutil.which("chromedriver") or "/usr/bin/chromedriver"
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
         "--disable-component-update", "--disable-sync", "--no-first-run",
         "--window-size=1400,1000"]


@pytest.fixture(scope="module")
def browser():
    webdriver = pytest.importorskip("selenium.webdriver",
                                    reason="selenium is missing: pip install -e '.[test]'")
    from selenium.webdriver.chrome.service import Service

    if not (os.path.exists(CHROMIUM) and os.path.exists(DRIVER)):
        pytest.skip(os.environ.get("KVREF_NO_CHROMIUM") or
                    "Chromium is not installed here (.ci/run installs it: apt-get install "
                    "chromium chromium-driver)")
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    profile = tempfile.mkdtemp(prefix="kvref-chromium-")
    for flag in FLAGS + [f"--user-data-dir={profile}"]:
        options.add_argument(flag)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL", "performance": "ALL"})
    driver = webdriver.Chrome(service=Service(DRIVER), options=options)
    try:
        yield driver
    finally:
        driver.quit()
        shutil.rmtree(profile, ignore_errors=True)


def console_errors(driver) -> list[str]:
    return [e["message"] for e in driver.get_log("browser") if e["level"] == "SEVERE"]


def requested_urls(driver) -> list[tuple[str, str]]:
    """(URL, the document asking) of every request since the last call."""
    urls = []
    for entry in driver.get_log("performance"):
        message = json.loads(entry["message"])["message"]
        if message["method"] == "Network.requestWillBeSent":
            params = message["params"]
            urls.append((params["request"]["url"], params.get("documentURL", "")))
    return urls


def assert_nothing_left_the_page(driver, page: Path) -> None:
    """The page asked for nothing but itself, and nothing at all went to the network
    (Chromium's own chrome:// pages, e.g. its new-tab page, are not the page's)."""
    requests = requested_urls(driver)
    assert [url for url, doc in requests if doc == page.as_uri()] == [page.as_uri()]
    assert [url for url, _ in requests if url.split(":")[0] in ("http", "https", "ws", "wss",
                                                               "ftp")] == []


def open_page(driver, path: Path) -> None:
    driver.get(path.as_uri())
    driver.execute_script("return window.kvPlayer !== undefined") or pytest.fail("no player")


def shown(driver) -> dict:
    return driver.execute_script("""
        const cells = [...document.querySelectorAll('#grid .cell')];
        return {op: +document.getElementById('pos').dataset.op,
                cells: cells.map(c => [c.dataset.state, +c.dataset.ref]),
                queue: [...document.querySelectorAll('#queue .fq')].map(q => +q.dataset.block),
                text: document.getElementById('pos').textContent};""")


def assert_shows_the_manager(driver, reference: TracePlayer, op: int) -> None:
    reference.seek_op(op)
    page = shown(driver)
    assert page["op"] == op
    pool = reference.manager.block_pool
    assert [s for s, _ in page["cells"]] == [block_state(b) for b in pool.blocks], op
    # The null block's ref count is not kept (by vLLM either), so it is not shown.
    assert [r for _, r in page["cells"][1:]] == [b.ref_cnt for b in pool.blocks[1:]], op
    assert page["queue"] == [b.block_id for b in pool.free_block_queue.get_all_free_blocks()]
    assert f"step {reference.current_step}/{len(reference.steps) - 1}, op {op}/" in page["text"]


def hover_and_compare(driver, reference: TracePlayer, holds) -> bool:
    """Hover the first block that ``holds``; the card must be ``block_details``' lines."""
    from selenium.webdriver.common.action_chains import ActionChains
    from selenium.webdriver.common.by import By

    block = next((b for b in reference.manager.block_pool.blocks if not b.is_null and holds(b)),
                 None)
    if block is None:
        return False
    cell = driver.find_element(By.CSS_SELECTOR, f'#grid .cell[data-block="{block.block_id}"]')
    ActionChains(driver).move_to_element(cell).perform()
    card = driver.find_element(By.ID, "details").text
    assert card.splitlines() == block_details(reference, block.block_id).lines()
    return True


@pytest.mark.parametrize("name", ["hybrid", "pressure"])
def test_keys_and_sliders_show_the_managers_state(browser, name, tmp_path):
    from selenium.webdriver.common.action_chains import ActionChains
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys

    trace = read_trace(TRACES / f"kvref-{name}.json.gz")
    path = tmp_path / "player.html"
    write_player(trace, str(path))
    requested_urls(browser)                 # drop what earlier pages asked for
    open_page(browser, path)
    reference = TracePlayer(trace)
    ends = [end - 1 for _, end in reference.steps]
    assert_shows_the_manager(browser, reference, ends[0])
    body = browser.find_element(By.TAG_NAME, "body")
    last = len(trace["ops"]) - 1
    moves = [("n", ends[1]), ("n", ends[2]), ("n", ends[3]), ("p", ends[2]),
             (".", ends[2] + 1), (".", ends[2] + 2), (",", ends[2] + 1),
             (Keys.ARROW_RIGHT, ends[2] + 2), (Keys.END, last), (Keys.ARROW_LEFT, last - 1),
             ("p", ends[-2]), (Keys.PAGE_DOWN, ends[-1]), (Keys.HOME, 0)]
    for key, op in moves:
        body.send_keys(key)
        assert_shows_the_manager(browser, reference, op)
    # The op slider, moved with the keyboard as a user would; then the step slider.
    slider = browser.find_element(By.ID, "op-slider")
    slider.send_keys(Keys.ARROW_RIGHT)
    assert_shows_the_manager(browser, reference, 1)
    for _ in range(3):
        browser.find_element(By.ID, "step-slider").send_keys(Keys.ARROW_RIGHT)
    assert_shows_the_manager(browser, reference, ends[3])
    browser.find_element(By.ID, "step-slider").send_keys(Keys.END)
    assert_shows_the_manager(browser, reference, ends[-1])
    # Hover details at a few ops: a shared block, a free cached one, a free empty one.
    hovered = 0
    for op in (ends[len(ends) // 3], ends[len(ends) // 2], ends[2 * len(ends) // 3]):
        browser.execute_script("window.kvPlayer.go(arguments[0])", op)
        reference.seek_op(op)
        for holds in (lambda b: b.ref_cnt > 1, lambda b: b.ref_cnt == 0 and b.block_hash,
                      lambda b: b.ref_cnt == 1 and b.block_hash is None):
            hovered += hover_and_compare(browser, reference, holds)
    assert hovered >= 5
    # A click keeps a block's details when the mouse leaves it.
    cell = browser.find_element(By.CSS_SELECTOR, '#grid .cell[data-block="3"]')
    ActionChains(browser).click(cell).move_to_element(
        browser.find_element(By.ID, "pos")).perform()
    assert browser.find_element(By.ID, "details").text.splitlines() == \
        block_details(reference, 3).lines()
    body.send_keys(Keys.ESCAPE)
    # Jumps and the request search ask with a prompt, as the terminal's g, o and / do.
    ActionChains(browser).move_to_element(browser.find_element(By.ID, "pos")).perform()
    for key, answer, op in (("o", "100", 100), ("g", "5", ends[5])):
        body.send_keys(key)
        alert = browser.switch_to.alert
        alert.send_keys(answer)
        alert.accept()
        assert_shows_the_manager(browser, reference, op)
    rid = next(r for r, q in reference.requests.items() if any(reference.manager.get_block_ids(r)))
    body.send_keys("/")
    alert = browser.switch_to.alert
    alert.send_keys(rid)
    alert.accept()
    card = browser.find_element(By.ID, "details").text
    req = reference.requests[rid]
    assert card.startswith(f"request {rid}: {req.status.name.lower()}, "
                           f"{req.num_computed_tokens}/{req.num_tokens} tokens computed")
    body.send_keys(Keys.ESCAPE)
    # Colour by request: every held cell gets a colour; states stay.
    body.send_keys("c")
    assert browser.execute_script(
        "return [...document.querySelectorAll('#grid .cell.held')].every(c => c.style.background)")
    assert_shows_the_manager(browser, reference, ends[5])
    assert console_errors(browser) == []
    assert_nothing_left_the_page(browser, path)


def test_a_thousand_op_player_opens_and_steps_across_key_frames(browser, tmp_path):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys

    trace = long_pressure_trace()
    assert len(trace["ops"]) >= 1000
    path = tmp_path / "long.html"
    size = write_player(trace, str(path))
    assert size < 1_000_000            # deltas: a few hundred kB, not one state per op
    requested_urls(browser)
    open_page(browser, path)
    reference = TracePlayer(trace)
    body = browser.find_element(By.TAG_NAME, "body")
    body.send_keys(Keys.END)
    last = len(trace["ops"]) - 1
    assert_shows_the_manager(browser, reference, last)
    for k in range(1, 70):                 # back over a key frame boundary, op by op
        body.send_keys(",")
    assert_shows_the_manager(browser, reference, last - 69)
    browser.execute_script("window.kvPlayer.go(arguments[0])", 517)
    assert_shows_the_manager(browser, reference, 517)
    assert console_errors(browser) == []
    assert_nothing_left_the_page(browser, path)


def test_the_checks_would_see_an_error_and_a_request(browser, tmp_path):
    """The two detectors above are not blind: a page that throws and fetches is caught."""
    page = tmp_path / "bad.html"
    page.write_text("<!DOCTYPE html><img src='http://127.0.0.1:9/x.png'>"
                    "<script>throw new Error('boom')</script>")
    requested_urls(browser)
    browser.get(page.as_uri())
    assert any("boom" in m for m in console_errors(browser))
    assert ("http://127.0.0.1:9/x.png", page.as_uri()) in requested_urls(browser)


def test_the_notebook_player_runs_inside_its_iframe(browser, tmp_path):
    """What a notebook shows for ``Player(trace)``: the page in a sandboxed iframe,
    its script running there, its keys moving it."""
    from selenium.webdriver.common.by import By

    from kvref.viz.html_player import Player

    trace = read_trace(TRACES / "kvref-sliding-window.json.gz")
    page = tmp_path / "notebook.html"
    page.write_text("<!DOCTYPE html><html><body><div class='output'>"
                    + Player(trace, start_op=10)._repr_html_() + "</div></body></html>")
    requested_urls(browser)
    browser.get(page.as_uri())
    browser.switch_to.frame(browser.find_element(By.TAG_NAME, "iframe"))
    try:
        reference = TracePlayer(trace)
        assert_shows_the_manager(browser, reference, 10)
        # As in a notebook: click into the player, then type.
        from selenium.webdriver.common.action_chains import ActionChains
        ActionChains(browser).click(browser.find_element(By.ID, "narration")).send_keys("n") \
            .perform()
        assert_shows_the_manager(browser, reference,
                                 reference.steps[reference.step_of(10) + 1][1] - 1)
    finally:
        browser.switch_to.default_content()
    assert console_errors(browser) == []
