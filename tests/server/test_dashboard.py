"""The live ops dashboard against a real server under load: its JSON routes, the abort action, and
the page itself in a real browser (Debian's chromium driven by playwright; a screenshot is kept)."""
from __future__ import annotations

import os
import re
import shutil
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest
from support.server import API_KEY, SMALL_ENGINE, ServerProcess

AUTH = {"Authorization": f"Bearer {API_KEY}"}
DEADLINE_S = 180
# Far more tokens than a test waits for (within SMALL_ENGINE's 512-token context): the test
# closes the streams it leaves running.
LONG = 400


@pytest.fixture(scope="module")
def dash_server():
    # At most two running sequences, so a third request waits and the table shows both states.
    proc = ServerProcess(*SMALL_ENGINE, "--api-key", API_KEY, "--max-num-seqs", "2").wait_ready()
    yield proc
    assert proc.stop() == 0


class Load:
    """Streaming completions, one thread each; `ended` maps a request's index to "finished", "closed"
    (the test closed its stream) or the error its client raised. Requests are long, so none ends before
    the test acts on it however fast the machine; `close` ends the ones the test left running."""

    def __init__(self, url: str, count: int, max_tokens: int):
        self.client = openai.OpenAI(base_url=url + "/v1", api_key=API_KEY, max_retries=0)
        model = self.client.models.list().data[0].id
        self.ids: dict[int, str] = {}
        self.ended: dict[int, object] = {}
        self.closing = threading.Event()
        self.threads = [threading.Thread(target=self._run, args=(i, model, max_tokens)) for i in range(count)]
        for thread in self.threads:
            thread.start()

    def _run(self, index: int, model: str, max_tokens: int) -> None:
        try:
            stream = self.client.completions.create(model=model, prompt=f"List {index + 3} colours:", stream=True,
                                                    max_tokens=max_tokens, temperature=0,
                                                    extra_body={"ignore_eos": True})
            for chunk in stream:
                self.ids[index] = chunk.id
                if self.closing.is_set():
                    stream.close()
                    self.ended[index] = "closed"
                    return
            self.ended[index] = "finished"
        except openai.APIError as exc:
            self.ended[index] = exc

    def close(self) -> dict[int, object]:
        self.closing.set()
        for thread in self.threads:
            thread.join(DEADLINE_S)
        assert len(self.ended) == len(self.threads)
        return self.ended


def wait_for(check, what: str):
    deadline = time.monotonic() + DEADLINE_S
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def stats_when(server, predicate, what: str) -> dict:
    """The first stats the predicate accepts."""
    return wait_for(lambda: next(filter(predicate, [stats(server)]), None), what)


def stats(server) -> dict:
    response = httpx.get(server.url + "/dashboard/stats", headers=AUTH, timeout=30)
    assert response.status_code == 200, response.text
    return response.json()


def abort(server, request_id: str, **headers) -> httpx.Response:
    return httpx.post(f"{server.url}/dashboard/requests/{request_id}/abort", headers={**AUTH, **headers}, timeout=30)


def assert_openai_error(response: httpx.Response, status: int, code: str) -> None:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == code


def test_the_page_is_static_and_everything_else_needs_the_key(dash_server):
    page = httpx.get(dash_server.url + "/dashboard")
    assert page.status_code == 200 and page.headers["content-type"] == "text/html; charset=utf-8"
    assert page.headers["content-security-policy"].startswith("default-src 'self'")
    # Everything the page loads comes from the package, through this server (no CDN).
    assets = [url for url in re.findall(r'(?:src|href)="([^"]+)"', page.text) if not url.startswith("data:")]
    assert sorted(assets) == ["/dashboard/static/dashboard.css", "/dashboard/static/dashboard.js"]
    for asset, media_type in zip(sorted(assets), ["text/css", "text/javascript"]):
        response = httpx.get(dash_server.url + asset)
        assert response.status_code == 200 and response.headers["content-type"].startswith(media_type)
    assert_openai_error(httpx.get(dash_server.url + "/dashboard/static/secret.py"), 404, "not_found")
    assert_openai_error(httpx.get(dash_server.url + "/dashboard/stats"), 401, "invalid_api_key")
    assert_openai_error(httpx.post(dash_server.url + "/dashboard/requests/x/abort"), 401, "invalid_api_key")
    assert_openai_error(abort(dash_server, "x"), 404, "not_found")
    # A page of another site cannot make a browser abort requests (fetch metadata).
    assert_openai_error(abort(dash_server, "x", **{"Sec-Fetch-Site": "cross-site"}), 403, "invalid_request_error")


@pytest.mark.slow
def test_stats_follow_the_load_and_aborts_end_requests_and_free_blocks(dash_server):
    load = Load(dash_server.url, count=3, max_tokens=LONG)
    busy = stats_when(dash_server, lambda s: len(s["requests"]) == 3 and s["num_running"] == 2
                      and {r["state"] for r in s["requests"]} == {"running", "waiting"},
                      "two running requests and one waiting")
    steps, blocks = busy["steps"], busy["kv_blocks"]
    assert steps["max_num_seqs"] == 2 and max(steps["num_seqs"]) <= 2 and steps["num_steps"] >= 1
    assert all(0 < t <= steps["token_budget"] for t in steps["num_tokens"])
    assert blocks["used"] > 0 and sum(blocks["cell_used"]) == blocks["used"]
    assert blocks["used"] + blocks["cached"] + blocks["free"] == blocks["num_blocks"]
    assert busy["num_requests"] == 3 and busy["server_load"] == 3

    waiting = next(r["id"] for r in busy["requests"] if r["state"] == "waiting")
    assert abort(dash_server, waiting).json() == {"id": waiting, "aborted": True}
    running = next(r["id"] for r in busy["requests"] if r["state"] == "running")
    assert abort(dash_server, running).status_code == 200
    ended = load.close()
    errors = [e for e in ended.values() if e not in ("finished", "closed")]
    assert len(errors) == 2 and len(ended) == 3
    # The waiting request had sent no byte: its client gets the HTTP status; the running one the
    # error event of its stream. Both name the request.
    assert {getattr(e, "status_code", None) for e in errors} == {499, None}
    assert sorted(waiting in str(e) or running in str(e) for e in errors) == [True, True]
    assert_openai_error(abort(dash_server, running), 404, "not_found")

    idle = stats_when(dash_server, lambda s: s["num_requests"] == 0 and s["kv_blocks"]["used"] == 0,
                      "the engine to go idle with every block free")
    activity = idle["activity"]
    assert idle["num_running"] == idle["num_waiting"] == 0 and idle["steps"]["num_steps"] > steps["num_steps"]
    assert activity["output_tokens_per_s"] > 0 and activity["points"]
    assert 0 < activity["ttft_p50"] <= activity["ttft_p99"] and 0 < activity["itl_p50"] <= activity["itl_p99"]


def wait_in_page(page, function: str, arg=None) -> None:
    """Poll `function(arg)` in the page until it is truthy. Playwright's `wait_for_function` evals
    its predicate inside the page, which the dashboard's CSP (no 'unsafe-eval') refuses;
    `page.evaluate` goes through the DevTools protocol, which the CSP does not govern."""
    wait_for(lambda: page.evaluate(function, arg), f"the page to satisfy {function}")


def chromium_path() -> str:
    pytest.importorskip("playwright.sync_api", reason="the browser test needs the test extra (playwright)")
    await_chromium_install()
    path = shutil.which("chromium")
    if path is None:
        pytest.skip("the browser test needs Debian's chromium: apt-get install -y chromium")
    return path


def await_chromium_install(timeout_s: float = 600) -> None:
    """.ci/run installs chromium while the tests run and names, in $CORECTL_CHROMIUM_INSTALL_STATUS, the
    file that receives the install's exit status and log: wait for it. A failed install fails this
    test (CI must run it), where a machine without the variable and without chromium skips it."""
    status_file = os.environ.get("CORECTL_CHROMIUM_INSTALL_STATUS")
    if not status_file:
        return
    deadline = time.monotonic() + timeout_s
    while not os.path.exists(status_file):
        if time.monotonic() > deadline:
            pytest.fail(f"chromium's install did not finish within {timeout_s:g} s ({status_file})")
        time.sleep(1)
    status, log = Path(status_file).read_text().split(maxsplit=1)
    if status != "0":
        pytest.fail(f"chromium's install failed (exit {status}):\n{Path(log.strip()).read_text()[-3000:]}")


@pytest.fixture
def artifacts(tmp_path_factory, capsys) -> Path:
    """Where the screenshot goes: $CORECTL_TEST_ARTIFACTS, else a pytest temporary folder (printed)."""
    folder = Path(os.environ.get("CORECTL_TEST_ARTIFACTS") or tmp_path_factory.mktemp("dashboard"))
    folder.mkdir(parents=True, exist_ok=True)
    with capsys.disabled():
        print(f"\ndashboard screenshots: {folder}")
    return folder


@pytest.mark.slow
def test_dashboard_in_a_real_browser(dash_server, artifacts):
    from playwright.sync_api import sync_playwright

    executable = chromium_path()
    load = Load(dash_server.url, count=3, max_tokens=LONG)
    with sync_playwright() as pw:
        # Containers often give /dev/shm 64 MB, where a renderer taking a screenshot crashes.
        browser = pw.chromium.launch(executable_path=executable, args=["--disable-dev-shm-usage"])
        page = browser.new_page(viewport={"width": 1280, "height": 1100})
        problems: list[str] = []
        # The first poll's 401 is expected (it is how the page learns it needs the key).
        page.on("console", lambda msg: problems.append(msg.text) if msg.type == "error"
                and "status of 401" not in msg.text else None)
        page.on("pageerror", lambda exc: problems.append(str(exc)))
        page.goto(dash_server.url + "/dashboard")

        # The server has a key: the page asks for it, then keeps it for the tab.
        page.wait_for_selector("#key-form", state="visible")
        page.fill("#key-input", API_KEY)
        page.click("#key-form button[type=submit]")
        wait_in_page(page, "() => document.querySelector('#status').textContent === 'live'")
        assert page.evaluate("sessionStorage.getItem('corectl-api-key')") == API_KEY

        # Numbers move while requests run.
        page.wait_for_selector("#requests tbody tr:has(td.state-running)", timeout=DEADLINE_S * 1000)
        steps = page.evaluate("parseInt(document.querySelector('#steps-caption').textContent.replace(/,/g, ''))")
        wait_in_page(page, "(before) => parseInt(document.querySelector('#steps-caption').textContent"
                     ".replace(/,/g, '')) > before", arg=steps)
        wait_in_page(page, "() => parseInt(document.querySelector('#kv-used').textContent) > 0")
        wait_in_page(page, "() => document.querySelector('#itl').textContent !== '- / -'")
        page.screenshot(path=str(artifacts / "dashboard.png"), full_page=True)

        # The abort button ends a live request (running if one still is): its client sees the error,
        # its row goes away.
        request_id = page.evaluate("(document.querySelector('#requests tbody tr:has(td.state-running)')"
                                   " || document.querySelector('#requests tbody tr')).dataset.id")
        page.click(f"#requests tbody tr[data-id='{request_id}'] button.abort")
        wait_in_page(page, "(id) => ![...document.querySelectorAll('#requests tbody tr')]"
                     ".some((tr) => tr.dataset.id === id)", arg=request_id)
        ended = load.close()
        page.screenshot(path=str(artifacts / "dashboard-after-abort.png"), full_page=True)
        browser.close()
    aborted = [e for e in ended.values() if e not in ("finished", "closed")]
    assert len(aborted) == 1 and request_id in str(aborted[0]) and "aborted by an operator" in str(aborted[0])
    assert problems == []
    assert (artifacts / "dashboard.png").stat().st_size > 10_000
