"""``overlap-spec upstream export FINDING``: a listed upstream finding as a standalone pytest
file an SGLang maintainer can run.

Each exported file needs only sglang (and torch, pytest) installed: it builds the release's
own objects (``Req``, ``ScheduleBatch``, the pools, the allocation sizing) and runs a small
scripted scenario through the release's own functions (``Req.update_finish_state``,
``eagle_prepare_for_decode``), then asserts the finding's claim. It is a regression test: it
fails on sglang 0.5.23 where the finding says, and passes once the bug is fixed. Nothing in
it imports overlap-spec.

The module docstring of each file is built from :data:`findings.KNOWN_FINDINGS` (the
finding, the upstream file:line, the claim), so an exported file goes stale when the
finding's text changes; the committed copies under ``docs/findings/`` are checked against
what :func:`export_finding` writes now (``tests/test_upstream_export.py``), and the upstream
test tier runs them as strict expected failures on the release.

Exporting writes text only: it never imports sglang.
"""

from __future__ import annotations

import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from overlap_spec.harness.conformance.findings import KNOWN_FINDINGS, get_known_finding

RELEASE: Final = "0.5.23"
FINDINGS_DIR: Final = Path("docs") / "findings"  # under the checkout's root
ALL: Final = "all"
_WIDTH: Final = 92


class ExportError(ValueError):
    """A finding that cannot be exported (unknown, or no template): one line."""


@dataclass(frozen=True)
class ExportTemplate:
    """One exportable finding: the file's name, what its scenario does, the upstream code
    it follows beside the finding's own file:line, the assertion message's prefix (what
    the upstream tier checks each failure for), the tests in the file (each must fail on
    the release) and the code after the shared prelude."""

    finding: str
    filename: str
    title: str
    scenario: str
    follows: tuple[str, ...]
    tests: tuple[str, ...]
    body: str

    @property
    def failure(self) -> str:
        """The prefix of every assertion message that states the finding."""
        known = get_known_finding(self.finding)
        return f"{known.id} ({known.invariant}): "


# Shared by every exported file, after its docstring. sglang imports torchvision at module
# level (configs/__init__.py -> multimodal/internvl_utils.py) and nothing here calls it; on
# a CPU-only torch the registry's torchvision builds do not load, so a stand-in is served
# only when the real one does not import (upstream/bootstrap.py does the same for the tier).
_PRELUDE = '''
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
'''

_FINISH_HELPERS = '''
from sglang.srt.managers.schedule_batch import FINISH_ABORT, Req  # noqa: E402
from sglang.srt.sampling.sampling_params import SamplingParams  # noqa: E402

EOS = 2  # the model's EOS (Req.eos_token_ids)
VOCAB = 1000
FIRST = 10  # the prefill's output token


def make_running_request(max_new_tokens: int, **sampling: object) -> Req:
    """A request after its prefill: one output token, not finished."""
    params = SamplingParams(max_new_tokens=max_new_tokens, **sampling)
    params.normalize(None)
    req = Req("r0", "", array("q", [5]), params, eos_token_ids={EOS}, vocab_size=VOCAB)
    req.output_ids.append(FIRST)
    req.update_finish_state()
    assert not req.finished(), "setup: the request finished at its prefill"
    return req


def abort_while_running(req: Req) -> None:
    """Scheduler.abort_request on a request in the running batch
    (managers/scheduler.py:5812, "Abort method 3: set `to_finish`"): the request runs one
    more forward and its result promotes the abort."""
    req.to_finish = FINISH_ABORT()


def process_verify_result(req: Req, accepted: list[int]) -> None:
    """What process_batch_result_decode does with one request's spec verify result: the
    whole accepted run appended, then the finish check
    (managers/scheduler_components/batch_result_processor.py:1046 and :1049)."""
    req.output_ids.extend(accepted)
    req.update_finish_state(len(accepted))


def visible_output(req: Req) -> list[int]:
    """What the client is sent: Req.output_ids_through_stop (managers/schedule_batch.py:1509,
    all of output_ids when finished_len is None)."""
    return list(req.output_ids_through_stop)
'''

_U5_BODY = _FINISH_HELPERS + '''

def test_u5_an_abort_promoted_by_a_verify_crossing_the_cap_shows_no_token_past_it() -> None:
    max_new_tokens = 2
    accepted = [11, 12, 13]  # 1 + 3 output tokens: past max_new_tokens=2

    # Control: without the abort the release cuts the same run at the cap.
    control = make_running_request(max_new_tokens)
    process_verify_result(control, accepted)
    assert visible_output(control) == [FIRST, 11], (
        f"control: without an abort the run is not cut at the cap: {visible_output(control)}")

    req = make_running_request(max_new_tokens)
    abort_while_running(req)
    process_verify_result(req, accepted)
    assert req.finished(), "the verify result did not finish the aborted request"
    visible = visible_output(req)
    assert len(visible) <= max_new_tokens, (
        f"U5 (RP2): the aborted request shows {len(visible)} output tokens {visible} > "
        f"max_new_tokens={max_new_tokens} (finished_len={req.finished_len}, finished_reason="
        f"{type(req.finished_reason).__name__})")
'''

_U6_BODY = "\nimport pytest  # noqa: E402" + _FINISH_HELPERS + '''
USER_STOP = 7  # a stop token the request asks for (SamplingParams.stop_token_ids)


@pytest.mark.parametrize("stop", ["eos", "stop_token_ids"])
def test_u6_an_abort_promoted_by_a_verify_holding_a_stop_shows_no_token_past_it(
        stop: str) -> None:
    stop_token = EOS if stop == "eos" else USER_STOP
    sampling: dict[str, object] = {} if stop == "eos" else {"stop_token_ids": [USER_STOP]}
    max_new_tokens = 8  # the cap plays no part: 1 + 4 output tokens
    accepted = [11, stop_token, 13, 14]
    through_stop = [FIRST, 11, stop_token]

    # Control: without the abort the release cuts the same run at the stop.
    control = make_running_request(max_new_tokens, **sampling)
    process_verify_result(control, accepted)
    assert visible_output(control) == through_stop, (
        f"control: without an abort the run is not cut at the stop: {visible_output(control)}")

    req = make_running_request(max_new_tokens, **sampling)
    abort_while_running(req)
    process_verify_result(req, accepted)
    assert req.finished(), "the verify result did not finish the aborted request"
    visible = visible_output(req)
    assert visible == through_stop, (
        f"U6 (RP5): the aborted request shows {len(visible)} output tokens {visible}, past "
        f"its stop token {stop_token} at position {through_stop.index(stop_token)}: the "
        f"environment ended it at {len(through_stop)} {through_stop} (finished_len="
        f"{req.finished_len}, finished_reason={type(req.finished_reason).__name__})")
'''

_U7_BODY = '''
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
'''

EXPORTS: Final[dict[str, ExportTemplate]] = {
    template.finding: template for template in (
        ExportTemplate(
            "U5", "test_u5_abort_shows_output_past_the_cap.py",
            "an abort promoted by a verify result that crosses max_new_tokens shows the "
            "whole accepted run.",
            "A spec-decoding request (one output token from its prefill, max_new_tokens=2) "
            "is aborted while it runs, as Scheduler.abort_request does for a request in the "
            "running batch (to_finish). Its next verify result accepts 3 tokens and is "
            "processed as process_batch_result_decode does: the run appended to output_ids, "
            "then Req.update_finish_state. The test asserts the finding's claim on what the "
            "client is sent (Req.output_ids_through_stop). A control request without the "
            "abort shows the release cutting the same run at the cap.",
            ("python/sglang/srt/managers/scheduler.py:5812 (abort_request: to_finish on a "
             "running request)",
             "python/sglang/srt/managers/scheduler_components/batch_result_processor.py:1046 "
             "and :1049 (the accepted run appended, then update_finish_state)",
             "python/sglang/srt/managers/schedule_batch.py:1509 (output_ids_through_stop)"),
            ("test_u5_an_abort_promoted_by_a_verify_crossing_the_cap_shows_no_token_past_it",),
            _U5_BODY),
        ExportTemplate(
            "U6", "test_u6_abort_shows_output_past_the_stop.py",
            "an abort promoted by a verify result that holds a stop token shows the tokens "
            "past the stop.",
            "A spec-decoding request (one output token from its prefill, max_new_tokens=8, "
            "so the cap plays no part) is aborted while it runs, as Scheduler.abort_request "
            "does for a request in the running batch (to_finish). Its next verify result "
            "accepts 4 tokens, the second of them a stop token (the model's EOS, or one of "
            "the request's stop_token_ids), and is processed as process_batch_result_decode "
            "does: the run appended to output_ids, then Req.update_finish_state. The test "
            "asserts the finding's claim on what the client is sent "
            "(Req.output_ids_through_stop): nothing past the stop. A control request "
            "without the abort shows the release cutting the same run at the stop. (The "
            "cap's case is U5's test.)",
            ("python/sglang/srt/managers/scheduler.py:5812 (abort_request: to_finish on a "
             "running request)",
             "python/sglang/srt/managers/scheduler_components/batch_result_processor.py:1046 "
             "and :1049 (the accepted run appended, then update_finish_state)",
             "python/sglang/srt/managers/schedule_batch.py:1856 (_check_token_based_finish, "
             "never reached) and :1509 (output_ids_through_stop)"),
            ("test_u6_an_abort_promoted_by_a_verify_holding_a_stop_shows_no_token_past_it"
             "[eos]",
             "test_u6_an_abort_promoted_by_a_verify_holding_a_stop_shows_no_token_past_it"
             "[stop_token_ids]"),
            _U6_BODY),
        ExportTemplate(
            "U7", "test_u7_page_1_tree_allocates_past_its_row.py",
            "a page-1 EAGLE tree's decode allocates past its req_to_token row.",
            "The server config is published for EAGLE with a tree (topk 4, 3 steps, 8 draft "
            "tokens) on pages of 1 and a 256-token context. The release's own pools are "
            "built, the row as kv_cache_configurator builds it (context + "
            "get_req_to_token_extra_context_len(): 256 + 12 = 268 columns). A 240-token "
            "request, its max_new_tokens capped by admission's rule (14), starts decoding "
            "after its prefill; each decode is the release's eagle_prepare_for_decode on a "
            "ScheduleBatch, which reserves get_alloc_reserve_per_decode() = 2 * steps * "
            "topk = 24 slots past the committed KV, and each verify accepts only its bonus "
            "token. On 0.5.23 the decode at kv_committed_len=245 allocates 269 slots in the "
            "268-column row while the request is still running (output 6 of 14). The row "
            "writer's triton kernel is replaced by its store in torch (the pools are on the "
            "CPU), without a column bound like the kernel's.",
            ("python/sglang/srt/speculative/eagle_utils.py:866 (eagle_prepare_for_decode: "
             "the reserve 2A) and :891 (the row-width assert, only for page > 1 and topk > 1)",
             "python/sglang/srt/mem_cache/kv_cache_configurator.py:1572 and :1773 (the row: "
             "context_len + get_req_to_token_extra_context_len())",
             "python/sglang/srt/mem_cache/allocation.py:848 (alloc_for_spec_decode: "
             "kv_allocated_len)",
             "python/sglang/srt/managers/scheduler_components/invariant_checker.py:359 "
             "(_check_kv_page_invariants: kv_allocated_len <= row_width)"),
            ("test_u7_a_page_1_tree_decode_allocates_within_the_req_to_token_row",),
            _U7_BODY),
    )
}


def get_exportable() -> tuple[str, ...]:
    """The findings that can be exported, in KNOWN_FINDINGS' order."""
    return tuple(known.id for known in KNOWN_FINDINGS if known.id in EXPORTS)


def get_template(finding_id: str) -> ExportTemplate:
    """The template of an exportable finding; an :class:`ExportError` (one line, naming the
    exportable ones) for any other id."""
    exportable = ", ".join(get_exportable())
    template = EXPORTS.get(finding_id.strip().upper())
    if template is None:
        known = {k.id for k in KNOWN_FINDINGS}
        why = ("has no exported test" if finding_id.strip().upper() in known
               else "is not a listed finding")
        raise ExportError(f"finding {finding_id!r} {why}; exportable: {exportable} "
                          f"(or '{ALL}' with --out DIR)")
    return template


def _paragraph(text: str, hanging: str = "") -> str:
    return textwrap.fill(text, _WIDTH, subsequent_indent=hanging, break_on_hyphens=False,
                         break_long_words=False)


def render_docstring(template: ExportTemplate) -> str:
    known = get_known_finding(template.finding)
    path = FINDINGS_DIR / template.filename
    parts = [
        _paragraph(f"sglang {RELEASE}, upstream finding {known.id} ({known.invariant}): "
                   f"{template.title}"),
        _paragraph(f"Where (sglang {RELEASE}): {known.upstream}."),
        "The test follows:\n" + "\n".join(_paragraph(f"- {line}", "  ")
                                           for line in template.follows),
        _paragraph(f"What happens: {known.summary}."),
        _paragraph(f"The claim the test asserts: {known.expected}."),
        _paragraph(f"Scenario: {template.scenario}"),
        "Run it where sglang (and torch, pytest) is installed; it needs nothing else (copy "
        "it anywhere):\n\n"
        f"    pytest {path}",
        _paragraph(
            f"It fails on sglang {RELEASE} (the assertion message begins "
            f"\"{template.failure}\") and should pass once the finding is fixed: a "
            "regression test."),
        _paragraph(f"Found by overlap-spec's upstream tier (docs/upstream-findings.md there); "
                   f"evidence: {known.reference}. Written by 'overlap-spec upstream export "
                   f"{known.id}'."),
    ]
    text = "\n\n".join(parts)
    if '"""' in text or "\\" in text:
        raise ExportError(f"{known.id}: the docstring cannot hold a triple quote or backslash")
    return f'"""{text}\n"""\n'


def export_finding(finding_id: str) -> str:
    """The standalone pytest file of ``finding_id`` (U5, U6, U7), as text."""
    template = get_template(finding_id)
    return render_docstring(template) + _PRELUDE + template.body


def get_export_filename(finding_id: str) -> str:
    return get_template(finding_id).filename


def write_exports(finding_id: str, out_dir: Path) -> list[Path]:
    """Write one finding's file (or every exportable one's, for ``all``) into ``out_dir``
    (created); returns the paths written."""
    ids = get_exportable() if finding_id.strip().lower() == ALL else (finding_id,)
    templates = [get_template(i) for i in ids]
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for template in templates:
        path = out_dir / template.filename
        path.write_text(export_finding(template.finding))
        written.append(path)
    return written


def run_export(finding_id: str | None, out_dir: str | None) -> int:
    """``overlap-spec upstream export FINDING [--out DIR]``: the file on stdout, or written
    into DIR (``all``: every exportable finding, DIR needed). Bad input is an
    :class:`ExportError` (the CLI's usage error, exit 2)."""
    exportable = ", ".join(get_exportable())
    if not finding_id:
        raise ExportError(f"upstream export needs a finding: one of {exportable} (or "
                          f"'{ALL}' with --out DIR)")
    if out_dir is None:
        if finding_id.strip().lower() == ALL:
            raise ExportError(f"upstream export {ALL} needs --out DIR (one file each)")
        sys.stdout.write(export_finding(finding_id))
        return 0
    for path in write_exports(finding_id, Path(out_dir)):
        print(f"wrote {path}")
    return 0
