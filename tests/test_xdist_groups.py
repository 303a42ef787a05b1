"""The test scheduler's grouping (support/xdist_groups.py): modules that take the same session server
share one xdist scope, modules linked through a second server join it, a module's own fixture of the
same name does not count, and modules outside tests/server keep their own scope."""
from support.xdist_groups import server_scopes


def _module(root, path: str, source: str) -> str:
    file = root / path
    file.parent.mkdir(parents=True, exist_ok=True)
    file.write_text(source)
    return path


def test_modules_sharing_session_servers_form_one_scope(tmp_path):
    modules = {
        _module(tmp_path, "tests/server/test_a.py", "def test_a(http):\n    pass\n"),
        _module(tmp_path, "tests/server/test_b.py", "def test_b(openai_client, model_id):\n    pass\n"),
        # Links the pooling server's modules to the default server's.
        _module(tmp_path, "tests/server/test_c.py", "def test_c(http, pooling_http):\n    pass\n"),
        _module(tmp_path, "tests/server/test_d.py", "def test_d(pooling_server):\n    pass\n"),
        _module(tmp_path, "tests/server/test_e.py", "def test_e(tools_server):\n    pass\n"),
        # Its own `server` fixture: not the session one.
        _module(tmp_path, "tests/server/test_f.py",
                "import pytest\n@pytest.fixture\ndef server():\n    pass\ndef test_f(server):\n    pass\n"),
        _module(tmp_path, "tests/core/test_g.py", "def test_g(server):\n    pass\n"),
    }
    scopes = server_scopes(modules, tmp_path)
    linked = {scopes[f"tests/server/test_{name}.py"] for name in "abcd"}
    assert len(linked) == 1
    assert scopes["tests/server/test_e.py"] not in linked
    assert "tests/server/test_f.py" not in scopes and "tests/core/test_g.py" not in scopes
