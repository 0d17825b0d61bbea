"""Chapter 15: the `/dashboard` page in a real browser (headless Chromium driven by Selenium), under a live load.

While eight streaming clients keep the engine busy, the page must show requests running and the KV block pool
coloured by the requests that hold it; once the load is over, every number on the page must equal what `/metrics`
says. Everything stays on the loopback interface; the test needs Debian's Chromium and its driver
(`apt-get install chromium chromium-driver`) and skips, saying so, without them. Set MINILLM_DASHBOARD_SCREENSHOT
to a .png path to keep a screenshot of the page under load.
"""

from __future__ import annotations

import json
import os
import re
import tempfile
import threading
import time
import urllib.request

import pytest

from minillm.bench.models import load_model
from minillm.engine import LLM, EngineConfig
from minillm.serve.app import ServeOptions, Server, ServerThread
from minillm.serve.metrics import OUTCOMES, parse_metrics

try:
    from selenium import webdriver
    from selenium.common.exceptions import TimeoutException
    from selenium.webdriver.chrome.service import Service
    from selenium.webdriver.support.ui import WebDriverWait
except ImportError:  # the dev extra brings it; without it the test skips
    webdriver = None

CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"
CLIENTS = 8  # concurrent streaming clients
MAX_TOKENS = 150  # per request, ignore_eos: every request runs to its length
WAIT_S = 20.0  # the longest any one wait on the page or the server may take

# One read of the page, atomic with respect to its refresh (JavaScript runs one task at a time).
READ_PAGE = """
const text = id => document.getElementById(id).textContent;
const outcomes = {};
for (const cell of document.querySelectorAll('[id^="outcome-"]')) outcomes[cell.id.slice(8)] = cell.textContent;
return {status: text("status"), running: text("running"), waiting: text("waiting"), swapped: text("swapped"),
        used: text("used"), gen: text("gen"), hits: text("hits"), outcomes: outcomes,
        owners: Array.from(document.querySelectorAll("#pool div"), cell => cell.dataset.owner ?? null),
        updated: document.body.dataset.updated || ""};
"""


def _browser(user_data_dir: str) -> webdriver.Chrome:
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync",
                 "--disable-dev-shm-usage", "--window-size=1280,900", f"--user-data-dir={user_data_dir}"):
        options.add_argument(flag)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})  # the console, to catch script errors
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    driver.set_page_load_timeout(WAIT_S)
    driver.set_script_timeout(WAIT_S)
    return driver


def _wait(driver: webdriver.Chrome, condition, what: str):
    """`condition(driver)` once truthy (its value), polled for at most WAIT_S; else fail showing the page."""
    try:
        return WebDriverWait(driver, WAIT_S, poll_frequency=0.05).until(condition)
    except TimeoutException:
        pytest.fail(f"the dashboard did not {what} within {WAIT_S} s: page {driver.execute_script(READ_PAGE)}, "
                    f"console {driver.get_log('browser')}")


def _metrics(url: str) -> dict[str, float]:
    with urllib.request.urlopen(url + "/metrics", timeout=WAIT_S) as response:
        return parse_metrics(response.read().decode())


def _stream(url: str, prompt: str) -> str:
    body = json.dumps({"model": "base", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
                       "ignore_eos": True, "stream": True}).encode()
    request = urllib.request.Request(url + "/v1/completions", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as response:
        return response.read().decode()


def test_dashboard_shows_live_load_and_agrees_with_metrics():
    if webdriver is None:
        pytest.skip("selenium is not installed: pip install selenium (or pip install -e '.[dev]')")
    missing = [p for p in (CHROMIUM, CHROMEDRIVER) if not os.access(p, os.X_OK)]
    if missing:
        pytest.skip(f"{' and '.join(missing)} not found: apt-get install chromium chromium-driver")

    m = load_model("base")
    server = Server(LLM(m.model, m.tokenizer, EngineConfig(num_blocks=256)), m.tokenizer,
                    ServeOptions(model_name="base"))
    seen = threading.Event()  # the page has shown the load: the clients finish the request they are in and stop
    lock = threading.Lock()
    started: list[int] = []  # one entry per request sent (the server numbers them req-0, req-1, ... as they come)
    bodies: list[str] = []
    errors: list[BaseException] = []

    def client(i: int) -> None:
        deadline = time.monotonic() + WAIT_S
        try:
            for k in range(100):  # requests one after another until the page has been seen busy (at least one)
                with lock:
                    started.append(i)
                bodies.append(_stream(t.url, f"client {i}, request {k}: once upon a time"))
                if seen.is_set() or time.monotonic() > deadline:
                    return
        except BaseException as exc:  # reported by the test thread
            errors.append(exc)

    with tempfile.TemporaryDirectory(prefix="minillm-chromium-") as profile, ServerThread(server) as t:
        driver = None
        threads = [threading.Thread(target=client, args=(i,), name=f"load-{i}", daemon=True) for i in range(CLIENTS)]
        try:
            driver = _browser(profile)
            driver.get(t.url + "/dashboard")
            _wait(driver, lambda d: d.execute_script(READ_PAGE)["status"] == "ready", "poll /dashboard/state")
            for thread in threads:
                thread.start()

            # Under load: running > 0, and the pool's coloured cells are the requests sent, one colour per request.
            def busy(d):
                page = d.execute_script(READ_PAGE)
                return page if int(page["running"] or 0) > 0 and any(page["owners"]) else False

            page = _wait(driver, busy, "show the load")
            with lock:
                sent = len(started)
            seen.set()
            if os.environ.get("MINILLM_DASHBOARD_SCREENSHOT"):
                driver.save_screenshot(os.environ["MINILLM_DASHBOARD_SCREENSHOT"])
            owners = {o for o in page["owners"] if o}
            assert owners <= {f"req-{k}.0" for k in range(sent)}, (owners, sent)
            assert len(owners) == int(page["running"]), page  # each running request holds blocks, and only they do
            assert len(page["owners"]) == 256
            used, total = page["used"].split("/")
            assert (int(used), int(total)) == (sum(1 for o in page["owners"] if o), 256), page["used"]

            for thread in threads:
                thread.join(60)
            assert not any(thread.is_alive() for thread in threads), "a load client did not finish"
            assert not errors, errors
            assert len(bodies) == len(started) and all(b.rstrip().endswith("data: [DONE]") for b in bodies)

            # Idle: the server has counted every request (an outcome is counted just after [DONE] is sent).
            n = len(bodies)
            deadline = time.monotonic() + WAIT_S
            while True:
                metrics = _metrics(t.url)
                if (metrics['minillm_requests_total{outcome="length"}'] == n
                        and metrics["minillm_num_requests_running"] == 0 and metrics["minillm_kv_blocks_used"] == 0):
                    break
                assert time.monotonic() < deadline, f"the server did not settle: {metrics}"
                time.sleep(0.05)
            assert metrics["minillm_generation_tokens_total"] == n * MAX_TOKENS

            # The page, refreshed after the load, says what /metrics says.
            gen = metrics["minillm_generation_tokens_total"]
            _wait(driver, lambda d: d.execute_script(READ_PAGE)["gen"] == f"{gen:.0f}", "catch up with /metrics")
            page, metrics = driver.execute_script(READ_PAGE), _metrics(t.url)
            assert page["status"] == "ready"
            assert float(page["gen"]) == metrics["minillm_generation_tokens_total"]
            assert set(page["outcomes"]) == set(OUTCOMES)
            for outcome, shown in page["outcomes"].items():
                assert float(shown) == metrics[f'minillm_requests_total{{outcome="{outcome}"}}'], (outcome, shown)
            assert int(page["running"]) == metrics["minillm_num_requests_running"] == 0
            assert int(page["waiting"]) == metrics["minillm_num_requests_waiting"]
            assert int(page["swapped"]) == metrics["minillm_num_requests_swapped"]
            used, total = (int(x) for x in page["used"].split("/"))
            assert (used, total) == (metrics["minillm_kv_blocks_used"], metrics["minillm_kv_blocks_total"])
            assert float(page["hits"]) == metrics["minillm_prefix_cache_hits_total"]
            assert not any(page["owners"]), "a cell still coloured after every request ended"

            # No script error on the page (the console of a healthy page is empty).
            errors_logged = [e for e in driver.get_log("browser") if e["level"] == "SEVERE"]
            assert not errors_logged, errors_logged
            assert not re.search(r"NaN|undefined|Infinity", driver.find_element("tag name", "body").text)
        finally:
            seen.set()
            try:
                if driver is not None:
                    driver.quit()
            finally:
                for thread in threads:
                    if thread.is_alive():
                        thread.join(60)
