"""`corectl run-batch` end to end on the embedded SmolLM2: chat, completion and Responses lines give
what the server gives, bad lines get their own error line and the batch goes on, and a second run
on the same output skips the custom_ids already written."""
from __future__ import annotations

import json
import subprocess
import sys

from support.server import SMALL_ENGINE

CHAT = {"messages": [{"role": "user", "content": "Say hi"}], "max_tokens": 3, "temperature": 0}
LINES = [
    {"custom_id": "chat", "method": "POST", "url": "/v1/chat/completions", "body": CHAT},
    {"custom_id": "completion", "method": "POST", "url": "/v1/completions",
     "body": {"prompt": "One, two,", "max_tokens": 3, "temperature": 0}},
    {"custom_id": "responses", "method": "POST", "url": "/v1/responses",
     "body": {"input": "Say hi", "max_output_tokens": 3, "temperature": 0}},
    {"custom_id": "too-long", "method": "POST", "url": "/v1/completions",
     "body": {"prompt": "word " * 600, "max_tokens": 3}},
    {"custom_id": "bad-url", "method": "POST", "url": "/v1/unknown", "body": {}},
    {"custom_id": "get", "method": "GET", "url": "/v1/completions", "body": {}},
]


def run_batch(tmp_path, lines: list[str]) -> subprocess.CompletedProcess:
    source = tmp_path / "in.jsonl"
    source.write_text("\n".join(lines) + "\n")
    return subprocess.run([sys.executable, "-m", "corectl.server.cli", "run-batch", "-i", str(source), "-o",
                           str(tmp_path / "out.jsonl"), "--no-progress", *SMALL_ENGINE],
                          capture_output=True, text=True, timeout=600)


def results(tmp_path) -> dict[str, dict]:
    out = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    return {line["custom_id"]: line for line in out}


def test_run_batch_end_to_end_and_resume(tmp_path):
    lines = [json.dumps(line) for line in LINES] + ["not json"]
    proc = run_batch(tmp_path, lines)
    assert proc.returncode == 0, proc.stderr
    out = results(tmp_path)
    assert set(out) == {line["custom_id"] for line in LINES} | {None}
    for custom_id in ("chat", "completion", "responses"):
        line = out[custom_id]
        assert line["error"] is None and line["response"]["status_code"] == 200, line
        assert line["id"].startswith("batch_req_") and line["response"]["request_id"]
    assert out["chat"]["response"]["body"]["choices"][0]["message"]["content"]
    assert out["chat"]["response"]["body"]["usage"]["completion_tokens"] == 3
    assert out["completion"]["response"]["body"]["object"] == "text_completion"
    assert out["responses"]["response"]["body"]["output"][0]["content"][0]["text"]
    too_long = out["too-long"]
    assert too_long["response"]["status_code"] == 400 and too_long["error"]["param"] == "prompt"
    assert "url must be one of" in out["bad-url"]["error"]["message"]
    assert "method must be POST" in out["get"]["error"]["message"]
    assert "not JSON" in out[None]["error"]["message"]
    # Resumed: the lines already written are skipped, a new one runs, nothing is written twice.
    first_chat = out["chat"]
    extra = {"custom_id": "chat-2", "method": "POST", "url": "/v1/chat/completions", "body": CHAT}
    proc = run_batch(tmp_path, lines[:3] + [json.dumps(extra)])
    assert proc.returncode == 0, proc.stderr
    written = (tmp_path / "out.jsonl").read_text().splitlines()
    assert len(written) == len(LINES) + 2
    again = results(tmp_path)
    assert again["chat"] == first_chat
    assert again["chat-2"]["response"]["body"]["choices"][0]["message"]["content"] == \
        first_chat["response"]["body"]["choices"][0]["message"]["content"]


def test_missing_input_is_one_line_and_exit_2(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "corectl.server.cli", "run-batch", "-i", str(tmp_path / "none"),
                           "-o", str(tmp_path / "out.jsonl")], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "cannot read" in proc.stderr and proc.stderr.count("\n") == 1
