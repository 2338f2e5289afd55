"""`shardserve generate`: real subprocess runs on the default model, plus in-process checks of the
argument plumbing (flags derived from the config dataclasses, prompt file parsing)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from sync_helpers import PipeText, frozen

from shardserve.config.engine import OWNERS, option_names
from shardserve.engine.arg_utils import _ENGINE_RENAMES as cli_renames
from shardserve.entrypoints import cli, cli_generate

FAST = ["--dtype", "float32", "--max-model-len", "256", "--max-tokens", "8", "--temperature", "0"]
SUMMARY = re.compile(
    r"^summary: requests=(\d+) prompt_tokens=(\d+) output_tokens=(\d+) "
    r"elapsed_s=(\d+\.\d+) output_tokens_per_s=(\d+\.\d+)$",
    re.MULTILINE,
)


def run_cli(
    *args: str, stdin: str | None = None, cwd: Path | None = None, timeout: float = 120
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "shardserve", *args],
        input=stdin if stdin is not None else "",
        capture_output=True,
        text=True,
        cwd=cwd,
        timeout=timeout,
    )


@pytest.fixture(scope="module")
def llm(default_model_path):
    from shardserve import LLM

    engine = LLM(dtype="float32", max_model_len=256)
    yield engine
    engine.shutdown()


def greedy():
    from shardserve import SamplingParams

    return SamplingParams(max_tokens=8, temperature=0)


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


# ---- subprocess runs on the default model ----
@pytest.mark.slow
def test_prompt_args_output_jsonl_matches_in_process(llm, tmp_path):
    prompts = ["Hello, my name is", "The capital of France is"]
    out = tmp_path / "out.jsonl"
    proc = run_cli("generate", *prompts, *FAST, "--output", str(out))
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr
    records = read_jsonl(out)
    expected = llm.generate(prompts, greedy(), use_tqdm=False)
    assert [r["prompt"] for r in records] == prompts
    for record, want in zip(records, expected, strict=True):
        assert set(record) >= {"prompt", "text", "token_ids", "finish_reason"}
        assert record["token_ids"] == want.outputs[0].token_ids
        assert record["text"] == want.outputs[0].text
        assert record["finish_reason"] == "length"
        assert record["text"] in proc.stdout
    assert proc.stdout.index(prompts[0]) < proc.stdout.index(records[0]["text"])
    match = SUMMARY.search(proc.stderr)
    assert match, proc.stderr
    n_req, n_prompt, n_out, elapsed, rate = match.groups()
    assert (int(n_req), int(n_out)) == (2, 16)
    assert int(n_prompt) == sum(len(r.prompt_token_ids) for r in expected)
    assert float(elapsed) > 0 and float(rate) > 0
    assert "Generating" in proc.stderr  # tqdm bar for more than one prompt, on stderr
    assert "Generating" not in proc.stdout


@pytest.mark.slow
def test_input_file_with_chat_matches_llm_chat(llm, tmp_path):
    (tmp_path / "prompts.txt").write_text("What is 2+2?\n\nName a colour.\n")
    out = tmp_path / "out.jsonl"
    proc = run_cli(
        "generate", "--input", "prompts.txt", "--chat", *FAST, "--output", "out.jsonl",
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr
    records = read_jsonl(out)
    assert [r["prompt"] for r in records] == ["What is 2+2?", "Name a colour."]
    conversations = [[{"role": "user", "content": r["prompt"]}] for r in records]
    expected = llm.chat(conversations, greedy(), use_tqdm=False)
    assert [r["token_ids"] for r in records] == [e.outputs[0].token_ids for e in expected]
    assert SUMMARY.search(proc.stderr).group(1) == "2"


@pytest.mark.slow
def test_stdin_jsonl_with_token_ids_and_text(llm, tmp_path):
    tokenizer = llm.get_tokenizer()
    ids = tokenizer.encode("Once upon a time", add_special_tokens=True)
    lines = [json.dumps({"prompt_token_ids": ids}), json.dumps({"prompt": "Once upon a time"})]
    out = tmp_path / "out.jsonl"
    proc = run_cli("generate", *FAST, "--output", str(out), stdin="\n".join(lines) + "\n")
    assert proc.returncode == 0, proc.stderr
    records = read_jsonl(out)
    assert records[0]["prompt"] == ids and records[1]["prompt"] == "Once upon a time"
    expected = llm.generate({"prompt_token_ids": ids}, greedy(), use_tqdm=False)[0]
    assert records[0]["token_ids"] == records[1]["token_ids"] == expected.outputs[0].token_ids
    assert SUMMARY.search(proc.stderr).group(2) == str(2 * len(ids))


@pytest.mark.slow
def test_ctrl_c_exits_130(default_model_path, tmp_path):
    proc = subprocess.Popen(
        [sys.executable, "-m", "shardserve", "generate", "--dtype", "float32",
         "--max-model-len", "256", "--max-tokens", "200", "--ignore-eos", "--input", "-"],
        stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
    )
    stderr = PipeText(proc.stderr)
    try:
        proc.stdin.write(b"A story about a dragon\n" * 4)
        proc.stdin.close()
        stderr.read_until(lambda text: "Generating" in text, "progress bar", timeout_s=120)
        # Ctrl-C while it generates, for certain: frozen, it has written all it will for now;
        # the bar's final "4/4" (printed when the last request ends) is not among it, so the
        # SIGINT, pending until it continues, lands in generate.
        with frozen(proc.pid):
            stderr.drain()
            assert "4/4" not in stderr.text and "summary:" not in stderr.text, stderr.text
            os.kill(proc.pid, signal.SIGINT)
        stderr.read_to_eof()
        assert proc.wait(60) == 130, stderr.text
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert "Traceback" not in stderr.text, stderr.text


# ---- bad input: exit 2, `error: ...`, no traceback ----
def test_bad_temperature_exits_2_naming_the_field():
    proc = run_cli("generate", "hi", "--temperature", "-1", timeout=60)
    assert proc.returncode == 2
    assert proc.stderr.startswith("error: ") and "temperature" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_missing_model_path_exits_2(tmp_path):
    missing = tmp_path / "no-such-model"
    proc = run_cli("generate", "hi", "--model", str(missing), timeout=60)
    assert proc.returncode == 2
    assert proc.stderr.startswith("error: ") and str(missing) in proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["generate", ""], "empty"),
        (["generate", "hi", "--top-p", "0"], "top_p"),
        (["generate", "--input", "/no/such/file.txt"], "/no/such/file.txt"),
        (["generate", "hi", "--block-size", "3"], "block_size"),
    ],
)
def test_bad_input_in_process(argv, needle, capsys):
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and needle in err


def test_unparsable_flag_value_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["generate", "hi", "--max-tokens", "many"])
    assert e.value.code == 2


# ---- flags derived from the config dataclasses ----
def test_every_engine_init_field_is_a_flag():
    parser = cli.build_parser()
    sub = parser._subparsers._group_actions[0].choices["generate"]
    flags = {opt for action in sub._actions for opt in action.option_strings}
    # Every option LLM(...) takes (the nested Ray and multi-node configs' too), except the
    # replica index the front end sets on each replica's copy.
    assert {cls.__name__ for cls in OWNERS.values()} <= {c.__name__ for c in cli.ENGINE_CONFIGS}
    for cls in OWNERS.values():
        for name in option_names(cls) - {"data_parallel_rank"}:
            flag = "--" + cli_renames.get(name, name.replace("_", "-"))
            assert flag in flags, (cls.__name__, name)


def test_new_dataclass_field_gets_flag_type_and_docstring_help():
    @dataclasses.dataclass(frozen=True)
    class Extra:
        shiny_knob: int | None = None
        """Turns the shiny knob."""
        ratio: float = 0.5
        fast_path: bool = True

    parser = argparse.ArgumentParser()
    flags = cli.dataclass_flags(Extra, "engine")
    cli.add_flags(parser, flags)
    assert "Turns the shiny knob." in parser.format_help()
    args = parser.parse_args(["--shiny-knob", "7", "--no-fast-path"])
    assert cli.collect(args, flags) == {"shiny_knob": 7, "fast_path": False}
    assert cli.collect(parser.parse_args([]), flags) == {}


def test_engine_and_sampling_seeds_are_separate():
    parser = cli.build_parser()
    args = parser.parse_args(["generate", "x", "--seed", "5", "--engine-seed", "9",
                              "--max-num-seqs", "4", "--no-enable-chunked-prefill"])
    assert cli.engine_kwargs(args) == {
        "seed": 9, "max_num_seqs": 4, "enable_chunked_prefill": False,
    }
    sampling = cli.collect(args, cli_generate.sampling_flags())
    assert sampling == {"seed": 5}


def test_stop_flag_repeats():
    args = cli.build_parser().parse_args(["generate", "x", "--stop", "a", "--stop", "b"])
    assert cli.collect(args, cli_generate.sampling_flags()) == {"stop": ["a", "b"]}


# ---- prompt files ----
def test_parse_lines_text_skips_blank_lines():
    items = cli_generate.parse_lines(["one\n", "\n", "two\r\n"], "f", chat=False)
    assert [i.prompt for i in items] == ["one", "two"]
    chat = cli_generate.parse_lines(["one\n"], "f", chat=True)
    assert chat[0].messages == [{"role": "user", "content": "one"}]


def test_parse_lines_jsonl_kinds():
    lines = ['{"prompt": "a"}', '{"prompt_token_ids": [1, 2]}',
             '{"messages": [{"role": "user", "content": "hi"}]}']
    a, b, c = cli_generate.parse_lines(lines, "f", chat=False)
    assert a.prompt == "a"
    assert b.prompt == {"prompt_token_ids": [1, 2]}
    assert c.messages == [{"role": "user", "content": "hi"}] and c.prompt is None


@pytest.mark.parametrize(
    "bad",
    ['{"prompt": ""}', '{"prompt_token_ids": []}', '{"prompt_token_ids": ["x"]}',
     '{"messages": [{"role": "user"}]}', '{"other": 1}', '{"prompt": "a", "messages": []}',
     "not json"],
)
def test_parse_lines_jsonl_errors_name_the_line(bad):
    with pytest.raises(cli.CLIError, match=r"f:2"):
        cli_generate.parse_lines(['{"prompt": "ok"}', bad], "f", chat=False)
