"""The runner choice (`runner`, `convert`, `pooler_config`), as vLLM's ModelConfig takes it.

    runner="generate" (default; "auto" means it for the causal LMs this engine runs)
    runner="pooling", convert="embed" ("auto" means embed): the model's final hidden states are
        pooled into one vector a prompt (LLM.embed, /v1/embeddings); nothing is sampled.

`pooler_config` (vLLM's current name; `override_pooler_config` is its older one, taken too)
chooses the pooling, see shardserve/pooling_params.py. Anything else is refused, naming it.
"""

from __future__ import annotations

from shardserve.config.checks import check
from shardserve.pooling_params import PoolerConfig, pooler_config_from

RUNNERS = ("auto", "generate", "pooling")
CONVERTS = ("auto", "none", "embed")


def resolve_runner(runner: str, convert: str, pooler_config: object,
                   override_pooler_config: object) -> tuple[str, str, PoolerConfig | None]:
    """(runner, convert, pooler config) resolved: "generate" or "pooling"; "none" or "embed";
    a PoolerConfig with the pooling runner, else None. ValueError naming what is wrong."""
    check(runner in RUNNERS, f"runner={runner!r} is not supported; choose one of "
          f"{', '.join(RUNNERS)}")
    check(convert in CONVERTS, f"convert={convert!r} is not supported; choose one of "
          f"{', '.join(CONVERTS)} (classify and reward heads are not built)")
    if runner == "auto":
        runner = "pooling" if convert == "embed" else "generate"
    if runner == "generate":
        check(convert in ("auto", "none"), f"convert={convert!r} needs runner='pooling' "
              f"(runner='generate' samples tokens)")
        check(pooler_config is None and override_pooler_config is None,
              "pooler_config applies to runner='pooling' only; drop it or set runner='pooling'")
        return runner, "none", None
    check(convert != "none", "runner='pooling' with convert='none' needs a pooling model; "
          "this engine's models are causal LMs: use convert='embed' (or 'auto')")
    check(pooler_config is None or override_pooler_config is None,
          "give pooler_config or override_pooler_config (its older name), not both")
    given = pooler_config if pooler_config is not None else override_pooler_config
    name = "pooler_config" if pooler_config is not None else "override_pooler_config"
    return runner, "embed", pooler_config_from(given, name) or PoolerConfig()
