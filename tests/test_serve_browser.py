"""The page of `mtcli serve` in a real browser: headless Chromium (Debian's chromium and
chromium-driver) driven by selenium types a sentence, clicks Translate and reads the answer.
Skipped with a one-line reason where no browser is installed. MTCLI_SCREENSHOT_DIR=DIR keeps a
screenshot of the page to look at."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

pytest.importorskip("selenium", reason="the browser test needs selenium (pip install 'mtcli[dev]')")
pytest.importorskip("fastapi", reason="mtcli serve needs the serve extra (pip install 'mtcli[serve]')")

from selenium import webdriver  # noqa: E402
from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.support.ui import WebDriverWait  # noqa: E402
from test_serve import Server  # noqa: E402

from mtcli.infer.translator import Translator  # noqa: E402

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
DRIVER = shutil.which("chromedriver")


@pytest.mark.skipif(CHROMIUM is None or DRIVER is None,
                    reason="no headless browser: apt-get install chromium chromium-driver")
def test_the_page_translates_what_a_person_types(tiny_run_dir: Path, tmp_path: Path) -> None:
    sentences = ["eine katze spielt", "ein hund läuft im park"]
    expected = Translator.from_run(tiny_run_dir, beam=2, device="cpu").translate(sentences, beam=3)
    server = Server(tiny_run_dir)
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1000,800"):
        options.add_argument(flag)
    browser = webdriver.Chrome(options=options, service=webdriver.ChromeService(executable_path=DRIVER))
    try:
        browser.get(server.url)
        assert browser.title == "mtcli"
        browser.find_element(By.ID, "source").send_keys("\n".join(sentences))
        beam = browser.find_element(By.ID, "beam")
        beam.clear()
        beam.send_keys("3")
        browser.find_element(By.ID, "translate").click()
        WebDriverWait(browser, 60).until(
            lambda b: b.find_element(By.ID, "status").text.startswith(("done", "translation failed"))
            or "error" in b.find_element(By.ID, "status").get_attribute("class"))
        assert browser.find_element(By.ID, "status").text.startswith("done")
        assert browser.find_element(By.ID, "result").text.split("\n") == expected
        shots = Path(os.environ.get("MTCLI_SCREENSHOT_DIR", tmp_path))
        shots.mkdir(parents=True, exist_ok=True)
        browser.save_screenshot(str(shots / "serve_page.png"))
    finally:
        browser.quit()
        assert server.stop() == 0
