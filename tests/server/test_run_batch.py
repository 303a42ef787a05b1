"""`corectl run-batch` end to end on the embedded SmolLM2: chat, completion and Responses lines give
what the server gives, bad lines get their own error line and the batch goes on, and a second run
on the same output skips the custom_ids already written."""
from __future__ import annotations

import json

import pytest
from support.server import SMALL_ENGINE
from support.server_a_cli import cli_runs

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


# The resumed run's input: the first batch's first three lines again, and a new one.
EXTRA = {"custom_id": "chat-2", "method": "POST", "url": "/v1/chat/completions", "body": CHAT}


def run_batch_args(folder, name: str, lines: list[str]) -> list[str]:
    source = folder / f"{name}.jsonl"
    source.write_text("\n".join(lines) + "\n")
    return ["run-batch", "-i", str(source), "-o", str(folder / "out.jsonl"), "--no-progress", *SMALL_ENGINE]


@pytest.fixture(scope="module")
def batches(tmp_path_factory):
    """The first batch, a run-batch whose input is missing, and the first batch resumed on the same
    output, in one interpreter (one import of torch and corectl for the three: ~3 s of CPU each)."""
    folder = tmp_path_factory.mktemp("run-batch")
    lines = [json.dumps(line) for line in LINES] + ["not json"]
    missing = tmp_path_factory.mktemp("missing")
    runs = cli_runs(run_batch_args(folder, "in", lines),
                    ["run-batch", "-i", str(missing / "none"), "-o", str(missing / "out.jsonl")],
                    run_batch_args(folder, "resume", lines[:3] + [json.dumps(EXTRA)]))
    return folder, lines, runs


def results(lines: list[str]) -> dict[str, dict]:
    return {line["custom_id"]: line for line in map(json.loads, lines)}


def test_run_batch_end_to_end_and_resume(batches):
    folder, lines, (proc, _, resumed) = batches
    assert proc.returncode == 0, proc.stderr
    written = (folder / "out.jsonl").read_text().splitlines()
    out = results(written[:len(lines)])  # the first run's lines; the resumed run appends its own
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
    assert resumed.returncode == 0, resumed.stderr
    assert len(written) == len(LINES) + 2
    again = results(written)
    assert again["chat"] == first_chat
    assert again["chat-2"]["response"]["body"]["choices"][0]["message"]["content"] == \
        first_chat["response"]["body"]["choices"][0]["message"]["content"]


def test_missing_input_is_one_line_and_exit_2(batches):
    proc = batches[2][1]
    assert proc.returncode == 2 and "cannot read" in proc.stderr and proc.stderr.count("\n") == 1
