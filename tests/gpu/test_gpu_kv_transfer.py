"""TorchDistributedConnector over NCCL between two GPUs: a prefill engine (a process on the second
GPU) saves its prompts' blocks, this process's decode engine (first GPU) loads them device to
device, all of them asked for at once, and decodes the producer's own greedy tokens (fp32, so no
near-ties), computing only each prompt's last token; every block returns to its pool.
"""
import json
import os
import subprocess
import sys

import pytest
import torch

if torch.cuda.device_count() < 2:
    pytest.skip("needs two CUDA or ROCm GPUs", allow_module_level=True)

from corectl import LLM, SamplingParams  # noqa: E402
from support.server import free_port  # noqa: E402

MAX_TOKENS = 8
# Lengths that end mid-block and on a block boundary, up to llama-tiny's 512 positions.
_generator = torch.Generator().manual_seed(7)
PROMPTS = [torch.randint(3, 512, (n,), generator=_generator).tolist() for n in (37, 48, 70, 300, 500)]
ENGINE = {"model": "llama-tiny", "load_format": "dummy", "platform": "cuda", "dtype": "float32",
          "kv_cache_memory_gib": 0.5}

_PRODUCER = """
import json, sys, time
from corectl import LLM, SamplingParams
engine, prompts, url = json.loads(sys.argv[1]), json.loads(sys.argv[2]), sys.argv[3]
llm = LLM(**engine, kv_transfer_config={"kv_connector": "TorchDistributedConnector", "kv_role": "kv_producer",
                                        "kv_connector_extra_config": {"rendezvous": url}})
inputs = [{"prompt_token_ids": p} for p in prompts]
params = [SamplingParams(temperature=0.0, max_tokens=1, kv_transfer_params={"do_remote_decode": True,
          "transfer_id": f"gpu-{i}"}) for i in range(len(prompts))]
llm.generate(inputs, params, use_tqdm=False)
assert llm.engine.executor.worker.kv_connector.saves_published(timeout=60)
reference = llm.generate(inputs, SamplingParams(temperature=0.0, max_tokens=int(sys.argv[4])), use_tqdm=False)
print("reference", json.dumps([list(o.outputs[0].token_ids) for o in reference]), flush=True)
time.sleep(300)
"""


def test_nccl_transfers_give_the_producers_tokens():
    url = f"tcp://127.0.0.1:{free_port()}"
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", ",".join(map(str, range(torch.cuda.device_count()))))
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": visible.split(",")[1]}
    producer = subprocess.Popen([sys.executable, "-c", _PRODUCER, json.dumps(ENGINE), json.dumps(PROMPTS), url,
                                 str(MAX_TOKENS)], stdout=subprocess.PIPE, text=True, env=env)
    try:
        line = ""
        while not line.startswith("reference "):
            line = producer.stdout.readline()
            assert line, "the producer ended before its reference tokens"
        reference = json.loads(line.removeprefix("reference "))
        consumer = LLM(**ENGINE, kv_transfer_config={"kv_connector": "TorchDistributedConnector",
                                                     "kv_role": "kv_consumer",
                                                     "kv_connector_extra_config": {"rendezvous": url}})
        assert consumer.engine.executor.worker.kv_connector.access.distributed_backend == "nccl"
        params = [SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, kv_transfer_params={
            "do_remote_prefill": True, "transfer_id": f"gpu-{i}"}) for i in range(len(PROMPTS))]
        outputs = consumer.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    finally:
        producer.kill()
        producer.wait()
    assert [list(o.outputs[0].token_ids) for o in outputs] == reference
    stats = consumer.engine.scheduler.make_stats()
    assert stats.kv_load_failures == 0
    assert stats.prompt_tokens_computed == len(PROMPTS)
    assert stats.prompt_tokens_transferred == sum(len(p) - 1 for p in PROMPTS)
    assert consumer.engine.scheduler.kv.num_free_blocks == consumer.engine.scheduler.kv.num_usable_blocks
    consumer.engine.executor.worker.kv_connector.close()
