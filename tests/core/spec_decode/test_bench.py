"""The speculative-decoding benchmarks: `bench verify-step` on a preset, the "edit this text"
dataset (SmolLM2's tokenizer) and the acceptance figures `bench throughput` prints."""
from __future__ import annotations

import json
import re

from corectl.engine.messages import SchedulerStats
from corectl.server.bench.edit_text import acceptance, edit_text_prompts, format_acceptance
from corectl.server.bench.spec_host import union_length
from corectl.server.cli.main import main


def test_verify_step_times_decode_and_verify_steps(isolated_env, capsys):
    code = main(["bench", "verify-step", "--model", "llama-tiny", "--load-format", "dummy", "--platform", "cpu",
                 "--kv-cache-memory", "0.01", "--batch-sizes", "1,3", "--context-len", "12", "--num-steps", "2",
                 "--num-warmup-steps", "1", "-k", "2", "--profile", "--engine-steps", "3", "--gemm-rows", "4"])
    assert code == 0
    out = capsys.readouterr().out
    lines = re.findall(r"batch (\d+): decode step median [\d.]+ ms .* verify step \(k=2\) median [\d.]+ ms .*: [\d.]+x", out)
    assert lines == ["1", "3"]
    launches = re.findall(r"batch (\d+) host: the runner's launch median decode ([\d.]+) ms, verify ([\d.]+) ms", out)
    assert [b for b, *_ in launches] == ["1", "3"] and all(float(v) > 0 for _, d, v in launches)
    # --profile: each kind's steps under both profilers, the verify steps' own sampling visible.
    assert re.findall(r"== batch (\d+): 5 (\w+) steps", out) == [("1", "decode"), ("1", "verify"), ("3", "decode"), ("3", "verify")]
    verify_report = out.split("== batch 3: 5 verify steps")[1]
    assert "rejection_sample" in verify_report and "Wall time of the profiled run" in verify_report
    # --engine-steps: the running engine's steps, one row a batch size: host time against device time.
    cell = r"\| ([\d.]+) "
    rows = re.findall(r"^\| (\d+) \| 3 " + cell * 6 + r"\| (yes|no) \|$", out, re.MULTILINE)
    assert [r[0] for r in rows] == ["1", "3"]
    # Wall and host time per step; a CPU engine has no device time, so all its wall time is device idle.
    assert all(float(r[3]) > 0 and float(r[5]) > 0 and float(r[4]) == 0 and r[6] == r[3] for r in rows)
    # The two-token prompts and outputs give n-gram lookup drafts to verify in the timed steps.
    assert all(float(r[1]) > 0 for r in rows)
    parts = re.findall(r"^batch (\d+) host ms/step \(cProfile\): scheduler.schedule ([\d.]+), .*runner launch ([\d.]+),", out, re.MULTILINE)
    assert [p[0] for p in parts] == ["1", "3"] and all(float(p[2]) > 0 for p in parts)
    assert "gemm rows: CUDA only" in out


def test_union_length_counts_overlapping_intervals_once():
    assert union_length([(5.0, 9.0), (0.0, 2.0), (1.0, 3.0), (6.0, 7.0), (9.0, 10.0)]) == 3.0 + 5.0
    assert union_length([]) == 0.0


def test_edit_text_prompts_hold_a_passage_and_acceptance_figures_follow_vllm(llm_int4):
    prompts = edit_text_prompts(llm_int4.get_tokenizer(), 2)
    assert prompts[0] != prompts[1] and all(300 <= len(p) <= 400 for p in prompts)
    before = SchedulerStats(spec_decode_num_drafts=2, spec_decode_num_draft_tokens=8,
                            spec_decode_num_accepted_tokens=5, spec_decode_num_accepted_tokens_per_pos=[2, 2, 1, 0])
    after = SchedulerStats(spec_decode_num_drafts=12, spec_decode_num_draft_tokens=48,
                           spec_decode_num_accepted_tokens=35, spec_decode_num_accepted_tokens_per_pos=[12, 10, 8, 5])
    figures = acceptance(before, after)
    assert (figures["num_drafts"], figures["num_draft_tokens"], figures["num_accepted_tokens"]) == (10, 40, 30)
    assert figures["acceptance_rate"] == 0.75 and figures["mean_accepted_length"] == 4.0
    assert figures["acceptance_by_position"] == [1.0, 0.8, 0.7, 0.5]
    assert "acceptance rate 0.750 (30/40 draft tokens), mean accepted length 4.00" in format_acceptance(figures)
    assert acceptance(after, after) is None


def test_throughput_compares_with_and_without_speculation_in_alternating_passes(isolated_env, capsys, tmp_path):
    saved = tmp_path / "c3.json"
    code = main(["bench", "throughput", "--model", "llama-tiny", "--load-format", "dummy", "--platform", "cpu",
                 "--kv-cache-memory", "0.01", "--num-prompts", "2", "--input-len", "8", "--output-len", "6",
                 "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 2}',
                 "--spec-compare-base", "--passes", "2", "--save-result", str(saved)])
    assert code == 0
    out = capsys.readouterr().out
    lines = re.findall(r"^Pass (\d) \((\w+) first\): ([\d.]+) output tokens/s with speculation, ([\d.]+) without: "
                       r"([\d.]+)x$", out, re.MULTILINE)
    assert [(n, first) for n, first, *_ in lines] == [("1", "speculative"), ("2", "base")]
    assert all(float(spec) > 0 and float(base) > 0 for _, _, spec, base, _ in lines)
    assert re.search(r"^With speculation against without, 2 passes: median [\d.]+x \(min [\d.]+x, max [\d.]+x\)$",
                     out, re.MULTILINE)
    passes = json.loads(saved.read_text())["passes"]
    assert [p["first"] for p in passes] == ["speculative", "base"]
    assert all(abs(p["ratio"] - p["speculative"] / p["base"]) < 1e-9 for p in passes)
