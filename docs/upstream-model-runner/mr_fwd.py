"""After mr1.py builds the real Scheduler: admit 2 requests and step event_loop_normal's body,
observing ForwardBatch.init_new (seq_lens_sum back-fill, SL1) and the real model forward."""
import builtins, os, sys, traceback
exec(open(__import__("os").path.join(__import__("os").path.dirname(__file__), "mr1.py")).read())
sched = builtins.SCHED
from array import array
from sglang.srt.managers.schedule_batch import Req
from sglang.srt.sampling.sampling_params import SamplingParams
from sglang.srt.model_executor import forward_batch_info as fbi
orig = fbi.ForwardBatch.init_new.__func__
def init_new(cls, batch, model_runner, **kw):
    before = batch.seq_lens_sum
    fb = orig(cls, batch, model_runner, **kw)
    if os.environ.get("MINI_MR") and not model_runner.is_draft_worker:
        from types import SimpleNamespace
        mini = SimpleNamespace(is_draft_worker=False, device="cpu",
            model_config=SimpleNamespace(model_is_mrope=False, requires_mm_token_modalities=False),
            kv_index_translator=model_runner.kv_index_translator, lora_manager=None,
            prefill_attention_backend_str="torch_native",
            ngram_embedding_manager=SimpleNamespace(enabled=False))
        try:
            fb2 = orig(cls, batch, mini, **kw)
            print("  MINI init_new OK: positions equal", torch.equal(fb.positions, fb2.positions),
                  "seq_lens_sum", fb2.seq_lens_sum)
        except Exception as e:
            print("  MINI init_new FAILED", type(e).__name__, e)
    print(f"  init_new: mode={batch.forward_mode.name} seq_lens={batch.seq_lens.tolist()} "
          f"mwb.seq_lens_sum before={before} fb.seq_lens_sum={fb.seq_lens_sum} "
          f"positions={fb.positions.tolist()} out_cache_loc={batch.out_cache_loc.tolist()}")
    return fb
fbi.ForwardBatch.init_new = classmethod(init_new)
for i, n in enumerate((5, 3)):
    p = SamplingParams(max_new_tokens=4, temperature=0.0); p.normalize(None)
    req = Req(f"r{i}:", "", array("q", range(10, 10 + n)), p, vocab_size=1000, eos_token_ids={2})
    sched.init_req_max_new_tokens(req); sched._add_request_to_queue(req)
try:
    for it in range(6):
        plan = sched.get_next_batch_to_run(running_batch=sched.running_batch, last_batch=sched.last_batch)
        sched.running_batch = plan.running_batch; batch = plan.batch_to_run
        if batch is None:
            print(it, "idle"); break
        print(it, batch.forward_mode.name, "bs", len(batch.reqs), "ScheduleBatch.seq_lens_sum", batch.seq_lens_sum)
        result = sched.run_batch(batch)
        print("   next_token_ids", result.next_token_ids.tolist(), "ScheduleBatch.seq_lens_sum after", batch.seq_lens_sum)
        sched.process_batch_result(batch, result)
        sched.last_batch = batch
    for r in sched.running_batch.reqs if sched.running_batch else []:
        print(r.rid, list(r.output_ids), r.finished())
    print("FORWARD OK")
except BaseException as e:
    print("FORWARD FAILED", type(e).__name__, str(e)[:1500]); traceback.print_exc()
