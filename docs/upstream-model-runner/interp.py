import os, sys, time
sys.path.insert(0, __import__("os").path.abspath(__import__("os").path.join(__import__("os").path.dirname(__file__), "..", "..")))
from overlap_spec.upstream.bootstrap import load_sglang
load_sglang()
import torch
from sglang.kernels.ops.speculative.eagle import (build_chain_tree, prepare_verify_commit_outputs,
    prepare_draft_extend_lengths, prepare_draft_extend_layout, prepare_draft_extend_inputs, fill_bonus_tokens_func)
for name, fn in [
  ("build_chain_tree", lambda: build_chain_tree(torch.tensor([7, 8], dtype=torch.int32), torch.tensor([[1, 2], [3, 4]]), torch.tensor([5, 9]))),
  ("prepare_verify_commit_outputs", lambda: prepare_verify_commit_outputs(torch.arange(6), torch.tensor([[0, 1, -1], [3, -1, -1]]), torch.tensor([2, 1]), torch.tensor([5, 9]), num_draft_tokens=3)),
  ("prepare_draft_extend_lengths", lambda: prepare_draft_extend_lengths(torch.tensor([5, 9]), 3, 0)),
  ("prepare_draft_extend_layout", lambda: prepare_draft_extend_layout(torch.tensor([5, 9]), 3, False)),
  ("prepare_draft_extend_inputs", lambda: prepare_draft_extend_inputs(torch.tensor([2, 1]), torch.arange(6), 3)),
  ("fill_bonus_tokens_func", lambda: fill_bonus_tokens_func(torch.arange(6), torch.tensor([2, 1]), torch.zeros(2, dtype=torch.int32), 3, 2)),
]:
    t = time.time()
    try:
        out = fn(); print("OK  ", name, f"{time.time()-t:.2f}s", str(out)[:300].replace("\n", " "))
    except Exception as e:
        print("FAIL", name, type(e).__name__, str(e)[:200].replace("\n", " "))
