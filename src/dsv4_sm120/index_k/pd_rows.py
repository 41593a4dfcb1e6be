"""What the decode's and the prefill's PD page checks share: the switch, the registered buffers' page rows, their
checksums, the device's side stream, and where a receiver keeps its destination pages.

Both checks (:mod:`.pd_integrity`, the send/receive sums; :mod:`.pd_late_writes`, the decode's re-reads) read
the KV buffers NIXL registered, in place, as rows of whole pages, and queue their checksums where no forward
waits for them.
"""

from __future__ import annotations

import contextlib
import ctypes
import threading

SWITCH = "DSV4_SM120_INDEX_K_CHECKSUM"
DST = "_dsv4_index_k_dst_pages"  # a decode receiver's destination pages, in the order the prefill addresses them

_lock = threading.Lock()
_side_streams: dict = {}


def page_rows(kv_args, i: int):
    """uint8 [pages, item] view of registered buffer ``i`` (no copy), in host or device memory."""
    import torch

    item, ptr = kv_args.kv_item_lens[i], kv_args.kv_data_ptrs[i]
    pages = kv_args.kv_data_lens[i] // item
    kinds = getattr(kv_args, "kv_data_mem_kinds", None)
    if kinds is not None and kinds[i] == "DRAM":
        return torch.frombuffer((ctypes.c_uint8 * (pages * item)).from_address(ptr), dtype=torch.uint8).view(pages, item)

    class _Device:
        __cuda_array_interface__ = {"shape": (pages, item), "typestr": "|u1", "data": (ptr, False),
                                    "version": 3, "strides": None}

    return torch.as_tensor(_Device(), device=f"cuda:{kv_args.gpu_id}")


def side_stream(device):
    """The device's checksum stream, made once: the sums neither wait behind later forwards nor hold them up."""
    import torch

    with _lock:
        if device not in _side_streams:
            _side_streams[device] = torch.cuda.Stream(device)
        return _side_streams[device]


@contextlib.contextmanager
def behind_current(device, wait_event=None):
    """Run the block on the device's side stream, queued after all the current stream has queued (and after
    ``wait_event``): the host waits for nothing."""
    import torch

    side = side_stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    if wait_event is not None:
        side.wait_event(wait_event)
    with torch.cuda.stream(side):
        yield side


def row_sums(rows: list, index):
    """int64 [len(rows), n]: the checksum of rows ``index`` of each page-row view (``kernels.page_checksum``)."""
    import torch

    from dsv4_sm120.kernels.page_checksum import page_checksum

    return torch.stack([page_checksum(r.index_select(0, index)) for r in rows])
