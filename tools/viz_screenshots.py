"""Make docs/pictures.md's pictures of the viewers, and measure the 1,000-op player.

    python3 tools/viz_screenshots.py            # writes docs/viz-*.png
    python3 tools/viz_screenshots.py --measure  # size and step latency of a 1,000-op player

The terminal viewer is driven by Textual's pilot and saved as SVG (Textual's
screenshot), then rasterised by headless Chromium; the HTML player is opened in
headless Chromium. Needs Debian's chromium and chromium-driver, and selenium.
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests" / "viz"))

from kvref.viz.app import KVViewer  # noqa: E402
from kvref.viz.html_player import write_player  # noqa: E402
from kvref.viz.player import TracePlayer, read_trace  # noqa: E402

DOCS = ROOT / "docs"
TRACES = ROOT / "tests" / "viz" / "traces"
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
         "--disable-component-update", "--disable-sync", "--no-first-run"]


def chromium_png(page: Path, out: Path, width: int, height: int) -> None:
    profile = tempfile.mkdtemp(prefix="kvref-shot-")
    try:
        subprocess.run(["chromium", *FLAGS, f"--user-data-dir={profile}",
                        "--hide-scrollbars", f"--window-size={width},{height}",
                        f"--screenshot={out}", page.as_uri()],
                       check=True, capture_output=True, timeout=120)
    finally:
        shutil.rmtree(profile, ignore_errors=True)


def terminal(size: tuple[int, int], keys: list[str], name: str, pixels: tuple[int, int]):
    async def main():
        app = KVViewer(TracePlayer(read_trace(TRACES / "kvref-multi-turn.json.gz")))
        async with app.run_test(size=size) as pilot:
            await pilot.pause()
            await pilot.press(*keys)
            await pilot.pause()
            svg = Path(tempfile.mkdtemp()) / f"{name}.svg"
            app.save_screenshot(str(svg))
        return svg
    svg = asyncio.run(main())
    chromium_png(svg, DOCS / f"{name}.png", *pixels)


def browser_shot(name: str) -> None:
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
    from selenium.webdriver.common.action_chains import ActionChains
    from selenium.webdriver.common.by import By

    page = Path(tempfile.mkdtemp()) / "pressure.html"
    write_player(read_trace(TRACES / "kvref-pressure.json.gz"), str(page))
    options = webdriver.ChromeOptions()
    options.binary_location = shutil.which("chromium")
    for flag in FLAGS + [f"--user-data-dir={tempfile.mkdtemp()}", "--window-size=1400,1050",
                         "--hide-scrollbars"]:
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(shutil.which("chromedriver")), options=options)
    try:
        driver.get(page.as_uri())
        body = driver.find_element(By.TAG_NAME, "body")
        body.send_keys(*"n" * 17, "c")
        held = driver.find_elements(By.CSS_SELECTOR,
                                    "#grid .cell.s-used_cached, #grid .cell.s-used")
        cell = max(held, key=lambda c: int(c.get_attribute("data-ref")))
        ActionChains(driver).move_to_element(cell).perform()
        driver.save_screenshot(str(DOCS / f"{name}.png"))
    finally:
        driver.quit()


def measure() -> None:
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    from helpers import long_pressure_trace

    trace = long_pressure_trace()
    page = Path(tempfile.mkdtemp()) / "long.html"
    size = write_player(trace, str(page))
    options = webdriver.ChromeOptions()
    options.binary_location = shutil.which("chromium")
    for flag in FLAGS + [f"--user-data-dir={tempfile.mkdtemp()}", "--window-size=1400,1000"]:
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(shutil.which("chromedriver")), options=options)
    try:
        driver.get(page.as_uri())
        load = driver.execute_script(
            "const t = performance.getEntriesByType('navigation')[0];"
            "return t.loadEventEnd - t.startTime;")
        times = driver.execute_script("""
            const p = window.kvPlayer, n = p.data.ops.length, out = {};
            let t = performance.now();
            for (let k = 0; k < n; k++) p.go(k);
            out.forward = (performance.now() - t) / n;
            t = performance.now();
            for (let k = n - 1; k >= 0; k--) p.go(k);
            out.backward = (performance.now() - t) / n;
            t = performance.now();
            for (let i = 0; i < 200; i++) p.go((i * 389) % n);
            out.random = (performance.now() - t) / 200;
            return out;""")
    finally:
        driver.quit()
    print(f"{len(trace['ops'])} ops, {len(TracePlayer(trace).steps)} steps: "
          f"player.html {size / 1000:.0f} kB; page load {load:.0f} ms; per op drawn: "
          f"forward {times['forward']:.2f} ms, backward {times['backward']:.2f} ms, "
          f"random jumps {times['random']:.2f} ms")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--measure", action="store_true")
    if parser.parse_args().measure:
        measure()
    else:
        terminal((80, 24), ["n"] * 5 + ["b", "1", "enter"], "viz-terminal-80x24", (820, 580))
        terminal((160, 50), ["n"] * 5 + ["r", "b", "2", "enter"], "viz-terminal-160x50",
                 (1560, 1120))
        browser_shot("viz-player")
        print("wrote", ", ".join(str(p.relative_to(ROOT)) for p in sorted(DOCS.glob("viz-*.png"))))
