"""`worker_cls` on every backend that builds its worker in this process (uni, external_launcher)
as on mp: the named subclass is what runs, and its own methods answer collective_rpc."""

from __future__ import annotations

import pytest

from shardserve import LLM

# external_launcher with one rank runs in this process; the variables are torchrun's.
_LAUNCHER_ENV = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1",
                 "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}  # fmt: skip


@pytest.mark.parametrize("backend", ["uni", "external_launcher", "mp"])
def test_worker_cls_is_the_class_built(tiny_llama_dir, monkeypatch, backend) -> None:
    if backend == "external_launcher":
        for name, value in _LAUNCHER_ENV.items():
            monkeypatch.setenv(name, value)
    llm = LLM(str(tiny_llama_dir), max_model_len=128, distributed_executor_backend=backend,
              worker_cls="faulty_worker.MarkedWorker")  # fmt: skip
    try:
        assert llm.collective_rpc("worker_class_name") == ["MarkedWorker"]
    finally:
        llm.shutdown()
