"""Context-parallel options (issue 29): vLLM's names and rules, every refused combination with a
message naming the rule and the values, the valid ones with their world size and rank layout,
the flags (long and short), the scheduler's virtual block and the KV capacity gauge."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from shardserve.config import (
    EngineConfig,
    ModelArch,
    ModelConfig,
    MultiNodeConfig,
    ParallelConfig,
)
from shardserve.config.engine import CacheConfig, group_options
from shardserve.engine.arg_utils import EngineArgs
from shardserve.engine.core_wire import SchedulerStats, sum_stats
from shardserve.entrypoints import cli
from shardserve.entrypoints.server.metrics import ServerMetrics

DCP, PCP, INTERLEAVE = ("decode_context_parallel_size", "prefill_context_parallel_size",
                        "cp_kv_cache_interleave_size")


def model_config(**options) -> ModelConfig:
    arch = ModelArch("LlamaForCausalLM", vocab_size=64, hidden_size=64, intermediate_size=64,
                     num_layers=4, num_heads=8, num_kv_heads=4, head_dim=8,
                     max_position_embeddings=256)
    return ModelConfig(path=Path("unused"), arch=arch, **options)


def engine_config(parallel: ParallelConfig, *, block_size: int = 16, **options) -> EngineConfig:
    runner = options.pop("runner", "generate")
    return EngineConfig(model_config=model_config(runner=runner), parallel_config=parallel,
                        cache_config=CacheConfig(block_size=block_size), **options)


# ---- refusals ---------------------------------------------------------------------------------
@pytest.mark.parametrize(("sizes", "words"), [
    ({"tensor_parallel_size": 4, DCP: 3}, ["decode_context_parallel_size=3", "must divide",
                                           "tensor_parallel_size=4"]),
    ({"tensor_parallel_size": 1, DCP: 2}, ["decode_context_parallel_size=2",
                                           "tensor_parallel_size=1"]),
    ({"tensor_parallel_size": 2, PCP: 2, DCP: 3}, ["decode_context_parallel_size=3",
                                                   "1, PCP or TP x PCP", "[1, 2, 4]"]),
    ({"tensor_parallel_size": 3, PCP: 2, DCP: 3}, ["decode_context_parallel_size=3",
                                                   "[1, 2, 6]"]),
    ({INTERLEAVE: 0}, ["cp_kv_cache_interleave_size=0", ">= 1"]),
    ({DCP: 0}, ["decode_context_parallel_size=0", ">= 1"]),
    ({PCP: 1.5}, ["prefill_context_parallel_size=1.5", "an int"]),
])
def test_parallel_config_refuses(sizes, words):
    with pytest.raises(ValueError) as err:
        ParallelConfig(**sizes)
    for word in words:
        assert word in str(err.value), (word, str(err.value))


@pytest.mark.parametrize("sizes", [{"tensor_parallel_size": 2, DCP: 2}, {PCP: 2}])
def test_uni_refuses_context_parallelism_naming_the_backends(sizes):
    with pytest.raises(ValueError) as err:
        ParallelConfig(distributed_executor_backend="uni", **sizes)
    message = str(err.value)
    assert "'uni' does not run context parallelism" in message
    assert "mp, ray, ray_v2, external_launcher" in message
    assert f"{next(iter(k for k in sizes if k != 'tensor_parallel_size'))}=2" in message


@pytest.mark.parametrize("interleave", [3, 32])
def test_interleave_must_divide_block_size(interleave):
    pc = ParallelConfig(tensor_parallel_size=2, decode_context_parallel_size=2,
                        cp_kv_cache_interleave_size=interleave)
    with pytest.raises(ValueError, match=f"cp_kv_cache_interleave_size={interleave} must divide "
                                         f"block_size=16"):
        engine_config(pc)


@pytest.mark.parametrize("sizes", [{"tensor_parallel_size": 2, DCP: 2}, {PCP: 2}])
@pytest.mark.parametrize(("options", "words"), [
    ({"speculative_config": {"method": "ngram", "num_speculative_tokens": 2}},
     "speculative decoding is not supported with context parallelism yet"),
    ({"enable_lora": True}, "LoRA (enable_lora=True) is not supported with context parallelism"),
])
def test_spec_decoding_and_lora_refused_with_cp(sizes, options, words):
    with pytest.raises(ValueError) as err:
        engine_config(ParallelConfig(**sizes), **options)
    assert words in str(err.value)
    assert "decode_context_parallel_size=" in str(err.value)
    engine_config(ParallelConfig(tensor_parallel_size=2), **options)  # without CP: accepted


def test_pooling_refuses_pcp_but_takes_dcp():
    with pytest.raises(ValueError, match="runner='pooling' is not supported with "
                                         "prefill_context_parallel_size=2"):
        engine_config(ParallelConfig(prefill_context_parallel_size=2), runner="pooling")
    engine_config(ParallelConfig(tensor_parallel_size=2, decode_context_parallel_size=2),
                  runner="pooling")


# ---- valid combinations -------------------------------------------------------------------------
@pytest.mark.parametrize(("sizes", "world"), [
    ({"tensor_parallel_size": 4, DCP: 2}, 4),
    ({"tensor_parallel_size": 4, DCP: 4, INTERLEAVE: 4}, 4),
    ({PCP: 2}, 2),
    ({PCP: 3}, 3),
    ({"tensor_parallel_size": 2, PCP: 2}, 4),
    ({"tensor_parallel_size": 2, "pipeline_parallel_size": 2, PCP: 2}, 8),
    ({"tensor_parallel_size": 2, PCP: 2, DCP: 1, "data_parallel_size": 2}, 4),
    ({PCP: 2, DCP: 2}, 2),
    ({"tensor_parallel_size": 2, PCP: 2, DCP: 2}, 4),
    ({"tensor_parallel_size": 2, PCP: 2, DCP: 4}, 4),
])
def test_valid_sizes_world_and_layout(sizes, world):
    pc = ParallelConfig(**sizes)
    assert pc.world_size == world and pc.context_parallel
    assert pc.distributed_executor_backend == "mp"
    layout = pc.layout
    assert (layout.tp, layout.pp, layout.pcp, layout.dcp, layout.dp) == (
        pc.tensor_parallel_size, pc.pipeline_parallel_size, pc.prefill_context_parallel_size,
        pc.decode_context_parallel_size, pc.data_parallel_size)
    assert layout.world_size == world
    config = engine_config(pc)
    assert config.virtual_block_size == 16 * pc.decode_context_parallel_size


def test_pcp_layout_groups_and_descriptions():
    pc = ParallelConfig(tensor_parallel_size=2, pipeline_parallel_size=2,
                        prefill_context_parallel_size=2)
    assert pc.layout.replica_groups("pcp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert pc.describe_rank(6, "pid 9") == "rank 6 (stage 1, context shard 1, TP rank 0, pid 9)"
    with pytest.raises(ValueError, match="must divide data_parallel_size x tensor_parallel_size "
                                         "x prefill_context_parallel_size x "
                                         "pipeline_parallel_size = 8"):
        ParallelConfig(tensor_parallel_size=2, pipeline_parallel_size=2,
                       prefill_context_parallel_size=2, multinode=MultiNodeConfig(nnodes=3))


def test_dcp_groups_split_tp():
    pc = ParallelConfig(tensor_parallel_size=4, decode_context_parallel_size=2)
    assert pc.world_size == 4 and pc.layout.replica_groups("dcp") == [[0, 1], [2, 3]]
    default = ParallelConfig(tensor_parallel_size=2)
    assert not default.context_parallel and default.cp_kv_cache_interleave_size == 1


# ---- options in: LLM kwargs, EngineArgs, the command line -------------------------------------
def test_flat_options_belong_to_parallel_config():
    groups = group_options({DCP: 2, PCP: 1, INTERLEAVE: 2, "tensor_parallel_size": 2})
    assert groups == {"parallel_config": {DCP: 2, PCP: 1, INTERLEAVE: 2,
                                          "tensor_parallel_size": 2}}


@pytest.mark.parametrize("command", ["generate", "serve"])
@pytest.mark.parametrize(("flags", "expected"), [
    (["-dcp", "2", "-pcp", "3"], {DCP: 2, PCP: 3}),
    (["--decode-context-parallel-size", "4", "--prefill-context-parallel-size", "2",
      "--cp-kv-cache-interleave-size", "8"], {DCP: 4, PCP: 2, INTERLEAVE: 8}),
])
def test_cli_flags_short_and_long(command, flags, expected):
    args = cli.build_parser().parse_args(
        [command, *(["hi"] if command == "generate" else []), "--model", "m", *flags])
    kwargs = cli.engine_kwargs(args)
    assert {k: kwargs[k] for k in expected} == expected
    engine_args = EngineArgs.from_cli_args(args)
    assert all(getattr(engine_args, k) == v for k, v in expected.items())


# ---- the engine's KV capacity: stats and the /metrics gauge ----------------------------------
def test_capacity_gauge_per_engine_and_summed():
    metrics = ServerMetrics()
    metrics.set_replicas(2, [0, 1])
    metrics.on_stats(0, SchedulerStats(kv_cache_capacity_tokens=4096))
    metrics.on_stats(1, SchedulerStats(kv_cache_capacity_tokens=2048))
    text = metrics.render().decode()
    assert 'shardserve:kv_cache_capacity_tokens{engine="0"} 4096.0' in text
    assert 'shardserve:kv_cache_capacity_tokens{engine="1"} 2048.0' in text
    metrics.remove_replica(1)
    assert 'kv_cache_capacity_tokens{engine="1"}' not in metrics.render().decode()
    total = sum_stats([SchedulerStats(kv_cache_capacity_tokens=n) for n in (4096, 2048)])
    assert total.kv_cache_capacity_tokens == 6144


def test_engine_reports_its_capacity_in_tokens(tiny_llama_dir, caplog):
    """One rank, no DCP: blocks x block_size, in the start-up log line and get_metrics; too
    small a cache for max_model_len is refused counting tokens the same way."""
    from shardserve import LLM

    options = dict(dtype="float32", max_model_len=32, block_size=4, seed=0)
    with caplog.at_level(logging.INFO, logger="shardserve.engine.core"):
        llm = LLM(str(tiny_llama_dir), num_blocks_override=10, **options)
    try:
        assert llm.get_metrics()["kv_cache_capacity_tokens"] == 40
        assert "KV cache: 10 blocks x 4 tokens" in caplog.text
        assert "capacity 40 tokens (40 per rank)" in caplog.text
    finally:
        llm.shutdown()
    with pytest.raises(ValueError, match=r"the KV cache holds 28 tokens \(7 blocks of 4 tokens"):
        LLM(str(tiny_llama_dir), num_blocks_override=7, **options)


def test_llm_keywords_and_engine_args_build_the_config(tiny_llama_dir):
    """The ways in that resolve a model: LLM(...)'s keywords and EngineArgs (AsyncLLM's)."""
    from shardserve.engine.config_builder import engine_config_from_kwargs

    config = engine_config_from_kwargs(str(tiny_llama_dir), prefill_context_parallel_size=2,
                                       tensor_parallel_size=2)
    assert config.parallel_config.world_size == 4 and config.virtual_block_size == 16
    args = EngineArgs(model=str(tiny_llama_dir), tensor_parallel_size=2, block_size=8,
                      decode_context_parallel_size=2, cp_kv_cache_interleave_size=4)
    config = args.create_engine_config()
    pc = config.parallel_config
    assert (pc.world_size, pc.decode_context_parallel_size, pc.cp_kv_cache_interleave_size,
            config.virtual_block_size) == (2, 2, 4, 16)
    with pytest.raises(ValueError, match="must divide block_size=8"):
        EngineArgs(model=str(tiny_llama_dir), tensor_parallel_size=2, block_size=8,
                   decode_context_parallel_size=2, cp_kv_cache_interleave_size=16,
                   ).create_engine_config()
