"""LoRA adapters over the OpenAI API, through the official `openai` client: adapters given with
--lora-modules (both forms) listed in /v1/models under their base model and served by name
(float32 greedy equal to HF + peft), an unknown model a 404 naming the adapters, every refusal
of a bad adapter a 400 naming its field, run-time load / use / unload / use again (404) with
the admin key, and the profile endpoints. One server for the module (the tiny model)."""

from __future__ import annotations

import json
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest
from lora_helpers import edit_adapter_config, make_peft_adapter, peft_greedy, peft_model
from server_helpers import API_KEY, TINY_ARGS, Server

from shardserve.worker.profiler import KERNEL_PREFIX, trace_event_names

PROMPTS = ["the cat sat on", "a b c d", "hello world, this is"]
N_TOKENS = 6


@pytest.fixture(scope="module")
def hf_tiny(tiny_llama_dir):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(tiny_llama_dir).eval()


@pytest.fixture(scope="module")
def adapters(hf_tiny, tmp_path_factory) -> dict[str, Path]:
    """Three good adapters (rank 8 and 16, all seven projections) and one of each refusal."""
    import transformers

    root = tmp_path_factory.mktemp("adapters")
    out = {"a": make_peft_adapter(hf_tiny, root / "a", rank=8, seed=1),
           "b": make_peft_adapter(hf_tiny, root / "b", rank=16, seed=2),
           "c": make_peft_adapter(hf_tiny, root / "c", rank=8, seed=3),
           "rank32": make_peft_adapter(hf_tiny, root / "rank32", rank=32, seed=4)}
    for name, change in {"modules_to_save": {"modules_to_save": ["lm_head"]},
                         "dora": {"use_dora": True},
                         "lm_head": {"target_modules": ["q_proj", "lm_head"]},
                         "embedding": {"target_modules": ["embed_tokens", "v_proj"]}}.items():
        shutil.copytree(out["a"], root / name)
        out[name] = edit_adapter_config(root / name, **change)
    other = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=hf_tiny.config.vocab_size, hidden_size=96, intermediate_size=192,
        num_hidden_layers=2, num_attention_heads=6, num_key_value_heads=3))
    out["other_base"] = make_peft_adapter(other, root / "other_base", rank=8)
    return out


@pytest.fixture(scope="module")
def server(tiny_llama_dir, adapters, tmp_path_factory):
    log_dir = tmp_path_factory.mktemp("lora_srv")
    b = json.dumps({"name": "b", "path": str(adapters["b"]), "base_model_name": "tiny-base"})
    srv = Server(tiny_llama_dir, [*TINY_ARGS, "--served-model-name", "tiny", "--enable-lora",
                                  "--max-lora-rank", "16", "--max-loras", "2",
                                  "--lora-modules", f"a={adapters['a']}", b,
                                  "--allow-runtime-lora-updating",
                                  "--profiler-dir", str(log_dir / "traces")],
                 log_dir / "server.log")
    yield srv
    srv.stop()
    assert not srv.leftovers()


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0,
                       timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def tokenizer(tiny_llama_dir):
    import transformers

    return transformers.AutoTokenizer.from_pretrained(tiny_llama_dir)


@pytest.fixture(scope="module")
def prompt_ids(tokenizer) -> list[list[int]]:
    return [tokenizer(p)["input_ids"] for p in PROMPTS]


def _greedy(client: openai.OpenAI, model: str, ids: list[int]) -> str:
    """The server's greedy continuation of a token-id prompt."""
    out = client.completions.create(model=model, prompt=ids, max_tokens=N_TOKENS,
                                    temperature=0, extra_body={"ignore_eos": True})
    return out.choices[0].text


def _peft_texts(tokenizer, hf_model, adapter: Path, prompt_ids: list[list[int]]) -> list[str]:
    """HF + peft's greedy continuations, as text."""
    tokens = peft_greedy(peft_model(hf_model, adapter), prompt_ids, N_TOKENS)
    return [tokenizer.decode(t, skip_special_tokens=True) for t in tokens]


def _load(client: openai.OpenAI, name: str, path: Path) -> httpx.Response:
    return client.post("/load_lora_adapter", body={"lora_name": name, "lora_path": str(path)},
                       cast_to=httpx.Response)


def test_models_list_adapters_under_their_base(client):
    cards = {m.id: m for m in client.models.list().data}
    assert list(cards) == ["tiny", "a", "b"]
    assert cards["a"].model_extra["parent"] == "tiny"  # the served base model
    assert cards["b"].model_extra["parent"] == "tiny-base"  # the JSON form's base_model_name
    assert client.models.retrieve("a").id == "a"


def test_each_adapter_serves_as_hf_peft(client, hf_tiny, tokenizer, adapters, prompt_ids):
    """Float32 greedy of every prompt with each adapter equals peft's; and a batch mixing the
    base model and both adapters (concurrent requests) equals each request alone."""
    runs = [(m, ids) for m in ("tiny", "a", "b") for ids in prompt_ids]
    alone = [_greedy(client, m, ids) for m, ids in runs]
    with ThreadPoolExecutor(len(runs)) as pool:
        mixed = list(pool.map(lambda run: _greedy(client, *run), runs))
    assert mixed == alone
    by_model = {m: alone[i * len(prompt_ids):(i + 1) * len(prompt_ids)]
                for i, m in enumerate(("tiny", "a", "b"))}
    for name in ("a", "b"):
        assert by_model[name] == _peft_texts(tokenizer, hf_tiny, adapters[name], prompt_ids)
        assert by_model[name] != by_model["tiny"]  # the adapter changes the outputs


def test_unknown_model_is_404_naming_the_adapters(client):
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="no-such-adapter", prompt="hi", max_tokens=2)
    assert "`no-such-adapter` does not exist" in str(e.value)
    assert "`tiny` and the LoRA adapters `a`, `b`" in str(e.value)
    with pytest.raises(openai.NotFoundError, match="no-such-adapter"):
        client.chat.completions.create(model="no-such-adapter", max_tokens=2,
                                       messages=[{"role": "user", "content": "hi"}])


@pytest.mark.parametrize(("adapter", "says"), [
    ("rank32", "LoRA rank 32 is greater than max_lora_rank 16: start the engine with "
               "max_lora_rank=32 or more (--max-lora-rank 32)"),
    ("modules_to_save", "modules_to_save=['lm_head'] is not supported"),
    ("dora", "use_dora=True is not supported"),
    ("lm_head", "adapts lm_head: embedding, lm_head and norm adapters are not supported"),
    ("embedding", "adapts model.embed_tokens: embedding, lm_head and norm adapters are not"),
    ("other_base", "does not fit the base model"),
    ("missing", "is not a folder"),
])
def test_refused_adapter_is_400_naming_the_field(client, adapters, adapter, says):
    path = adapters.get(adapter, Path("/no/such/adapter"))
    with pytest.raises(openai.BadRequestError) as e:
        _load(client, f"bad-{adapter}", path)
    assert says in str(e.value)
    assert e.value.body["param"] == "lora_path"
    with pytest.raises(openai.NotFoundError):  # not served under its name
        client.completions.create(model=f"bad-{adapter}", prompt="hi", max_tokens=2)


def test_runtime_load_use_unload_use_again(client, server, hf_tiny, tokenizer, adapters,
                                           prompt_ids):
    no_key = httpx.post(f"{server.url}/v1/load_lora_adapter", timeout=10,
                        json={"lora_name": "c", "lora_path": str(adapters["c"])})
    assert no_key.status_code == 401
    assert _load(client, "c", adapters["c"]).status_code == 200
    with pytest.raises(openai.BadRequestError, match="the name 'c' is taken"):
        _load(client, "c", adapters["a"])
    assert [m.id for m in client.models.list().data] == ["tiny", "a", "b", "c"]
    expected = _peft_texts(tokenizer, hf_tiny, adapters["c"], prompt_ids[:1])
    assert [_greedy(client, "c", prompt_ids[0])] == expected
    client.post("/unload_lora_adapter", body={"lora_name": "c"}, cast_to=httpx.Response)
    with pytest.raises(openai.NotFoundError, match="`c` does not exist"):
        client.completions.create(model="c", prompt="hi", max_tokens=2)
    with pytest.raises(openai.NotFoundError, match="no LoRA adapter named 'c'"):
        client.post("/unload_lora_adapter", body={"lora_name": "c"}, cast_to=httpx.Response)
    assert [m.id for m in client.models.list().data] == ["tiny", "a", "b"]


def test_profile_endpoints(client, server):
    post = lambda path: httpx.post(f"{server.url}{path}", headers=server.headers,  # noqa: E731
                                   timeout=60)
    assert httpx.post(f"{server.url}/start_profile", timeout=10).status_code == 401  # admin
    assert post("/stop_profile").status_code == 409
    assert post("/start_profile").status_code == 200
    again = post("/start_profile")
    assert again.status_code == 409 and "already running" in again.json()["error"]["message"]
    client.completions.create(model="a", prompt="the cat", max_tokens=3)
    stopped = post("/stop_profile")
    assert stopped.status_code == 200
    traces = stopped.json()["traces"]
    # uni: the one rank runs inside the engine core's process, so its trace holds both.
    assert [Path(t).name for t in traces] == ["trace_dp0_pp0_tp0.json"]
    names = trace_event_names(traces[0])
    assert {"kernel::rms_norm", "kernel::lora_add"} <= {n for n in names
                                                         if n.startswith(KERNEL_PREFIX)}


def test_off_without_the_flags(tiny_server):
    """The session's plain server: no run-time loading (404 naming the flag), no profiler."""
    load = httpx.post(f"{tiny_server.url}/v1/load_lora_adapter", headers=tiny_server.headers,
                      json={"lora_name": "x", "lora_path": "/x"}, timeout=10)
    assert load.status_code == 404
    assert "--allow-runtime-lora-updating" in load.json()["error"]["message"]
    profile = httpx.post(f"{tiny_server.url}/start_profile", headers=tiny_server.headers,
                         timeout=10)
    assert profile.status_code == 404 and "--profiler-dir" in profile.json()["error"]["message"]


@pytest.mark.parametrize(("extra", "says"), [
    (["--enable-lora", "--lora-modules", "big={rank32}"],
     "--lora-modules big={rank32}: LoRA rank 32 is greater than max_lora_rank 16"),
    (["--lora-modules", "a={a}"], "--lora-modules needs --enable-lora"),
    (["--enable-lora", "--lora-modules", "a"], "--lora-modules 'a': give name=path or"),
    (["--enable-lora", "--lora-modules", '{"name": "a"}'], 'needs string "name" and "path"'),
    (["--enable-lora", "--lora-modules", "a={a}", "a={a}"], "names ['a'] more than once"),
    (["--allow-runtime-lora-updating"], "--allow-runtime-lora-updating needs --enable-lora"),
    (["--profiler-config", '{"torch_profiler_dir": "/x", "delay": 1}'], "keys ['delay']"),
])
def test_bad_flags_stop_before_the_engine_starts(tiny_llama_dir, adapters, capsys, extra, says):
    from shardserve.entrypoints.cli import main

    def fill(text: str) -> str:  # "{a}" -> adapter a's path (JSON braces stay)
        for name, path in adapters.items():
            text = text.replace(f"{{{name}}}", str(path))
        return text

    argv = ["serve", "--model", str(tiny_llama_dir), *TINY_ARGS, *map(fill, extra)]
    assert main(argv) == 2
    assert fill(says) in capsys.readouterr().err
