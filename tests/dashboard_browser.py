"""Headless Chromium on the dashboard page (tests of engine/server/dashboard/): Debian's chromium
driven by Playwright (``executable_path``: no browser download). ``chromium()`` is None, and the
tests skip saying so, where either is missing (CI machines may lack Chromium)."""

from __future__ import annotations

import shutil
from pathlib import Path

CANDIDATES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")


def chromium() -> str | None:
    """A Chromium executable on PATH, or None."""
    for name in CANDIDATES:
        path = shutil.which(name)
        if path:
            return path
    return None


def skip_reason() -> str | None:
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        return "the Python package playwright is not installed (pip install -e '.[dev]')"
    if chromium() is None:
        return f"no Chromium on PATH (looked for {', '.join(CANDIDATES)}; apt-get install chromium)"
    return None


def open_dashboard(url: str, shot: Path, key: str | None, wait_for, timeout_s: float = 60):
    """Open ``url`` (the page), type ``key`` into its key form when given, call
    ``wait_for(page)`` (it waits for what the test expects, Playwright's expect/wait_for_*),
    write a screenshot to ``shot``; returns the console errors and uncaught page errors."""
    from playwright.sync_api import sync_playwright

    errors: list[str] = []
    with sync_playwright() as p:
        browser = p.chromium.launch(
            executable_path=chromium(), headless=True, args=["--no-sandbox", "--disable-gpu"]
        )
        try:
            page = browser.new_page(viewport={"width": 1100, "height": 1300})
            page.set_default_timeout(timeout_s * 1000)
            page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.goto(url)
            if key is not None:
                page.wait_for_selector("#auth", state="visible")
                page.fill("#key", key)
                page.click("#auth button")
            wait_for(page)
            page.screenshot(path=str(shot), full_page=True)
        finally:
            browser.close()
    return errors
