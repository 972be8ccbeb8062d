"""Regenerate the README's screenshots of the page: ``python docs/make_screenshots.py``.

Serves the embedded SmolLM2 with a small batch and KV cache (so requests queue and get
preempted), sends a few requests in the background, chats on the page in headless
Chromium (Debian's ``chromium`` + ``chromium-driver``), and saves ``docs/page-chat.png``
and ``docs/page-dashboard.png`` (colour-quantised to keep them small).
"""

from __future__ import annotations

import os
import sys
import threading
import time

import httpx
from PIL import Image

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.join(HERE, "..", "tests", "e2e"), os.path.join(HERE, "..", "benchmarks")]

from browser import start_browser  # noqa: E402
from serve import running_server  # noqa: E402

SERVER_ARGS = ["--max-num-seqs", "4", "--num-kv-blocks", "48", "--max-model-len", "512"]
TOPICS = ["the sea", "a lighthouse", "autumn leaves", "a train journey", "coffee",
          "the moon", "a robot gardener", "mountains"]


def background_load(base_url: str) -> None:
    def one(i: int) -> None:
        httpx.post(base_url + "/v1/chat/completions", timeout=600, headers={
            "x-request-id": f"batch-{i}"}, json={
            "messages": [{"role": "user", "content": f"Write a short story about {TOPICS[i]}."}],
            "max_tokens": 160, "ignore_eos": True})

    for i in range(len(TOPICS)):
        threading.Thread(target=one, args=(i,), daemon=True).start()
        time.sleep(0.7)


def wait_until(driver, script: str, timeout: float = 300.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and not driver.execute_script(script):
        time.sleep(0.5)


def save(driver, name: str) -> None:
    path = os.path.join(HERE, name)
    driver.save_screenshot(path)
    Image.open(path).convert("RGB").quantize(colors=64).save(path, optimize=True)
    print(f"wrote {path} ({os.path.getsize(path) // 1024} KiB)")


def main() -> None:
    driver = start_browser()
    driver.set_window_size(1280, 820)
    try:
        with running_server(None, SERVER_ARGS) as base_url:
            driver.get(base_url + "/ui#chat")
            driver.find_element("id", "system").send_keys("You are a concise poet.")
            driver.find_element("id", "max-tokens").clear()
            driver.find_element("id", "max-tokens").send_keys("80")
            driver.find_element("id", "prompt").send_keys("Write a haiku about autumn.")
            time.sleep(1)
            driver.find_element("id", "send").click()
            threading.Thread(target=background_load, args=(base_url,), daemon=True).start()
            wait_until(driver, "const m = document.querySelector('.message.assistant');"
                               "return m && m.dataset.outcome;")
            driver.find_element("id", "prompt").send_keys("Now one about winter.")
            driver.find_element("id", "send").click()
            wait_until(driver, "return +document.getElementById('token-count')"
                               ".dataset.tokens >= 12;")
            save(driver, "page-chat.png")
            driver.set_window_size(1280, 1000)
            driver.find_element("id", "tab-dashboard").click()
            wait_until(driver, "return document.getElementById('card-preemptions')"
                               ".textContent > '0';")
            time.sleep(3)
            save(driver, "page-dashboard.png")
    finally:
        driver.quit()


if __name__ == "__main__":
    main()
