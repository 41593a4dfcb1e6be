"""HiCache host mirror of bf16 index-K pages, through upstream's real stack and host pool objects.

The stack is built by upstream's strategy registry (``_select_strategy`` picks
the package's strategy) on the real pool from ``configure()`` (the ``stacks``
fixture in conftest). Two things are replaced because they need a CUDA driver:
``cudaHostRegister`` (host pinning is switched off) and the page-row copy
kernels (see :mod:`cpu_page_mover`).
"""

from __future__ import annotations

import pytest
import torch

from tests.index_k import cpu_page_mover
from tests.index_k.pool_harness import HICACHE_RATIO, SLOTS_PER_FULL_PAGE


def index_host(built):
    from sglang.srt.mem_cache.hicache_storage import PoolName

    return built.host_pool_group.get_pool(PoolName.DEEPSEEK_V4_C4_INDEXER)


@pytest.mark.parametrize("layout", ["layer_first", "page_first"])
def test_bf16_mirror_is_built_by_the_registered_strategy(stacks, layout):
    from sglang.srt.mem_cache.memory_pool_host import DeepSeekV4PagedHostPool

    result, built, strategy = stacks(layout)
    host, device = index_host(built), result.token_to_kv_pool.c4_indexer_kv_pool
    assert type(strategy).__name__ == "BF16IndexKStackStrategy"
    assert isinstance(host, DeepSeekV4PagedHostPool) and type(host).__name__ == "BF16IndexKHostPool"
    assert host.layout == layout and host.index_k_ledger is None  # integrity mode off by default
    assert host.item_bytes == 16384 and host.page_aligned_only
    assert [b.data_ptr() for b in host.device_buffers] == [b.data_ptr() for b in device.index_k_with_scale_buffer]
    # Upstream's ratio rule: host pages = device FULL pages x --hicache-ratio, as for the C4 KV mirror.
    device_full_pages = -(-result.token_to_kv_pool_allocator.size_full // SLOTS_PER_FULL_PAGE)
    assert host.num_host_pages == int(device_full_pages * HICACHE_RATIO)
    from sglang.srt.mem_cache.hicache_storage import PoolName

    assert built.host_pool_group.get_pool(PoolName.DEEPSEEK_V4_C4).num_host_pages == host.num_host_pages


def test_fp8_keeps_upstreams_strategy_and_mirror(stacks):
    result, built, strategy = stacks("layer_first", "fp8")
    host = index_host(built)
    assert type(strategy).__name__ == "_DeepSeekV4Strategy"
    assert host.item_bytes == 8448 and not host.page_aligned_only


def _host_pages(host, count, gen):
    """``count`` host pages from the host pool's own allocator, in random order."""
    slots = host.alloc(host.num_host_pages * SLOTS_PER_FULL_PAGE)
    host.free(slots)
    pages = slots.reshape(-1, SLOTS_PER_FULL_PAGE)[:, 0] // SLOTS_PER_FULL_PAGE
    return pages[torch.randperm(len(pages), generator=gen)[:count]]


def refuse_sub_page_tail(host, device_pool, device_page: int, host_page: int, io="kernel") -> None:
    """A request's last, partial page: the bf16 mirror refuses it both ways and writes nothing.

    Upstream's strategy would hand it to ``transfer_cache_dsv4_mla``, which addresses a
    main-KV token (576 + 8 B) and cannot move a bf16 index-K token (the stand-in is a trap).
    """
    half = SLOTS_PER_FULL_PAGE // 2
    host_slots = cpu_page_mover.pages_to_slots(torch.tensor([host_page]), SLOTS_PER_FULL_PAGE)[:half]
    device_slots = cpu_page_mover.pages_to_slots(torch.tensor([device_page]), SLOTS_PER_FULL_PAGE)[:half]
    host_before = host.get_data_page(host_page * SLOTS_PER_FULL_PAGE, flat=False).clone()
    device_before = [buf[device_page].clone() for buf in host.device_buffers]
    with pytest.raises(ValueError, match="page-aligned"):
        host.backup_from_device_all_layer(device_pool, host_slots, device_slots, io)
    with pytest.raises(ValueError, match="page-aligned"):
        host.load_to_device_per_layer(device_pool, host_slots, device_slots, 0, io)
    assert torch.equal(host.get_data_page(host_page * SLOTS_PER_FULL_PAGE, flat=False), host_before)
    assert all(torch.equal(buf[device_page], before) for buf, before in zip(host.device_buffers, device_before))


def round_trip(host, device_pool, batches, load_splits, gen, fill=True, tail=True, io="kernel"):
    """Back up each (device pages, host pages) batch, scribble the device, load back elsewhere.

    Returns the number of pages that made the round trip. Every reloaded page
    must equal its original byte for byte; every other device page must still
    hold the scribble (a load writes only its targets). ``tail`` also offers a
    partial last page after the backups, which must be refused with nothing
    written (the backed-up host page it names must still reload exact).
    ``fill=False`` keeps the pool's current bytes as the originals (the long run fills once).
    """
    rows = host.device_buffers
    if fill:
        for buf in rows:
            buf.copy_(torch.randint(0, 256, buf.shape, dtype=torch.uint8, generator=gen))
    src_pages = torch.cat([d for d, _ in batches])
    host_pages = torch.cat([h for _, h in batches])
    original = [buf[src_pages] for buf in rows]
    for dev_pages, host_batch in batches:
        host.backup_from_device_all_layer(
            device_pool, cpu_page_mover.pages_to_slots(host_batch, SLOTS_PER_FULL_PAGE),
            cpu_page_mover.pages_to_slots(dev_pages, SLOTS_PER_FULL_PAGE), io)
    if tail:
        refuse_sub_page_tail(host, device_pool, int(src_pages[-1]), int(host_pages[-1]), io)
    for buf in rows:
        buf.bitwise_not_()  # the scribble: every device byte now differs from its backup
    scribbled = [buf.clone() for buf in rows]

    targets = torch.randperm(rows[0].shape[0], generator=gen)[: len(src_pages)]  # load into other pages
    for layer in range(len(rows)):
        for part in torch.tensor_split(torch.arange(len(src_pages)), load_splits):
            host.load_to_device_per_layer(
                device_pool, cpu_page_mover.pages_to_slots(host_pages[part], SLOTS_PER_FULL_PAGE),
                cpu_page_mover.pages_to_slots(targets[part], SLOTS_PER_FULL_PAGE), layer, io)
        assert torch.equal(rows[layer][targets], original[layer]), f"layer {layer}: reload differs"
        untouched = torch.ones(rows[layer].shape[0], dtype=torch.bool)
        untouched[targets] = False
        assert torch.equal(rows[layer][untouched], scribbled[layer][untouched]), "a load wrote outside its pages"
    return len(src_pages)


def _scenario(name, num_device_pages, host, gen):
    if name == "random":
        picks = torch.randperm(num_device_pages, generator=gen)[:64]
        sizes = [7, 25, 32]
    elif name == "page_boundaries":  # first and last device pages, first and last host pages
        picks = torch.tensor([0, 1, num_device_pages - 2, num_device_pages - 1])
        sizes = [4]
    else:  # partial batches: many small backups of uneven size
        picks = torch.randperm(num_device_pages, generator=gen)[:23]
        sizes = [1, 2, 5, 7, 8]
    hosts = (torch.tensor([0, host.num_host_pages - 1, 1, host.num_host_pages - 2])
             if name == "page_boundaries" else _host_pages(host, len(picks), gen))
    return list(zip(torch.split(picks, sizes), torch.split(hosts, sizes)))


# (--hicache-mem-layout, --hicache-io-backend) as sglang resolves them, and the ops each one calls for
# whole pages (backup, load): docs/index_k.md, the HiCache mirror.
PATHS = {
    ("layer_first", "kernel"): ("transfer_kv_all_layer_mla", "transfer_kv_per_layer_mla"),
    ("page_first", "kernel"): ("transfer_kv_all_layer_mla_lf_pf", "transfer_kv_per_layer_mla_pf_lf"),
    ("layer_first", "direct"): ("transfer_kv_direct", "transfer_kv_direct"),
    ("page_first_direct", "direct"): ("transfer_kv_all_layer_direct_lf_pf", "transfer_kv_per_layer_direct_pf_lf"),
}


@pytest.mark.parametrize("layout, io", list(PATHS), ids=[f"{layout}-{io}" for layout, io in PATHS])
@pytest.mark.parametrize("scenario, load_splits", [("random", 1), ("page_boundaries", 2), ("partial_batches", 3)])
def test_round_trip_is_byte_exact(stacks, monkeypatch, layout, io, scenario, load_splits):
    """Whole pages come back byte for byte through upstream's dispatch; a partial tail page is refused."""
    result, built, strategy = stacks(layout)
    host, device_pool = index_host(built), result.token_to_kv_pool.c4_indexer_kv_pool
    assert type(strategy).__name__ == "BF16IndexKStackStrategy" and host.layout == layout
    calls = cpu_page_mover.install(monkeypatch, host)
    gen = torch.Generator().manual_seed(hash((layout, io, scenario)) % 2**31)
    batches = _scenario(scenario, host.device_buffers[0].shape[0], host, gen)
    assert round_trip(host, device_pool, batches, load_splits, gen, io=io) == sum(len(d) for d, _ in batches)
    assert "transfer_cache_dsv4_mla" not in calls
    backup, load = PATHS[layout, io]
    assert calls[backup] >= 1 and calls[load] >= 1 and set(calls) == {backup, load}


@pytest.mark.parametrize("layout", ["layer_first", "page_first"])
def test_sub_page_transfers_are_refused(stacks, monkeypatch, layout):
    result, built, _ = stacks(layout)
    host, device_pool = index_host(built), result.token_to_kv_pool.c4_indexer_kv_pool
    calls = cpu_page_mover.install(monkeypatch, host)
    half_page = torch.arange(SLOTS_PER_FULL_PAGE // 2)
    with pytest.raises(ValueError, match="page-aligned"):
        host.backup_from_device_all_layer(device_pool, half_page, half_page, "kernel")
    with pytest.raises(ValueError, match="page-aligned"):
        host.load_to_device_per_layer(device_pool, half_page, half_page, 0, "kernel")
    assert calls == {}


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["layer_first", "page_first"])
def test_round_trip_100k_pages(stacks, monkeypatch, layout):
    result, built, _ = stacks(layout)
    host, device_pool = index_host(built), result.token_to_kv_pool.c4_indexer_kv_pool
    cpu_page_mover.install(monkeypatch, host)
    gen = torch.Generator().manual_seed(100_000)
    num_device_pages, moved, fill = host.device_buffers[0].shape[0], 0, True
    while moved < 100_000:
        picks = torch.randperm(num_device_pages, generator=gen)
        sizes = torch.randint(1, 64, (num_device_pages,), generator=gen).cumsum(0)
        sizes = torch.diff(sizes[sizes < num_device_pages], prepend=torch.tensor([0])).tolist()
        picks = picks[: sum(sizes)]
        hosts = _host_pages(host, len(picks), gen)
        moved += round_trip(host, device_pool, list(zip(torch.split(picks, sizes), torch.split(hosts, sizes))),
                             4, gen, fill, tail=fill)
        fill = False
    assert moved >= 100_000
