"""Drives the gateway's live turn page in headless Chromium and reports what it shows.

usage: live_page.py BASE_URL API_KEY DECISION SCREENSHOT_PATH

Opens BASE_URL/, enters the key, picks the example named DECISION (or pastes DECISION
when it is a JSON object), runs the turn, waits for the page to
say the turn is done, saves a screenshot, and prints one JSON object: every call row's
id, tool and final state, the summary, the narration, the trace link.
"""

import json
import sys

from playwright.sync_api import sync_playwright

CHROMIUM = "/usr/bin/chromium"


def main() -> None:
    base, key, example, screenshot = sys.argv[1:5]
    with sync_playwright() as p:
        browser = p.chromium.launch(
            executable_path=CHROMIUM, headless=True, args=["--no-sandbox"]
        )
        page = browser.new_page(viewport={"width": 1280, "height": 760})
        page.goto(base + "/")
        page.wait_for_selector("#example option", state="attached")
        page.fill("#key", key)
        if example.lstrip().startswith("{"):
            page.fill("#decision", example)
        else:
            page.select_option("#example", example)
        page.fill("#context", '{"customerId": "cust_002"}')
        page.click("#submit")
        page.wait_for_selector("#status[data-done='true']", timeout=60_000)
        page.wait_for_timeout(200)
        rows = page.eval_on_selector_all(
            "#calls tbody tr",
            """rows => rows.map(r => ({
                id: r.dataset.callId,
                tool: r.querySelector('.tool').textContent,
                state: r.dataset.state,
                ms: r.querySelector('.ms').textContent,
                bar: r.querySelector('.bar').style.width,
            }))""",
        )
        report = {
            "rows": rows,
            "ack": page.text_content("#ack"),
            "summary": page.text_content("#summary"),
            "narration": page.text_content("#narration"),
            "status": page.text_content("#status"),
            "trace": page.get_attribute("#trace", "href"),
            "problem": page.text_content("#problem"),
        }
        page.screenshot(path=screenshot, full_page=True)
        browser.close()
    print(json.dumps(report))


if __name__ == "__main__":
    main()
