"""KV caches: keep each layer's keys and values so decode computes only the new token's.

Without a cache, step t of generation recomputes K and V for all t previous tokens; with one,
a step reads the cache instead (memory traffic grows with S, compute per step stays flat).

Every layer store has the same interface:

    k_all, v_all, steps = store.update(k_new, v_new, start)   # write steps start.., return what to attend
    store.nbytes                                            # bytes held
    store.truncate(length)                                  # forget steps >= length (speculative rollback)

`steps` gives, for every key slot returned, the step (time index, counting left padding) of the
token it holds, -1 for an empty slot; masks are computed from it. `KVCache` holds one store per
layer that owns K/V (CLA layers that borrow another layer's K/V hold none) plus the position.
"""

from __future__ import annotations

import torch
from jaxtyping import Float, Int
from torch import Tensor


class StaticKVCache:
    """Preallocated [B, K, S_max, H] keys and values (MHA / GQA / MQA: only K heads are stored)."""

    def __init__(self, B: int, K: int, S_max: int, H: int, Hv: int, dtype: torch.dtype, device):
        self.k = torch.zeros(B, K, S_max, H, dtype=dtype, device=device)
        self.v = torch.zeros(B, K, S_max, Hv, dtype=dtype, device=device)
        self.steps = torch.arange(S_max, device=device)

    def update(
        self, k: Float[Tensor, "B K T H"], v: Float[Tensor, "B K T Hv"], start: int
    ) -> tuple[Float[Tensor, "B K S H"], Float[Tensor, "B K S Hv"], Int[Tensor, " S"]]:
        """Write the T new keys/values at steps start..start+T-1 (in place) and return what to attend.

        Returns views of the keys, values and steps of steps 0..start+T-1 (never the unwritten rest
        of the preallocated capacity). Raises ValueError (one line) if start + T > S_max.
        """
        # BEGIN SOLUTION kv_cache
        end = start + k.shape[2]
        if end > self.k.shape[2]:
            raise ValueError(f"KV cache overflow: {end} steps > capacity {self.k.shape[2]}")
        self.k[:, :, start:end] = k
        self.v[:, :, start:end] = v
        return self.k[:, :, :end], self.v[:, :, :end], self.steps[:end]
        # END SOLUTION

    def truncate(self, length: int) -> None:
        pass  # steps >= length are simply overwritten by the next update

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes


class RingKVCache:
    """Sliding-window cache: a ring buffer of W (+ spare) slots; memory does not grow with S.

    Step s lives in slot s % slots. A query at step i needs steps i-W+1..i, so when a forward
    pass brings T new tokens and T > slots - W + 1 the old slots are attended together with the
    new keys before the ring is overwritten. `spare` extra slots let `truncate` roll back up to
    `spare` steps (speculative decoding); without them a rolled-back window would be lost.
    """

    def __init__(
        self, B: int, K: int, window: int, H: int, Hv: int, dtype: torch.dtype, device, spare: int = 0
    ):
        self.window = window
        self.slots = window + spare
        self.k = torch.zeros(B, K, self.slots, H, dtype=dtype, device=device)
        self.v = torch.zeros(B, K, self.slots, Hv, dtype=dtype, device=device)
        self.steps = torch.full((self.slots,), -1, dtype=torch.long, device=device)
        self.pos = 0  # steps written so far

    def update(
        self, k: Float[Tensor, "B K T H"], v: Float[Tensor, "B K T Hv"], start: int
    ) -> tuple[Float[Tensor, "B K S H"], Float[Tensor, "B K S Hv"], Int[Tensor, " S"]]:
        """Write steps start..start+T-1 into the ring, set self.pos = start + T, return what to attend.

        Step s goes to slot s % slots, and self.steps[slot] records it (-1: empty). Returns keys,
        values and the step of each returned slot (in any order; the mask is built from steps):
        - T = 1, or T <= slots - W + 1 (every key the T queries need is still in the ring after
          the write): write first, then return the ring itself (self.k, self.v, self.steps);
        - otherwise: return the old ring concatenated with all T new keys (slots + T of them),
          computed before the write; the ring keeps only the newest min(T, slots) new steps.
        `truncate` and the model's masks rely on self.pos, so update must advance it.
        """
        # BEGIN SOLUTION ring_cache
        T = k.shape[2]
        if T == 1:  # decode: write into one slot, then attend the whole ring
            slot = start % self.slots
            self.k[:, :, slot] = k[:, :, 0]
            self.v[:, :, slot] = v[:, :, 0]
            self.steps[slot] = start
            self.pos = start + 1
            return self.k, self.v, self.steps
        new_steps = torch.arange(start, start + T, device=self.k.device)
        if T <= self.slots - self.window + 1:  # every key the T queries need fits in the ring
            out_k, out_v, out_steps = None, None, None
        else:  # attend old ring + all new keys, then keep only the newest `slots` of them
            out_k = torch.cat([self.k, k], dim=2)
            out_v = torch.cat([self.v, v], dim=2)
            out_steps = torch.cat([self.steps, new_steps])
        keep = min(T, self.slots)
        idx = new_steps[-keep:] % self.slots
        self.k.index_copy_(2, idx, k[:, :, -keep:])
        self.v.index_copy_(2, idx, v[:, :, -keep:])
        self.steps[idx] = new_steps[-keep:]
        self.pos = start + T
        if out_k is None:
            return self.k, self.v, self.steps
        return out_k, out_v, out_steps
        # END SOLUTION

    def truncate(self, length: int) -> None:
        """Forget steps >= length; fails if the window before `length` was already overwritten."""
        oldest_kept = max(0, self.pos - self.slots)
        if length < self.pos and max(0, length - self.window + 1) < oldest_kept:
            raise ValueError(
                f"cannot roll a sliding-window cache back from {self.pos} to {length} steps: "
                f"allocate it with spare >= {self.pos - length} slots"
            )
        self.steps.masked_fill_(self.steps >= length, -1)
        self.pos = min(self.pos, length)

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes


class MLACache:
    """MLA (DeepSeek-V2) cache: per token only the normalized latent c_kv [r] and the shared
    rotary key k_pe [p], i.e. kv_lora_rank + qk_rope_head_dim numbers per layer, for all heads."""

    def __init__(self, B: int, S_max: int, r: int, p: int, dtype: torch.dtype, device):
        self.c_kv = torch.zeros(B, S_max, r, dtype=dtype, device=device)
        self.k_pe = torch.zeros(B, S_max, p, dtype=dtype, device=device)
        self.steps = torch.arange(S_max, device=device)

    def update(
        self, c_kv: Float[Tensor, "B T r"], k_pe: Float[Tensor, "B T p"], start: int
    ) -> tuple[Float[Tensor, "B S r"], Float[Tensor, "B S p"], Int[Tensor, " S"]]:
        """Write the latents c_kv and rotary keys k_pe of steps start..start+T-1 (in place).

        Returns views of c_kv, k_pe and steps for steps 0..start+T-1 (like StaticKVCache.update);
        raises ValueError (one line) if start + T > S_max.
        """
        # BEGIN SOLUTION mla_cache
        end = start + c_kv.shape[1]
        if end > self.c_kv.shape[1]:
            raise ValueError(f"MLA cache overflow: {end} steps > capacity {self.c_kv.shape[1]}")
        self.c_kv[:, start:end] = c_kv
        self.k_pe[:, start:end] = k_pe
        return self.c_kv[:, :end], self.k_pe[:, :end], self.steps[:end]
        # END SOLUTION

    def truncate(self, length: int) -> None:
        pass

    @property
    def nbytes(self) -> int:
        return self.c_kv.nbytes + self.k_pe.nbytes


LayerCache = StaticKVCache | RingKVCache | MLACache


class KVCache:
    """The whole model's cache: one store per K/V-owning layer, the step counter and left padding.

    `pos` counts steps written (prompt padding included); `pad[b]` is how many leading steps of
    row b are padding (never attended to; positions for RoPE start after them).
    """

    def __init__(self, layers: list[LayerCache | None], capacity: int, pad: Tensor | None = None):
        self.layers = layers
        self.capacity = capacity
        self.pad = pad
        self.pos = 0

    @property
    def nbytes(self) -> int:
        return sum(store.nbytes for store in self.layers if store is not None)

    def truncate(self, length: int) -> None:
        """Roll back to `length` steps (speculative decoding rejects drafted tokens this way)."""
        if not 0 <= length <= self.pos:
            raise ValueError(f"cannot truncate a cache of {self.pos} steps to {length}")
        for store in self.layers:
            if store is not None:
                store.truncate(length)
        self.pos = length
