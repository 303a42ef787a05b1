"""Request queue and token-budget scheduler (vLLM V1's design, nano-vllm's size)."""
from .request_queue import FCFSQueue, PriorityQueue, RequestQueue, create_request_queue
from .scheduler import Scheduler

__all__ = ["FCFSQueue", "PriorityQueue", "RequestQueue", "Scheduler", "create_request_queue"]
