"""Units as types: token counts, KV slot ids, pool rows and request ids are not interchangeable."""

from typing import NewType

TokenCount = NewType("TokenCount", int)  # a number of token positions
SlotId = NewType("SlotId", int)  # a KV cache slot (token-to-KV pool index)
PageId = NewType("PageId", int)  # a KV page; slot = page * page_size + offset
PoolRow = NewType("PoolRow", int)  # a req_to_token row == FutureMap row (req_pool_idx)
RequestId = NewType("RequestId", int)
StepId = NewType("StepId", int)  # one launched batch (iteration i launches B_i)
