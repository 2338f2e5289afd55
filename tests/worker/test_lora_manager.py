"""worker/lora_manager.py on the tiny Llama: the CPU cache (least recently used evicted, pinned
kept, a refused adapter evicting nothing), slots over max_loras (kept where an adapter already
sits, the step's adapters never evicted for one another), the per-token slots of a step, and a
pipeline stage holding only its layers' shards."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from lora_helpers import make_peft_adapter

from shardserve.config.lora import LoRAConfig
from shardserve.lora.peft_adapter import LoRAError, load_peft_adapter
from shardserve.lora.request import LoRARequest
from shardserve.model.llama import LlamaForCausalLM
from shardserve.model.loader import iter_weights, read_arch
from shardserve.worker.lora_manager import LoRAManager

O_PROJ = "self_attn.o_proj"


@pytest.fixture(scope="module")
def reqs(tiny_llama_dir: Path, tmp_path_factory) -> dict[int, LoRARequest]:
    """Four rank-4 adapters (ids 1-4) made by peft; 5 adapts layer 0 only."""
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32)
    root = tmp_path_factory.mktemp("manager")
    out = {i: LoRARequest(f"a{i}", i, str(make_peft_adapter(hf, root / str(i), rank=4, seed=i)))
           for i in range(1, 5)}
    only0 = make_peft_adapter(hf, root / "5", rank=4, seed=5, layers_to_transform=[0])
    out[5] = LoRARequest("a5", 5, str(only0))
    return out


def manager(folder: Path, layer_range: tuple[int, int] | None = None,
            **config: int) -> LoRAManager:
    model = LlamaForCausalLM(read_arch(folder), torch.float32, layer_range=layer_range)
    model.load_weights(iter_weights(folder))
    return LoRAManager(model, LoRAConfig(max_lora_rank=8, **config), torch.float32)


def slot_a(m: LoRAManager, slot: int, layer: int = 0) -> torch.Tensor:
    return m.model.lora_layers[layer][O_PROJ].a[slot, :4]


def adapter_a(m: LoRAManager, req: LoRARequest, layer: int = 0) -> torch.Tensor:
    """The adapter's o_proj A as peft saved it (TP 1: the slot holds it whole)."""
    return load_peft_adapter(req.lora_path, m.model.arch, 8).modules[(layer, "o_proj")].a


def test_lru_and_pins(reqs, tiny_llama_dir: Path) -> None:
    m = manager(tiny_llama_dir, max_loras=2, max_cpu_loras=3)
    assert [m.add(reqs[i]) for i in (1, 2, 3)] == [True] * 3
    assert m.add(reqs[1]) is False  # already loaded: counts as just used
    assert m.add(reqs[4])  # evicts 2, the least recently used
    assert m.list() == [1, 3, 4]
    assert m.pin(3) and not m.pin(2)  # 2 is not loaded
    m.prepare([reqs[1]], [1])  # 1 used by a step: 4 is now the oldest unpinned
    assert m.add(reqs[2])
    assert m.list() == [1, 2, 3]  # 3 pinned, though older
    assert m.remove(2) and not m.remove(2)
    assert m.list() == [1, 3]


def test_all_pinned_and_refused_adapters_evict_nothing(reqs, tiny_llama_dir: Path,
                                                       tmp_path: Path) -> None:
    m = manager(tiny_llama_dir, max_loras=1, max_cpu_loras=2)
    m.add(reqs[1]), m.add(reqs[2])
    with pytest.raises(LoRAError, match=r"is not a folder"):
        m.add(LoRARequest("bad", 9, str(tmp_path / "missing")))
    assert m.list() == [1, 2]
    assert m.pin(1) and m.pin(2)
    with pytest.raises(LoRAError, match=r"max_cpu_loras=2 adapters are loaded and all are "
                                        r"pinned or in this step \(\[1, 2\]\)"):
        m.add(reqs[3])
    assert m.list() == [1, 2]


def test_prepare_assigns_slots(reqs, tiny_llama_dir: Path) -> None:
    m = manager(tiny_llama_dir, max_loras=2, max_cpu_loras=2)
    m.add(reqs[1]), m.add(reqs[2])
    m.prepare([reqs[1], None, reqs[2], reqs[1]], [3, 1, 2, 1])
    s1, s2 = m.slot_of(1), m.slot_of(2)
    assert {s1, s2} == {0, 1}
    assert m.batch.slots is not None
    assert m.batch.slots.tolist() == [s1] * 3 + [-1] + [s2] * 2 + [s1]
    assert sorted(slot for slot, _ in m.batch.groups) == [0, 1]
    torch.testing.assert_close(slot_a(m, s1), adapter_a(m, reqs[1]))
    torch.testing.assert_close(slot_a(m, s2), adapter_a(m, reqs[2]))
    with pytest.raises(ValueError, match=r"3 distinct adapters in one step \(\[1, 2, 3\]\) but "
                                         r"max_loras=2"):
        m.prepare([reqs[1], reqs[2], reqs[3]], [1, 1, 1])
    # 3 is loaded by the step itself, evicting 1 (not 2: the step uses it), into 1's slot.
    m.prepare([reqs[2], reqs[3]], [1, 1])
    assert m.list() == [2, 3] and (m.slot_of(2), m.slot_of(3)) == (s2, s1)
    torch.testing.assert_close(slot_a(m, s1), adapter_a(m, reqs[3]))
    with pytest.raises(ValueError, match=r"the LoRA batch has 2 token slots but the layer got "
                                         r"3 rows"):
        m.model.lora_layers[0][O_PROJ].add_to(torch.zeros(3, 64), torch.zeros(3, 64))
    m.prepare([None, None], [4, 2])
    assert not m.batch.active and m.batch.groups == []
    with pytest.raises(ValueError, match=r"2 requests but 1 token counts"):
        m.prepare([None, None], [4])


def test_pipeline_stage_holds_its_layers_only(reqs, tiny_llama_dir: Path) -> None:
    m = manager(tiny_llama_dir, layer_range=(1, 2), max_loras=1)
    assert set(m.model.lora_layers) == {1}
    m.prepare([reqs[1]], [2])
    torch.testing.assert_close(slot_a(m, 0, layer=1), adapter_a(m, reqs[1], layer=1))
    m.prepare([reqs[5]], [2])  # adapts layer 0 only: nothing for this stage, slot zeroed
    assert m.slot_of(5) == 0 and not slot_a(m, 0, layer=1).any()
