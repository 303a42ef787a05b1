"""LoRA over HTTP with the real server and the `openai` client: adapters by model name, listing with
their parent, run-time load and unload (path checks, API key), a resolver, 404s, metrics and the dashboard."""
from __future__ import annotations

import shutil
import time

import httpx
import openai
import pytest
from support.adapters import save_adapter
from support.models import build_random_checkpoint, hf_greedy
from support.server import API_KEY, ServerProcess
from support.server_a_cli import cli_runs
from transformers import AutoTokenizer

PROMPT = [5, 77, 300, 1234, 999, 42, 17]


@pytest.fixture(scope="module")
def lora_setup(tmp_path_factory, default_model_dir):
    root = tmp_path_factory.mktemp("lora-serve")
    base = build_random_checkpoint("llama", root / "base", default_model_dir)
    served = root / "served"
    references = {name: save_adapter(base, served / name, rank=rank, seed=seed)
                  for name, rank, seed in [("r8", 8, 1), ("r16", 16, 2)]}
    resolvable = root / "resolvable"
    shutil.copytree(served / "r16", resolvable / "res16")
    (root / "outside").mkdir()
    shutil.copytree(served / "r8", root / "outside" / "r8")
    return root, base, references


@pytest.fixture(scope="module")
def lora_server(lora_setup):
    root, base, _ = lora_setup
    proc = ServerProcess(str(base), "--served-model-name", "base", "--dtype", "float32", "--max-model-len", "256",
                         "--kv-cache-memory", "0.05", "--api-key", API_KEY, "--enable-lora", "--max-loras", "2",
                         "--lora-modules", f"r8={root / 'served' / 'r8'}", "--allow-runtime-lora-updating",
                         "--lora-resolver", "filesystem", "--lora-resolver-root", str(root / "resolvable"))
    yield proc.wait_ready()
    assert proc.stop() == 0


@pytest.fixture(scope="module")
def client(lora_server):
    return openai.OpenAI(base_url=lora_server.url + "/v1", api_key=API_KEY, max_retries=0)


@pytest.fixture(scope="module")
def http(lora_server):
    with httpx.Client(base_url=lora_server.url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=120) as c:
        yield c


def complete(client, model: str, max_tokens: int = 6):
    return client.completions.create(model=model, prompt=PROMPT, max_tokens=max_tokens, temperature=0.0,
                                     extra_body={"ignore_eos": True})


def test_models_lists_adapters_with_their_parent(client):
    cards = {card.id: card for card in client.models.list().data}
    assert set(cards) == {"base", "r8"}
    assert cards["r8"].parent == "base" and cards["base"].parent is None
    assert client.models.retrieve("r8") == cards["r8"]


def test_the_adapter_named_by_model_generates_its_tokens(client, lora_setup):
    """The adapter's text is PEFT's greedy tokens; the base's differs; responses name the adapter."""
    _, _, references = lora_setup
    reference = hf_greedy(references["r8"], PROMPT, 6)[0]
    tokenizer = AutoTokenizer.from_pretrained(lora_setup[1])
    adapted = complete(client, "r8")
    assert adapted.model == "r8"
    assert adapted.choices[0].text == tokenizer.decode(reference)
    assert complete(client, "base").choices[0].text != adapted.choices[0].text
    chat = client.chat.completions.create(model="r8", messages=[{"role": "user", "content": "hi"}], max_tokens=3)
    assert chat.model == "r8" and chat.choices[0].message.content


def test_unknown_model_is_a_404(client):
    with pytest.raises(openai.NotFoundError) as caught:
        complete(client, "no-such-adapter")
    assert caught.value.body["code"] == "model_not_found"
    with pytest.raises(openai.NotFoundError):
        complete(client, "../served/r8")  # not a resolver name: no path escapes the root


def test_a_resolver_finds_an_adapter_by_name(client):
    assert complete(client, "res16").model == "res16"
    assert "res16" in {card.id for card in client.models.list().data}


def test_load_and_unload_at_run_time(client, http, lora_setup):
    root = lora_setup[0]
    body = {"lora_name": "r16", "lora_path": str(root / "served" / "r16")}
    assert http.post("/v1/load_lora_adapter", json=body).status_code == 200
    assert complete(client, "r16").model == "r16"
    again = http.post("/v1/load_lora_adapter", json=body)
    assert again.status_code == 400 and "already served" in again.json()["error"]["message"]
    assert http.post("/v1/unload_lora_adapter", json={"lora_name": "r16"}).status_code == 200
    with pytest.raises(openai.NotFoundError):
        complete(client, "r16")
    gone = http.post("/v1/unload_lora_adapter", json={"lora_name": "r16"})
    assert gone.status_code == 404 and gone.json()["error"]["code"] == "model_not_found"


@pytest.mark.parametrize("path", ["{root}/served/../outside/r8", "{root}/outside/r8", "served/r8", "/etc"])
def test_load_outside_the_allowed_roots_is_refused(http, lora_setup, path):
    response = http.post("/v1/load_lora_adapter", json={"lora_name": "sneaky", "lora_path": path.format(
        root=lora_setup[0])})
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "lora_path"


def test_load_needs_the_api_key(lora_server, lora_setup):
    response = httpx.post(lora_server.url + "/v1/load_lora_adapter",
                          json={"lora_name": "x", "lora_path": str(lora_setup[0] / "served" / "r16")})
    assert response.status_code == 401


def test_a_bad_adapter_is_a_400_and_the_server_serves_on(client, http, lora_setup):
    broken = lora_setup[0] / "served" / "broken"
    shutil.copytree(lora_setup[0] / "served" / "r8", broken)
    (broken / "adapter_model.safetensors").write_bytes(b"not safetensors")
    response = http.post("/v1/load_lora_adapter", json={"lora_name": "broken", "lora_path": str(broken)})
    error = response.json()["error"]
    assert response.status_code == 400 and "not a readable safetensors file" in error["message"]
    assert error["param"] == "lora_path"
    assert complete(client, "r8").model == "r8"


@pytest.mark.parametrize("body, param, message", [
    ({"lora_name": "", "lora_path": "{served}/r16"}, "lora_name", "must not be empty"),
    ({"lora_name": "  ", "lora_path": "{served}/r16"}, "lora_name", "must not be empty"),
    ({"lora_name": "base", "lora_path": "{served}/r16"}, "lora_name", "already served"),
    ({"lora_name": "x", "lora_path": "{served}/r16", "base_model_name": "nosuch"}, "base_model_name",
     "not a model this server serves"),
])
def test_a_bad_load_is_a_400_naming_the_field_and_lists_nothing(client, http, lora_setup, body, param, message):
    body = {key: value.format(served=lora_setup[0] / "served") for key, value in body.items()}
    response = http.post("/v1/load_lora_adapter", json=body)
    error = response.json()["error"]
    assert response.status_code == 400 and error["param"] == param and message in error["message"]
    assert all(model.id.strip() and model.id != "x" for model in client.models.list().data)
    assert complete(client, "r8").model == "r8"


def test_unloading_an_adapter_in_use_lets_its_requests_finish(client, http, lora_setup):
    root = lora_setup[0]
    http.post("/v1/load_lora_adapter", json={"lora_name": "busy", "lora_path": str(root / "served" / "r16")})
    stream = client.completions.create(model="busy", prompt=PROMPT, max_tokens=24, temperature=0.0, stream=True,
                                       extra_body={"ignore_eos": True})
    chunks = [next(stream)]
    assert http.post("/v1/unload_lora_adapter", json={"lora_name": "busy"}).status_code == 200
    chunks += list(stream)
    assert chunks[-1].choices[0].finish_reason == "length"


def test_metrics_show_adapters(client, http):
    complete(client, "r8")
    text = http.get("/metrics").text
    assert 'vllm:lora_requests_info{' in text and 'max_lora="2"' in text
    assert 'vllm:lora_requests_total{lora_name="r8",model_name="base"}' in text


def test_the_dashboard_lists_adapters_with_their_state_and_requests(client, http):
    def adapters():
        return {row["name"]: row for row in http.get("/dashboard/stats").json()["adapters"]}

    before = adapters()
    assert set(before) == {model.id for model in client.models.list().data} - {"base"}
    complete(client, "r8")
    deadline = time.monotonic() + 30
    while (after := adapters())["r8"]["state"] != "idle" and time.monotonic() < deadline:
        time.sleep(0.1)  # the engine's stats reach the API process after its step
    assert after["r8"]["requests"] == before["r8"]["requests"] + 1
    assert after["r8"]["state"] == "idle" and after["r8"]["base_model"] == "base"
    assert after["r8"]["path"] == before["r8"]["path"] and after["r8"]["id"] == before["r8"]["id"]


BAD_FLAGS = {
    "duplicate": (["--lora-modules", "a=/x", "a=/y"], "the name 'a' is given twice"),
    "malformed": (["--lora-modules", "nameonly"], "is not NAME=PATH or a JSON object"),
    "resolver-root": (["--lora-resolver", "filesystem"], "needs an existing folder of adapters"),
    "resolver-name": (["--lora-resolver", "nope"], "unknown LoRA resolver 'nope'"),
    "base-name": (["--served-model-name", "base", "--lora-modules", "base=/x"], "the name 'base' is the base model's"),
    "json-key": (["--lora-modules", '{"name": "a", "path": "/x", "rank": 8}'], "keys this server does not know: rank"),
    "json-parent": (["--served-model-name", "base", "--lora-modules", '{"name": "a", "path": "/x", '
                     '"base_model_name": "other"}'], "base_model_name 'other' is not a name this server serves"),
}


@pytest.fixture(scope="module")
def cli(lora_setup):
    """The module's `corectl` command lines, run in one interpreter (one import of torch and corectl):
    each bad LoRA flag, an adapter of too high a rank given at start-up, and `corectl plugins`."""
    root, base, _ = lora_setup
    runs = {name: ["serve", "--port", "0", str(base), "--enable-lora", *flags]
            for name, (flags, _) in BAD_FLAGS.items()}
    runs["startup-rank"] = ["serve", "--port", "0", str(base), "--dtype", "float32", "--max-model-len", "128",
                            "--kv-cache-memory", "0.02", "--enable-lora", "--max-lora-rank", "8",
                            "--lora-modules", f"r16={root / 'served' / 'r16'}"]
    runs["plugins"] = ["plugins"]
    return dict(zip(runs, cli_runs(*runs.values())))


@pytest.mark.parametrize("name", list(BAD_FLAGS))
def test_bad_lora_flags_exit_2_in_one_line(cli, name):
    done, message = cli[name], BAD_FLAGS[name][1]
    assert done.returncode == 2 and message in done.stderr and "Traceback" not in done.stderr


def test_a_bad_startup_adapter_names_the_problem(cli):
    """An adapter of too high a rank given at start-up: the server does not start, and says why."""
    done = cli["startup-rank"]
    assert done.returncode == 2 and "rank 16, above max_lora_rank 8" in done.stderr


def test_plugins_lists_the_lora_resolvers(cli):
    rows = {tuple(line.split()[:2]) for line in cli["plugins"].stdout.splitlines()[1:]}
    assert {("lora_resolver", "filesystem"), ("lora_resolver", "hub")} <= rows


def test_routes_that_do_not_apply_adapters_say_so(http):
    assert http.post("/tokenize", json={"model": "r8", "prompt": "hi"}).status_code == 200
    response = http.post("/v1/embeddings", json={"model": "r8", "input": "hi"})
    assert response.status_code == 400 and "LoRA adapter" in response.json()["error"]["message"]
