import sys, traceback, time
sys.path.insert(0, __import__("os").path.abspath(__import__("os").path.join(__import__("os").path.dirname(__file__), "..", "..")))  # for upstream.bootstrap (torchvision stand-in)
t=time.time()
from upstream.bootstrap import load_sglang
load_sglang()
for m in ["sglang.srt.model_executor.forward_batch_info", "sglang.srt.model_executor.model_runner",
          "sglang.srt.layers.attention.torch_native_backend", "sglang.srt.models.llama",
          "sglang.srt.speculative.eagle_worker_v2", "sglang.srt.speculative.eagle_info",
          "sglang.srt.speculative.eagle_utils", "sglang.srt.speculative.eagle_worker_common",
          "sglang.srt.managers.tp_worker", "sglang.srt.layers.attention.intel_amx_backend"]:
    try:
        __import__(m); print("OK  ", m)
    except Exception as e:
        print("FAIL", m, type(e).__name__, str(e)[:300]); traceback.print_exc(limit=-3)
print("sgl_kernel" in sys.modules, "flashinfer" in sys.modules, time.time()-t)
