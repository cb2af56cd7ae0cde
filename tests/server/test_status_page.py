"""The status page at `/` in a real browser: headless Chromium driven by Selenium.

It must list the three models with their states, and after requests the timeline must show a swap.
The network is closed here: Chromium runs with everything that phones home switched off and a fresh
profile. Skipped (with the reason) only where /usr/bin/chromium is absent; `.ci/run` installs it.
"""
import os
import shutil

import httpx
import pytest
from serve_helpers import ServerProcess, write_checkpoints

pytestmark = pytest.mark.timeout(300)

CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = shutil.which("chromedriver") or "/usr/bin/chromedriver"


def text(browser, selector: str) -> str:
    """The rendered text of the element ``selector`` finds, read in one script call: the page redraws its
    rows as it polls, so an element found by one WebDriver call may be gone by the next."""
    return browser.execute_script("const e = document.querySelector(arguments[0]); "
                                  "return e === null ? null : e.innerText.trim();", selector)


@pytest.fixture
def browser(tmp_path):
    if not os.path.exists(CHROMIUM):
        pytest.skip(f"{CHROMIUM} is absent: install Debian's chromium and chromium-driver (.ci/run does)")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for flag in ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync",
                 "--disable-dev-shm-usage", "--window-size=1400,900", f"--user-data-dir={tmp_path / 'profile'}"):
        opts.add_argument(flag)
    driver = webdriver.Chrome(service=Service(executable_path=CHROMEDRIVER, log_output=str(tmp_path / "driver.log")),
                              options=opts)
    try:
        yield driver
    finally:
        driver.quit()


def test_status_page_shows_models_and_a_swap_in_the_timeline(browser, tmp_path):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait
    ckpts = write_checkpoints(str(tmp_path / "ckpt"), n=3)
    srv = ServerProcess(str(tmp_path), ckpts, engine={"max_loaded": 1})
    try:
        browser.get(srv.url + "/")
        from selenium.common.exceptions import StaleElementReferenceException
        wait = WebDriverWait(browser, 60, ignored_exceptions=(StaleElementReferenceException,))  # redrawn rows
        wait.until(lambda d: len(d.find_elements(By.CSS_SELECTOR, "tr.model-row")) == 3)
        models = browser.execute_script(
            "return [...document.querySelectorAll('tr.model-row')].map(r => r.dataset.model)")
        assert set(models) == {"m0", "m1", "m2"}
        assert all(text(browser, f"tr[data-model='{m}'] .state") == "host" for m in models)
        assert browser.find_element(By.ID, "engine-state").text == "serving"
        for m in ("m0", "m1", "m2", "m0"):  # max_loaded=1: every request swaps
            r = httpx.post(srv.url + "/v1/completions", json={"model": m, "prompt": "hello", "max_tokens": 4,
                                                              "temperature": 0}, timeout=120)
            assert r.status_code == 200, r.text
        # the page polls: wait until the swaps and the batches are drawn
        wait.until(lambda d: {e.get_attribute("data-model") for e in d.find_elements(
            By.CSS_SELECTOR, "#lanes .ev-load")} == {"m0", "m1", "m2"})
        wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, "#lanes .ev-offload[data-model='m1']"))
        wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, "#lanes .ev-step, #lanes .ev-batch"))
        wait.until(lambda d: text(d, "tr[data-model='m0'] .state") == "resident")
        last_load = text(browser, "tr[data-model='m0'] .last-load")
        assert "GB/s" in last_load and "ms" in last_load, last_load
        assert text(browser, "tr[data-model='m1'] .state") == "host"
        assert "never" not in text(browser, "tr[data-model='m1'] .last-offload")
        assert browser.find_elements(By.CSS_SELECTOR, "#swaps .swap-line[data-kind='load']")
        shot = tmp_path / "status_page.png"
        assert browser.save_screenshot(str(shot)) and shot.stat().st_size > 1000
    finally:
        rc, alive = srv.stop()
    assert rc == 0 and not alive
