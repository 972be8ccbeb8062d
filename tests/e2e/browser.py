"""Headless Chromium for the page's tests, driven by Selenium through Debian's
``chromium`` and ``chromium-driver`` packages. Nothing is downloaded: without both
programs on the machine the browser tests skip, saying so."""

from __future__ import annotations

import os
import shutil

import pytest

BROWSERS = ("chromium", "chromium-browser", "google-chrome")
ARTIFACTS_DIR = os.environ.get(
    "TOKENMILL_TEST_ARTIFACTS",
    os.path.join(os.path.dirname(__file__), "..", "..", "test-artifacts"))


def find_browser() -> tuple[str, str] | None:
    """(browser, driver) paths, or None."""
    browser = next((path for name in BROWSERS if (path := shutil.which(name))), None)
    driver = shutil.which("chromedriver")
    return (browser, driver) if browser and driver else None


def start_browser():
    found = find_browser()
    if found is None:
        pytest.skip("no headless browser: install Debian's chromium and chromium-driver "
                    "(apt-get install chromium chromium-driver) to run the page's tests")
    try:
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service
    except ImportError:
        pytest.skip("selenium is not installed (pip install -e '.[test]')")
    options = webdriver.ChromeOptions()
    options.binary_location = found[0]
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                "--window-size=1280,900", "--disable-extensions"):
        options.add_argument(arg)
    return webdriver.Chrome(options=options, service=Service(executable_path=found[1]))


def save_screenshot(driver, name: str) -> str:
    os.makedirs(ARTIFACTS_DIR, exist_ok=True)
    path = os.path.join(ARTIFACTS_DIR, name)
    driver.save_screenshot(path)
    return path
