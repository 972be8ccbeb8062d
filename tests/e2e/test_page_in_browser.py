"""The page in headless Chromium against a real server with an API key: it asks for the
key, streams a chat with a growing token count, stops it, shows the request as aborted
on the timeline, and renders a hostile prompt as text. Screenshots go to
``test-artifacts/`` (or $TOKENMILL_TEST_ARTIFACTS).

The stop test does not race the model: the engine process is held stopped (SIGSTOP) and
computes only in short slices the test grants until the page shows what it waits for, so
the reply cannot reach its ``max_tokens`` before the click, however fast or slow the host.
"""

from __future__ import annotations

import os
import signal
import time

import httpx
import pytest
from browser import save_screenshot, start_browser
from server_process import ServerProcess

KEY = "page-test-key"
HOSTILE = ('<img src=x onerror="document.title=\'pwned\'">'
           '<script>document.title="pwned"</script><b>bold?</b>')


@pytest.fixture(scope="module")
def driver():
    browser = start_browser()
    browser.set_script_timeout(30)
    yield browser
    browser.quit()


@pytest.fixture(scope="module")
def ui_server(driver, tiny_model):
    server = ServerProcess(tiny_model, "--served-model-name", "tiny", "--max-model-len", "512",
                           "--api-key", KEY, "--ui-show-text")
    yield server
    server.stop()


def wait_for(driver, condition, timeout: float = 30.0, message: str = ""):
    from selenium.webdriver.support.ui import WebDriverWait

    return WebDriverWait(driver, timeout, poll_frequency=0.05).until(
        lambda d: condition(d), message)


def js(driver, script: str, *args):
    return driver.execute_script(script, *args)


def by_id(driver, element_id: str):
    from selenium.webdriver.common.by import By

    return driver.find_element(By.ID, element_id)


def enter_key(driver, key: str) -> None:
    wait_for(driver, lambda d: by_id(d, "key-overlay").is_displayed(), message="no key dialog")
    field = by_id(driver, "api-key")
    field.clear()
    field.send_keys(key)
    by_id(driver, "key-submit").click()


def last_reply(driver) -> dict:
    return js(driver, """
        const items = document.querySelectorAll('#messages .message.assistant');
        const m = items[items.length - 1];
        return m ? {text: m.querySelector('.text').textContent, id: m.dataset.requestId,
                    outcome: m.dataset.outcome || null} : null;""")


def tokens(driver) -> int:
    return int(by_id(driver, "token-count").get_attribute("data-tokens"))


def send(driver, prompt: str, max_tokens: int) -> None:
    js(driver, "const t = document.getElementById('temperature'); t.value = '0';"
               "t.dispatchEvent(new Event('input'));")
    field = by_id(driver, "max-tokens")
    field.clear()
    field.send_keys(str(max_tokens))
    by_id(driver, "prompt").send_keys(prompt)
    by_id(driver, "send").click()


class EngineClock:
    """The server's engine process, stopped (SIGSTOP) but for the slices ``run_until``
    grants; resumed for good on leaving the ``with`` block."""

    def __init__(self, server: ServerProcess) -> None:
        pid = server.process.pid
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            children = f.read().split()
        self.pid = next(int(c) for c in children if b"spawn_main" in _cmdline(int(c)))

    def __enter__(self) -> EngineClock:
        os.kill(self.pid, signal.SIGSTOP)
        return self

    def __exit__(self, *_) -> None:
        os.kill(self.pid, signal.SIGCONT)

    def run_until(self, driver, condition, message: str, timeout: float = 120.0) -> None:
        """Let the engine run in slices until the page shows ``condition``, each slice's
        tokens given half a second to reach the page. A slice starts at 20 ms and doubles
        (up to 320 ms) while the token count shows no progress, so a host too busy to run
        the engine in 20 ms still gets there, and one that does gets no longer slices."""
        from selenium.common.exceptions import TimeoutException

        deadline, slice_s, seen = time.monotonic() + timeout, 0.02, tokens(driver)
        while time.monotonic() < deadline:
            os.kill(self.pid, signal.SIGCONT)
            time.sleep(slice_s)
            os.kill(self.pid, signal.SIGSTOP)
            try:
                wait_for(driver, condition, timeout=0.5)
                return
            except TimeoutException:
                if tokens(driver) == seen:
                    slice_s = min(2 * slice_s, 0.32)
                seen = tokens(driver)
        raise AssertionError(message)


def _cmdline(pid: int) -> bytes:
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        return f.read()


def timeline_status(driver, request_id: str) -> str | None:
    return js(driver, "const r = [...document.querySelectorAll('.tl-row')]"
                      ".find(r => r.dataset.requestId === arguments[0]);"
                      "return r ? r.dataset.status : null;", request_id)


def test_chat_streams_then_stop_aborts_and_the_timeline_shows_it(driver, ui_server) -> None:
    driver.get(ui_server.base_url + "/")
    enter_key(driver, "wrong")
    wait_for(driver, lambda d: by_id(d, "key-error").is_displayed(), message="wrong key accepted")
    enter_key(driver, KEY)
    wait_for(driver, lambda d: by_id(d, "model-name").text == "tiny", message="no model name")

    with EngineClock(ui_server) as engine:
        send(driver, "Tell me a story about a robot who learns to paint.", 400)
        engine.run_until(driver, lambda d: tokens(d) >= 5 and last_reply(d)["text"],
                         "no streamed text")
        first_count, first_text = tokens(driver), last_reply(driver)["text"]
        engine.run_until(driver, lambda d: tokens(d) > first_count + 3,
                         "token count not growing")
        assert last_reply(driver)["text"].startswith(first_text)
        by_id(driver, "stop").click()
        wait_for(driver, lambda d: last_reply(d)["outcome"] == "stopped", message="not stopped")
        reply = last_reply(driver)
        shown = tokens(driver)
    assert first_count < shown < 400
    save_screenshot(driver, "page-chat.png")

    by_id(driver, "tab-dashboard").click()
    wait_for(driver, lambda d: timeline_status(d, reply["id"]) == "aborted",
             message="the stopped request is not on the timeline as aborted")
    save_screenshot(driver, "page-dashboard.png")
    recent = httpx.get(ui_server.base_url + "/v1/requests/recent",
                       headers={"Authorization": f"Bearer {KEY}"}).json()
    server_side = next(e for e in recent["data"] if e["id"] == reply["id"])
    assert server_side["finish_reason"] == "abort" and shown <= server_side["output_tokens"] < 400
    ui_server.wait_idle()  # the abort freed its KV blocks


def test_hostile_prompt_is_shown_as_text_and_runs_nothing(driver, ui_server) -> None:
    driver.get(ui_server.base_url + "/ui#chat")  # a new load: the tab kept the key
    wait_for(driver, lambda d: by_id(d, "model-name").text == "tiny", message="no model name")
    send(driver, HOSTILE, 4)
    wait_for(driver, lambda d: last_reply(d) and last_reply(d)["outcome"],
             message="no reply")
    request_id = last_reply(driver)["id"]
    user_text = js(driver, "return document.querySelector('#messages .message.user .text')"
                           ".textContent;")
    assert user_text == HOSTILE
    injected = "return document.querySelectorAll(arguments[0] + ' :is(img, script, b)').length;"
    assert js(driver, injected, "#messages") == 0

    by_id(driver, "tab-dashboard").click()
    wait_for(driver, lambda d: timeline_status(d, request_id) == "finished",
             message="the request is not on the timeline")
    from selenium.webdriver.common.action_chains import ActionChains
    from selenium.webdriver.common.by import By

    row = driver.find_element(By.CSS_SELECTOR, f'.tl-row[data-request-id="{request_id}"]')
    ActionChains(driver).move_to_element(row.find_element(By.CLASS_NAME, "tl-track")).perform()
    wait_for(driver, lambda d: HOSTILE in js(
        d, "const p = document.querySelector('#tooltip .tip-prompt');"
           "return p ? p.textContent : '';"), message="no prompt in the hover details")
    assert js(driver, injected, "#tooltip") == 0
    assert driver.title == "tokenmill"
