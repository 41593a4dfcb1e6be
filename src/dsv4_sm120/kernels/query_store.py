"""One launch for a C4 layer's bf16 query and key store where both run on one stream.

Outside upstream's multi-stream split of the indexer (taken only while a decode CUDA graph of up to 64 rows is
captured), a C4 layer runs its key store and its query on the current stream, back to back, and they share
nothing: the store reads the compressor's rows and writes the pool, the query reads ``wq_b``'s rows and writes
the forward's buffers; the logits, later on the same stream, read both. In eager decode each launch costs host
time that a step of few rows cannot hide (one row on a Hopper host: the store's call 17.2 us and the query's
11.0 us, against about 3 us of kernel each). ``_query_store_kernel`` does both:
programs ``[0, cdiv(tokens x heads, QUERY_BLOCK))`` rotate the queries, the others store the keys, each block as
its own kernel does it (the same jit helpers, ``query_block`` and ``store_block``), so the bytes written are
those of the two launches.

:class:`QueryStoreCall` binds what every C4 layer of one forward shares: the positions, the query's output
buffers, the store's plan, slots and mode. A layer's call keys its plan on the layouts of its own tensors only
(queries, head weights, compressed keys, pool, norm weight, the two RoPE tables; those that last as the model
does by identity) and then launches once (the forward's first layer finds the plan that an earlier forward of
the same layouts made, and binds the forward's buffers to its launch, ``launch.BoundLaunch``: a layer's call
then reads seven addresses, not thirteen); a
layout the fused launch does not take as it is (an input to copy or cast, no rows on one side) makes the two
calls of :func:`index_query_bf16` and :func:`store_index_k_bf16` instead.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from dsv4_sm120.kernels import index_k_store, index_query
from dsv4_sm120.kernels._common import cdiv
from dsv4_sm120.kernels.index_k_store import as_freqs_real, store_block
from dsv4_sm120.kernels.index_query import query_block
from dsv4_sm120.kernels.launch import Launch, kept, lasting_key, tensor_key
from dsv4_sm120.kernels.layout import HEAD_DIM, PAGE_SLOTS, ROPE_DIM

QUERY_BLOCK, STORE_BLOCK = index_query.BLOCK_N, index_k_store.BLOCK_N
_PLANS: dict = {}  # the plans of every bound call, by all of a call's layouts
_PLANS_MAX = 1 << 12
_BOUND_PLANS_MAX = 16  # a forward's C4 layers meet one layout


# As the two kernels: the store's row count and the metadata's alignment compile nothing new.
@triton.jit(do_not_specialize=["n_k_rows"],
            do_not_specialize_on_alignment=["q_pos_ptr", "plan_ptr", "k_pos_ptr", "loc_ptr"])
def _query_store_kernel(q_ptr, qw_ptr, q_out_ptr, qw_out_ptr, q_freqs_ptr, q_pos_ptr,
                        kv_ptr, plan_ptr, k_pos_ptr, loc_ptr, norm_w_ptr, k_freqs_ptr, pages_ptr,
                        n_q_rows, n_heads, weight_scale, stride_kv, n_k_rows, eps, ratio,
                        MODE: tl.constexpr, Q_BLOCK: tl.constexpr, K_BLOCK: tl.constexpr, D: tl.constexpr,
                        ROPE: tl.constexpr, PAGE: tl.constexpr):
    block = tl.program_id(0)
    query_programs = tl.cdiv(n_q_rows, Q_BLOCK)
    if block < query_programs:
        query_block(block, q_ptr, qw_ptr, q_out_ptr, qw_out_ptr, q_freqs_ptr, q_pos_ptr, n_q_rows, n_heads,
                    weight_scale, Q_BLOCK, D, ROPE)
    else:
        store_block(block - query_programs, kv_ptr, stride_kv, plan_ptr, k_pos_ptr, loc_ptr, norm_w_ptr, k_freqs_ptr,
                    pages_ptr, n_k_rows, eps, ratio, MODE, K_BLOCK, D, ROPE, PAGE)


class _Plan(NamedTuple):
    launch: Launch | None  # None: the two calls instead


class QueryStoreCall:
    """A forward's C4 query and key store, one launch a layer (see the module's docstring).

    ``positions`` are the forward's query positions, ``out`` the query's output buffers (bf16 [T, H, 128] and
    fp32 [T, H, 1], contiguous), ``out_loc`` and ``plan`` the store's slots and upstream's 16-byte plan rows,
    ``mode`` "extend" or "decode". A call returns ``out``.
    """

    __slots__ = ("positions", "out", "out_loc", "plan", "mode", "compress_ratio", "_plans")

    def __init__(self, positions: torch.Tensor, out: tuple, out_loc: torch.Tensor, plan: torch.Tensor, mode: str,
                 compress_ratio: int = 4):
        self.positions, self.out, self.out_loc, self.plan = positions, out, out_loc, plan
        self.mode, self.compress_ratio = mode, compress_ratio
        self._plans: dict = {}

    def __call__(self, q, weights, weight_scale: float, q_freqs, kv, pages, *, norm_weight, norm_eps: float,
                 k_freqs) -> tuple:
        # the layer's activations read anew (flat: one tuple to build and hash); the pool's page view, the
        # layer's norm weight and the RoPE tables last as the model does
        key = (q.shape, q.stride(), q.dtype, q.device, weights.shape, weights.stride(), weights.dtype, weights.device,
               kv.shape, kv.stride(), kv.dtype, kv.device, lasting_key(pages), lasting_key(norm_weight),
               lasting_key(q_freqs), lasting_key(k_freqs), weight_scale, norm_eps)
        call = self._plans.get(key, self)
        if call is self:  # a forward's first layer: the plan of a forward before it with these layouts, bound
            if len(self._plans) >= _BOUND_PLANS_MAX:
                self._plans.clear()
            bound = (tensor_key(self.positions), tensor_key(self.out[0]), tensor_key(self.out[1]),
                     tensor_key(self.out_loc), tensor_key(self.plan), self.mode, self.compress_ratio)
            plan = kept(_PLANS, (key, bound), _PLANS_MAX, lambda: self._plan(
                q, weights, weight_scale, q_freqs, kv, pages, norm_weight, norm_eps, k_freqs))
            call = self._plans[key] = None if plan.launch is None else plan.launch.bind(
                q_out_ptr=self.out[0], qw_out_ptr=self.out[1], q_pos_ptr=self.positions, plan_ptr=self.plan,
                k_pos_ptr=self.out_loc, loc_ptr=self.out_loc)
        if call is None:
            self._two_calls(q, weights, weight_scale, q_freqs, kv, pages, norm_weight, norm_eps, k_freqs)
        else:  # only the layer's own tensors: the forward's buffers were bound with their addresses
            call(q, weights, q_freqs, kv, norm_weight, k_freqs, pages)
        return self.out

    def _two_calls(self, q, weights, weight_scale, q_freqs, kv, pages, norm_weight, norm_eps, k_freqs) -> None:
        index_k_store.store_index_k_bf16(kv, pages, self.out_loc, norm_weight=norm_weight, norm_eps=norm_eps,
                                         freqs=k_freqs, mode=self.mode, plan=self.plan,
                                         compress_ratio=self.compress_ratio)
        index_query.index_query_bf16(q, weights, weight_scale, q_freqs, self.positions, out=self.out)

    def _plan(self, q, weights, weight_scale, q_freqs, kv, pages, norm_weight, norm_eps, k_freqs) -> _Plan:
        """Both wrappers' own checks and plans for these layouts; one launch where both take their inputs as
        they are, else the two calls."""
        query = index_query._query_plan(q, weights, weight_scale, q_freqs, self.positions, self.out)
        store = index_k_store._store_plan(kv, pages, self.out_loc, norm_weight, norm_eps, k_freqs, self.mode, None,
                                          self.plan, self.compress_ratio)
        if (query.copies or query.launch is None or store.launch is None or store.cast_weight or store.copy_freqs
                or q.device != kv.device):
            return _Plan(None)
        tokens, heads = q.shape[0], q.shape[1]
        n_q, n_k = tokens * heads, kv.shape[0]
        return _Plan(Launch(
            _query_store_kernel, (cdiv(n_q, QUERY_BLOCK) + cdiv(n_k, STORE_BLOCK),),
            dict(n_q_rows=n_q, n_heads=heads, weight_scale=float(weight_scale), stride_kv=kv.stride(0), n_k_rows=n_k,
                 eps=float(norm_eps), ratio=int(self.compress_ratio)),
            dict(MODE=index_k_store._MODES[self.mode], Q_BLOCK=QUERY_BLOCK, K_BLOCK=STORE_BLOCK, D=HEAD_DIM,
                 ROPE=ROPE_DIM, PAGE=PAGE_SLOTS),
            num_warps=4, num_stages=3,
            views={"q_freqs_ptr": as_freqs_real, "k_freqs_ptr": as_freqs_real, "plan_ptr": index_k_store._plan_words}))
