"""Attempt: the release's Scheduler with its REAL init_model_worker (TpModelWorker ->
ModelRunner, load_format=dummy, torch_native, device=cpu), tiny llama config."""
import json, os, sys, tempfile, traceback, time
from pathlib import Path
sys.path.insert(0, __import__("os").path.abspath(__import__("os").path.join(__import__("os").path.dirname(__file__), "..", "..")))
from overlap_spec.upstream.bootstrap import load_sglang
load_sglang()
import types
if os.environ.get("FAKE_VLLM"):
    # measurement only: RotaryEmbedding.__init__ (rotary_embedding/base.py:138) imports
    # vllm._custom_ops.rotary_embedding on a non-CUDA, non-CPU-engine device; it is only
    # called from forward_cuda, never on the native path.
    def _never(*a, **k): raise RuntimeError("vllm fallback rotary called")
    v = types.ModuleType("vllm"); c = types.ModuleType("vllm._custom_ops"); c.rotary_embedding = _never
    v._custom_ops = c; sys.modules["vllm"] = v; sys.modules["vllm._custom_ops"] = c
import torch
folder = Path(tempfile.mkdtemp(prefix="mr-model-"))
(folder / "config.json").write_text(json.dumps({
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
    "intermediate_size": 128, "num_attention_heads": 2, "num_key_value_heads": 2,
    "num_hidden_layers": 1, "vocab_size": 1000, "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-5, "torch_dtype": os.environ.get("DT", "float32"), "eos_token_id": 2,
    "bos_token_id": 1, "tie_word_embeddings": False}))
from sglang.srt.runtime_context import SpawnRanks, publish
if os.environ.get("XPU_TREE"):
    # measurement: spec_tree.py picks the tree builder / greedy verify by platform; with no
    # platform it raises (spec_tree.py:427-431, NameError sgl_build_tree_kernel_efficient);
    # take the release's own triton variants (its XPU branch) instead.
    from sglang.kernels.ops.speculative import spec_tree as _st
    _st._is_xpu = True
if os.environ.get("KVCOPY"):
    # measurement: MHATokenToKVPool.__init__ (memory_pool.py:2307) warms a triton kernel
    # when speculative decoding is on; skip the warm-up, and move KV with the release's
    # own move_kv_cache_native (SGLANG_NATIVE_MOVE_KV_CACHE=1, memory_pool.py:2251/3447).
    os.environ["SGLANG_NATIVE_MOVE_KV_CACHE"] = "1"
    from sglang.srt.mem_cache import memory_pool as _mp
    _mp.MHATokenToKVPool._init_kv_copy_and_warmup = lambda self: setattr(self, "_kv_copy_config", None)
from sglang.srt.server_args import ServerArgs, PortArgs
kw = {}
draft = Path(tempfile.mkdtemp(prefix="mr-draft-"))
dcfg = json.loads((folder / "config.json").read_text()); dcfg["architectures"] = ["LlamaForCausalLMEagle"]
(draft / "config.json").write_text(json.dumps(dcfg))
if os.environ.get("SPEC"):
    kw = dict(speculative_algorithm="EAGLE", speculative_num_steps=2, speculative_eagle_topk=1,
              speculative_num_draft_tokens=3, speculative_draft_model_path=str(draft))
args = ServerArgs(model_path=str(folder), device="cpu", skip_tokenizer_init=True,
    load_format="dummy", attention_backend=os.environ.get("ATTN", "torch_native"), disable_radix_cache=True,
    page_size=1, max_running_requests=4, max_total_tokens=512, disable_cuda_graph=True,
    dtype=os.environ.get("DT", "float32"), disable_overlap_schedule=bool(os.environ.get("NOOV")), **kw)
publish(args, role="scheduler", ranks=SpawnRanks(world_rank=0, dp_rank=None, gpu_id=0))
if os.environ.get("SPEC") and not os.environ.get("NOOV"):
    from sglang.srt.runtime_context import get_context
    get_context().override("mr", disable_overlap_schedule=False)
port_args = PortArgs.init_new(args)
from sglang.srt.managers import scheduler as sm
t = time.time()
try:
    sched = sm.Scheduler(args, port_args)
    print("enable_overlap", sched.enable_overlap); print("SCHEDULER BUILT", time.time() - t, type(sched.tp_worker).__name__,
          type(sched.tp_worker.model_runner).__name__)
    mr = sched.tp_worker.model_runner
    print("enable_overlap", sched.enable_overlap, "draft_worker", type(sched.draft_worker).__name__, "model_worker", type(sched.model_worker).__name__)
    print("attn_backend", type(mr.attn_backend).__name__, "model", type(mr.model).__name__)
    import builtins; builtins.SCHED = sched
except BaseException as e:
    print("FAILED after", time.time() - t, type(e).__name__, str(e)[:2000])
    traceback.print_exc()
