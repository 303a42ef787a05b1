"""What the tests stand on (importable as `support.<module>`: pyproject's pytest `pythonpath` is `tests`).
No test module imports another test module; what two of them share lives here or in a conftest.

Modules
- `close`: `assert_close(got, expected, tol=None, norm="fro"|"max", roundings=1)`, the one closeness
  check (relative error within `tol`, else to the dtype's rounding), `relative_error`, `BF16_STEP`.
- `engines`: `TINY`, the kwargs of an engine on the random-weight `llama-tiny` preset (CPU, tiny cache).
- `models`: the embedded SmolLM2 (`smollm2_folder`, `smollm2_gguf`, `CHAT_PROMPTS`), small random-weight
  checkpoints of real architectures (`build_random_checkpoint`), transformers' greedy reference
  (`hf_greedy`; `hf_greedy_choices` checks given tokens in one forward), `save_think_tokenizer`, `held_bytes`.
- `scheduling`: the scheduler without a model (`make_scheduler`, `make_req`, `step`, `run`,
  `PagedOracle`, `random_requests`, hand-built `SchedulerOutput`s).
- `server`: `ServerProcess` (`corectl serve` in a subprocess on a free port), `SMALL_ENGINE` flags (the
  embedded model on its default 4-bit CPU path), `SMALL_ENGINE_FP32` (checkpoints compared with fp32 engines),
  `API_KEY`, `await_health` (poll /health with one client), `descendants`/`alive` for process checks;
  `openai_errors`: `expect_error`, `openai_error`.
- `server_a_cli`: `cli_runs(*argvs)`, several `corectl` command lines in one interpreter (one import).
- `server_a_fixtures`: a pytest plugin (`pytest_plugins = ["support.server_a_fixtures"]`) of session servers
  that several modules share: `tools_server` (tool and reasoning parsers, no Responses store).
- `quantized_layers`, `quant_checkpoints`, `gguf_files`: quantized layers, checkpoints (AWQ, GPTQ, FP8)
  and GGUF files written as their tools write them. `gpu`: checkpoints and engine checks of tests/gpu.

Fixtures (conftest.py files). Under pytest-xdist (`-n auto`; pyproject's `--dist loadscope`) a module's
tests run on one worker, so a module-scoped fixture starts once; a session-scoped one once per worker.
- tests/conftest.py: `default_model_dir` (the embedded model converted once), `llm_int4` (one shared
  engine on its default 4-bit CPU path, for tests that compare corectl with corectl: a fifth of fp32's
  CPU a token), `llm_fp32` (one shared fp32 engine, for numerics against transformers or torch),
  `isolated_env`, `cpu_with_fp8_reference`.
- tests/server/conftest.py: `server`, `http`, `openai_client`, `model_id` (one shared server with an API
  key), `keyless_server` (no key, sleep mode allowed), `pooling_server`, `pooling_http`. Prefer these; a test that needs
  its own flags starts its own `ServerProcess` in a module-scoped fixture.
"""
