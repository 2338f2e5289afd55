"""vLLM's offline structured-outputs example, with the import changed: choice, regex, JSON
schema and an EBNF grammar, each constraining one generation.

    python examples/structured_outputs.py [--model M] [--max-model-len 512]
"""

from __future__ import annotations

import argparse
import json

from shardserve import LLM, SamplingParams
from shardserve.sampling_params import StructuredOutputsParams

CAR = {"type": "object", "additionalProperties": False,
       "required": ["brand", "model", "car_type"],
       "properties": {"brand": {"type": "string", "maxLength": 20},
                      "model": {"type": "string", "maxLength": 20},
                      "car_type": {"enum": ["sedan", "SUV", "Truck", "Coupe"]}}}
SQL = """root ::= select_statement
select_statement ::= "SELECT " column " from " table " where " condition
column ::= "col_1 " | "col_2 "
table ::= "table_1 " | "table_2 "
condition ::= column "= " number
number ::= "1 " | "2 "
"""
CASES = [
    ("Classify this sentiment: vLLM is wonderful!",
     StructuredOutputsParams(choice=["Positive", "Negative"])),
    ("Generate an example email address for Alan Turing, who works in Enigma. End in .com "
     "and new line. Example result: alan.turing@enigma.com\n",
     StructuredOutputsParams(regex=r"\w{1,20}@\w{1,20}\.com\n")),
    ("Generate a JSON with the brand, model and car_type of the most iconic car from the 90's",
     StructuredOutputsParams(json=CAR)),
    ("Generate an SQL query to show the 'username' and 'email' from the 'users' table.",
     StructuredOutputsParams(grammar=SQL)),
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--max-model-len", type=int, default=512)
    parser.add_argument("--dtype", default="auto")
    args = parser.parse_args()
    llm = LLM(args.model, max_model_len=args.max_model_len, dtype=args.dtype)
    try:
        for prompt, spec in CASES:
            params = SamplingParams(temperature=0.0, max_tokens=100, structured_outputs=spec)
            text = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].text
            print(f"{spec.kind}: {text!r}")
            if spec.kind == "json":
                json.loads(text, strict=False)
    finally:
        llm.shutdown()


if __name__ == "__main__":
    main()
