"""sglang 0.5.23, upstream finding U7 (KV1): a page-1 EAGLE tree's decode allocates past its
req_to_token row.

Where (sglang 0.5.23): python/sglang/srt/mem_cache/allocation_sizing.py:96
(get_req_to_token_extra_context_len: the row widened to the decode reserve only on pages >
1, #26972).

The test follows:
- python/sglang/srt/speculative/eagle_utils.py:866 (eagle_prepare_for_decode: the reserve
  2A) and :891 (the row-width assert, only for page > 1 and topk > 1)
- python/sglang/srt/mem_cache/kv_cache_configurator.py:1572 and :1773 (the row: context_len
  + get_req_to_token_extra_context_len())
- python/sglang/srt/mem_cache/allocation.py:848 (alloc_for_spec_decode: kv_allocated_len)
- python/sglang/srt/managers/scheduler_components/invariant_checker.py:359
  (_check_kv_page_invariants: kv_allocated_len <= row_width)

What happens: a page-1 tree's decode reserve 2 * steps * topk exceeds the row's headroom
past the context length (4 + D_tok), so a request capped a few tokens below the context
allocates past its req_to_token row.

The claim the test asserts: kv_allocated_len <= row width (the release's
_check_kv_page_invariants asserts it).

Scenario: The server config is published for EAGLE with a tree (topk 4, 3 steps, 8 draft
tokens) on pages of 1 and a 256-token context. The release's own pools are built, the row as
kv_cache_configurator builds it (context + get_req_to_token_extra_context_len(): 256 + 12 =
268 columns). A 240-token request, its max_new_tokens capped by admission's rule (14),
starts decoding after its prefill; each decode is the release's eagle_prepare_for_decode on
a ScheduleBatch, which reserves get_alloc_reserve_per_decode() = 2 * steps * topk = 24 slots
past the committed KV, and each verify accepts only its bonus token. On 0.5.23 the decode at
kv_committed_len=245 allocates 269 slots in the 268-column row while the request is still
running (output 6 of 14). The row writer's triton kernel is replaced by its store in torch
(the pools are on the CPU), without a column bound like the kernel's.

Run it where sglang (and torch, pytest) is installed; it needs nothing else (copy it anywhere):

    pytest docs/findings/test_u7_page_1_tree_allocates_past_its_row.py

It fails on sglang 0.5.23 (the assertion message begins "U7 (KV1): ") and should pass once
the finding is fixed: a regression test.

Found by overlap-spec's upstream tier (docs/upstream-findings.md there); evidence: predicted
by KV1 on the reference (tests/test_admission.py), confirmed on sglang 0.5.23 at the
realistic preset (tests/test_upstream_tier.py); KV4 then sees the row hold fewer slots than
allocated (or, for the next row's request, a slot the overflow wrote) and KV7 the slot past
the row in no account. Written by 'overlap-spec upstream export U7'.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types
from array import array


def _stand_in_for_torchvision() -> None:
    """Serve an empty ``torchvision`` when the installed one does not import (none, or a
    CUDA build beside a CPU torch). sglang imports it at module level and the code this
    test runs never calls it. With a working torchvision this does nothing."""
    try:
        import torchvision  # noqa: F401

        return
    except Exception:  # noqa: BLE001 - a build for another torch raises more than ImportError
        for name in [m for m in sys.modules if m.split(".")[0] == "torchvision"]:
            del sys.modules[name]
    try:  # transformers caches the answer: ask before the stand-in exists
        from transformers.utils import import_utils

        import_utils.is_torchvision_available()
    except Exception:  # noqa: BLE001
        pass

    class _Module(types.ModuleType):
        def __getattr__(self, item: str) -> object:
            if item.startswith("__"):
                raise AttributeError(item)
            return type(item, (), {"__module__": self.__name__})

    class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
        def find_spec(self, fullname, path=None, target=None):
            if fullname.split(".")[0] != "torchvision":
                return None
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)

        def create_module(self, spec):
            module = _Module(spec.name)
            module.__path__ = []
            return module

        def exec_module(self, module):
            return None

    sys.meta_path.insert(0, _Finder())


_stand_in_for_torchvision()

import json  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
from sglang.srt.configs.model_config import ModelConfig  # noqa: E402
from sglang.srt.managers.schedule_batch import Req, ScheduleBatch  # noqa: E402
from sglang.srt.mem_cache import allocation  # noqa: E402
from sglang.srt.mem_cache.allocation_sizing import (  # noqa: E402
    get_req_to_token_extra_context_len,
)
from sglang.srt.mem_cache.allocator import TokenToKVPoolAllocator  # noqa: E402
from sglang.srt.mem_cache.cache_init_params import CacheInitParams  # noqa: E402
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool  # noqa: E402
from sglang.srt.mem_cache.unified_cache.component_type import ComponentType  # noqa: E402
from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache  # noqa: E402
from sglang.srt.model_executor.forward_batch_info import ForwardMode  # noqa: E402
from sglang.srt.runtime_context import SpawnRanks, publish  # noqa: E402
from sglang.srt.sampling.sampling_batch_info import SamplingBatchInfo  # noqa: E402
from sglang.srt.sampling.sampling_params import SamplingParams  # noqa: E402
from sglang.srt.server_args import ServerArgs  # noqa: E402
from sglang.srt.speculative.eagle_utils import eagle_prepare_for_decode  # noqa: E402
from sglang.srt.speculative.spec_info import SpeculativeAlgorithm  # noqa: E402

CONTEXT_LEN = 256  # the model's context length
PROMPT_LEN = 240  # a request a few tokens below it
KV_TOKENS = 1024
EOS = 2
TOKEN = 9  # every output token (never a stop)


def publish_page_1_eagle_tree(model_dir: Path) -> ServerArgs:
    """The server's config as the scheduler process publishes it: EAGLE, a tree (topk 4,
    3 steps, 8 draft tokens), page size 1, a one-layer model config without weights."""
    (model_dir / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
        "intermediate_size": 128, "num_attention_heads": 1, "num_key_value_heads": 1,
        "num_hidden_layers": 1, "vocab_size": 1000, "max_position_embeddings": CONTEXT_LEN,
        "rms_norm_eps": 1e-5, "torch_dtype": "float16", "eos_token_id": EOS,
        "bos_token_id": 1, "tie_word_embeddings": False}))
    args = ServerArgs(
        model_path=str(model_dir), device="cpu", skip_tokenizer_init=True,
        load_format="dummy", attention_backend="torch_native", disable_radix_cache=True,
        page_size=1, max_running_requests=2, max_total_tokens=KV_TOKENS,
        disable_cuda_graph=True, speculative_algorithm="EAGLE", speculative_num_steps=3,
        speculative_eagle_topk=4, speculative_num_draft_tokens=8)
    publish(args, role="scheduler", ranks=SpawnRanks(world_rank=0, dp_rank=None, gpu_id=0))
    return args


def assign_req_to_token_pool(req_pool_indices, req_to_token, start_offset, end_offset,
                             out_cache_loc, batch_size):
    """The row writer's store in torch (its triton kernel needs a GPU; the pools here are on
    the CPU): like the kernel, it stores at ``row * width + column`` with no bound on the
    column, so a write past a row lands in the next row's first columns."""
    flat = req_to_token.view(-1)
    width = req_to_token.shape[1]
    taken = 0
    for i in range(int(batch_size)):
        row, start, end = int(req_pool_indices[i]), int(start_offset[i]), int(end_offset[i])
        if row * width + end > flat.numel():
            raise IndexError(f"row {row} columns [{start}, {end}) run past the whole pool")
        flat[row * width + start:row * width + end] = out_cache_loc[
            taken:taken + end - start].to(req_to_token.dtype)
        taken += end - start


def test_u7_a_page_1_tree_decode_allocates_within_the_req_to_token_row(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    args = publish_page_1_eagle_tree(tmp_path)
    model_config = ModelConfig.from_server_args(args)
    assert model_config.context_len == CONTEXT_LEN, "setup: the model's context length"
    monkeypatch.setattr(allocation, "assign_req_to_token_pool_func", assign_req_to_token_pool)

    # The pools as the release builds them: the row is the context length plus
    # get_req_to_token_extra_context_len() (kv_cache_configurator.py:1572 and :1773).
    extra = get_req_to_token_extra_context_len()
    req_to_token_pool = ReqToTokenPool(size=2, max_context_len=CONTEXT_LEN + extra,
                                       device="cpu", enable_memory_saver=False)
    kv_pool = MHATokenToKVPool(size=KV_TOKENS, page_size=1, dtype=torch.float16,
                               head_num=1, head_dim=8, layer_num=1, device="cpu",
                               enable_memory_saver=False)
    allocator = TokenToKVPoolAllocator(size=KV_TOKENS, dtype=torch.float16, device="cpu",
                                       kvcache=kv_pool, need_sort=False)
    tree_cache = UnifiedRadixCache(params=CacheInitParams(
        req_to_token_pool=req_to_token_pool, token_to_kv_pool_allocator=allocator,
        page_size=1, disable=True, tree_components=(ComponentType.FULL,)))
    width = req_to_token_pool.req_to_token.shape[1]

    # Admission caps max_new_tokens to the context: max_req_len = context_len - 1
    # (managers/tp_worker.py:568), then min(max_new_tokens, max_req_len - input_len - 1)
    # (managers/scheduler.py:2714).
    max_req_len = model_config.context_len - 1
    params = SamplingParams(max_new_tokens=min(96, max_req_len - PROMPT_LEN - 1))
    params.normalize(None)
    req = Req("r0", "", array("q", [TOKEN] * PROMPT_LEN), params, eos_token_ids={EOS},
              vocab_size=model_config.vocab_size)
    # A request admitted before it holds the next row (rows are taken from the pool's
    # tail), so the row writer's overflow lands in that row, not past the pool.
    neighbour = Req("r1", "", array("q", [TOKEN] * 4), params, eos_token_ids={EOS},
                    vocab_size=model_config.vocab_size)

    # After their prefills: each prompt's KV in its row.
    for each in (neighbour, req):
        req_to_token_pool.alloc([each])
        prompt_len = len(each.origin_input_ids)
        slots = allocator.alloc(prompt_len)
        req_to_token_pool.write((each.kv.req_pool_idx, slice(0, prompt_len)),
                                slots.to(torch.int32))
        each.kv.kv_committed_len = each.kv.kv_allocated_len = prompt_len
    assert neighbour.kv.req_pool_idx == req.kv.req_pool_idx + 1, "setup: the next row"
    neighbour_first_slot = int(req_to_token_pool.req_to_token[neighbour.kv.req_pool_idx, 0])
    req.output_ids.append(TOKEN)
    batch = ScheduleBatch.init_new([req], req_to_token_pool, allocator, tree_cache,
                                   model_config, False, SpeculativeAlgorithm.EAGLE)
    batch.forward_mode = ForwardMode.DECODE
    batch.req_pool_indices = torch.tensor([req.kv.req_pool_idx], dtype=torch.int64)
    batch.sampling_info = SamplingBatchInfo.from_schedule_batch(batch,
                                                                model_config.vocab_size)

    # Decode until it finishes, each verify accepting only its bonus token.
    while not req.finished():
        committed = req.kv.kv_committed_len
        eagle_prepare_for_decode(batch)  # reserves 2 * steps * topk past the committed KV
        allocated = req.kv.kv_allocated_len
        written = int(req_to_token_pool.req_to_token[neighbour.kv.req_pool_idx, 0])
        assert allocated <= width, (
            f"U7 (KV1): a decode at kv_committed_len={committed} (output "
            f"{len(req.output_ids)} of max_new_tokens={params.max_new_tokens}) allocated "
            f"kv_allocated_len={allocated} in a req_to_token row of {width} columns "
            f"(context {CONTEXT_LEN} + get_req_to_token_extra_context_len()={extra}): "
            f"{allocated - width} slot(s) past the row; the next row's column 0 (the "
            f"neighbour's first KV slot, {neighbour_first_slot}) now reads {written}")
        # The verify's result (batch_result_processor.py:831, :1046, :1049).
        req.kv.kv_committed_len += 1
        req.output_ids.append(TOKEN)
        req.update_finish_state(1)
