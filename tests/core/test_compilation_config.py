"""vLLM's compilation config (`-O`, `--compilation-config`, `--cuda-graph-sizes`, `LLM(compilation_config=)`):
which steps replay CUDA graphs and of which sizes; levels and compiler keys are taken and do nothing."""
import msgspec
import pytest
from corectl.compilation import CompilationConfig, resolve_compilation_config
from corectl.config import EngineConfig
from corectl.errors import ConfigError
from corectl.server.cli.main import build_parser, main
from corectl.server.cli.serve import settings_from_args

DEFAULT_SIZES = [1, 2, 4, 8, 16, 24, 32]


@pytest.mark.parametrize("value", [None, 3, "0", {"level": 3, "custom_ops": ["none"], "splitting_ops": []}, ["3"]])
def test_levels_and_compiler_keys_keep_both_kinds_of_graph(value):
    config = resolve_compilation_config(value)
    assert config.cudagraph_mode == "FULL_AND_PIECEWISE" and config.decode_graphs and config.piecewise_graphs
    assert config.sizes(16, DEFAULT_SIZES) == [1, 2, 4, 8, 16]


@pytest.mark.parametrize(("mode", "decode", "pieces"), [
    ("full_decode_only", True, False), ("FULL", True, False), ("piecewise", False, True), ("NONE", False, False),
])
def test_each_mode_says_which_steps_replay_graphs(mode, decode, pieces):
    config = resolve_compilation_config({"cudagraph_mode": mode})
    assert (config.cudagraph_mode, config.decode_graphs, config.piecewise_graphs) == (mode.upper(), decode, pieces)


def test_vllm_older_switch_turns_graphs_off():
    assert resolve_compilation_config({"use_cudagraph": False}).cudagraph_mode == "NONE"
    assert resolve_compilation_config({"use_cudagraph": True}).cudagraph_mode == "FULL_AND_PIECEWISE"


def test_capture_sizes_replace_the_defaults_within_the_limits():
    config = resolve_compilation_config({"cudagraph_capture_sizes": [64, 8, 8, 1, 512]})
    assert config.sizes(256, DEFAULT_SIZES) == [1, 8, 64]
    capped = resolve_compilation_config('{"max_cudagraph_capture_size": 16}')
    assert capped.sizes(256, DEFAULT_SIZES) == [1, 2, 4, 8, 16]


def test_o_fragments_merge_in_order():
    config = resolve_compilation_config(["3", '{"cudagraph_mode": "FULL"}', ".cudagraph_mode=PIECEWISE",
                                         ".cudagraph_capture_sizes=[4, 2]", ".max_cudagraph_capture_size=4"])
    assert config == CompilationConfig(cudagraph_mode="PIECEWISE", cudagraph_capture_sizes=(4, 2),
                                       max_cudagraph_capture_size=4)


@pytest.mark.parametrize(("value", "message"), [
    ({"cudagraph_mode": "FAST"}, "cudagraph_mode must be one of"),
    ("{oops", "not valid JSON"),
    ({"cudagraph_capture_sizes": [0, 8]}, "positive integers, got 0"),
    ({"cudagraph_capture_sizes": []}, "cudagraph_capture_sizes is empty"),
    ({"max_cudagraph_capture_size": -1}, "positive integers, got -1"),
    (".cudagraph_mode", "expected -O.key=value"),
    ('["FULL"]', "expected a JSON object or an optimisation level"),
])
def test_a_bad_config_is_one_clear_error(value, message):
    with pytest.raises(ConfigError, match=message) as caught:
        EngineConfig.from_kwargs(compilation_config=value)
    assert "compilation_config" in str(caught.value)


def test_the_engine_config_keeps_it_resolved_through_conversion_and_messages():
    config = EngineConfig.from_kwargs(compilation_config={"use_cudagraph": False, "level": 3})
    assert config.compilation_config.cudagraph_mode == "NONE"
    # An engine process gets its config as a message: it arrives resolved the same.
    echoed = msgspec.msgpack.decode(msgspec.msgpack.encode(config), type=EngineConfig)
    assert echoed.compilation_config == config.compilation_config
    assert config.replace(max_num_seqs=8).compilation_config == config.compilation_config


def test_serve_takes_vllm_flags_for_it():
    parser = build_parser()
    args = parser.parse_args(["serve", "-O3", "-O", '{"cudagraph_mode": "FULL_DECODE_ONLY"}',
                              "--cuda-graph-sizes", "16", "4"])
    config = settings_from_args(args).engine.compilation_config
    assert config.cudagraph_mode == "FULL_DECODE_ONLY" and config.cudagraph_capture_sizes == (16, 4)
    assert settings_from_args(parser.parse_args(["serve"])).engine.compilation_config.cudagraph_mode == \
        "FULL_AND_PIECEWISE"
    dotted = settings_from_args(parser.parse_args(["serve", "-O.cudagraph_mode=NONE"]))
    assert dotted.engine.compilation_config.cudagraph_mode == "NONE"


def test_a_bad_flag_value_exits_with_one_line(capsys):
    assert main(["generate", "hi", "-O", '{"cudagraph_mode": "sometimes"}']) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "cudagraph_mode must be one of" in err[0]
