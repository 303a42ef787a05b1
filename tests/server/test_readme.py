"""The README's usage examples run as written against a real server (no API key, as the README shows)."""
from __future__ import annotations

import contextlib
import io
import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[2] / "README.md"
README_URL = "http://127.0.0.1:8000"


def _blocks(lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", README.read_text(), flags=re.S)


def test_readme_curl_example(keyless_server):
    if shutil.which("curl") is None:
        pytest.skip("curl is not installed")
    (command,) = [b for b in _blocks("bash") if b.lstrip().startswith("curl")]
    out = subprocess.run(["bash", "-c", command.replace(README_URL, keyless_server.url)],
                         capture_output=True, text=True, check=True, timeout=120).stdout
    body = json.loads(out)
    assert "Paris" in body["choices"][0]["message"]["content"]
    assert body["usage"]["completion_tokens"] <= 16


def test_readme_openai_client_example(keyless_server):
    (code,) = [b for b in _blocks("python") if "from openai import OpenAI" in b]
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(compile(code.replace(README_URL, keyless_server.url), "README.md", "exec"), {})
    assert "Paris" in printed.getvalue()


def test_readme_structured_output_and_tool_call_example(keyless_server):
    (code,) = [b for b in _blocks("python") if "chat.completions.parse" in b]
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(compile(code.replace(README_URL, keyless_server.url), "README.md", "exec"), {})
    parsed, call = printed.getvalue().splitlines()
    assert parsed.startswith("country=") and "city='Paris'" in parsed
    name, arguments = call.split(" ", 1)
    assert name == "get_weather" and set(json.loads(arguments)) == {"city"}


def test_readme_offline_example():
    (code,) = [b for b in _blocks("python") if "from corectl import LLM" in b]
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(compile(code, "README.md", "exec"), {})
    assert "Paris" in printed.getvalue()
