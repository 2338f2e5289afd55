"""vLLM's `llm_engine_example.py`, with the import changed: the engine's options from the command
line (EngineArgs), requests added and stepped by hand.

    python examples/llm_engine_example.py [--model M] [--max-model-len 512] [any engine flag]
"""

from __future__ import annotations

import argparse

from shardserve import EngineArgs, LLMEngine, RequestOutput, SamplingParams


def create_test_prompts() -> list[tuple[str, SamplingParams]]:
    return [
        ("A robot may not injure a human being",
         SamplingParams(temperature=0.0, logprobs=1, prompt_logprobs=1, max_tokens=16)),
        ("To be or not to be,",
         SamplingParams(temperature=0.8, top_k=5, presence_penalty=0.2, max_tokens=16)),
        ("What is the meaning of life?",
         SamplingParams(n=2, temperature=0.8, top_p=0.95, frequency_penalty=0.1,
                        max_tokens=16)),
    ]


def process_requests(engine: LLMEngine, prompts: list[tuple[str, SamplingParams]]) -> None:
    request_id = 0
    print("-" * 50)
    while prompts or engine.has_unfinished_requests():
        if prompts:
            prompt, params = prompts.pop(0)
            engine.add_request(str(request_id), prompt, params)
            request_id += 1
        outputs: list[RequestOutput] = engine.step()
        for output in outputs:
            if output.finished:
                print(output)
                print("-" * 50)


def main() -> None:
    parser = argparse.ArgumentParser(description="Demo of the LLMEngine API")
    args = EngineArgs.add_cli_args(parser).parse_args()
    engine = LLMEngine.from_engine_args(EngineArgs.from_cli_args(args))
    try:
        process_requests(engine, create_test_prompts())
    finally:
        engine.shutdown()


if __name__ == "__main__":
    main()
