"""Between the executors of a prefill engine and a decode engine (--prefill-replicas): a
decode executor rank asks the same rank of the prefill engine for a handed-over request's
blocks, and gets them as bytes.

    decode rank r  ── KVFetch ──────────────────────▶ prefill rank r (its KV server)
                   ◀── KVFetchReply, then the bytes ──

The bytes are the blocks one after another, each block every layer's K and V as the cache
holds them ([layers, 2, block_size, kv_heads, head_dim] in the cache dtype): `block_bytes`
each, which must equal the asking rank's own.

On one host the prefill rank's slots are a shared-memory file, or GPU memory shared by CUDA
IPC (--kv-buffer-device cuda): a fetch that asks `shared` gets the file or the IPC handle and
the slots the blocks are in, no bytes, and reads them there; the slots are lent to it until
its KVRelease (or a while).
"""

from __future__ import annotations

from shared.protocol.base import Message


class KVFetch(Message, tag=True):
    """Blocks `first` .. `first` + `count` - 1 of the export of `request_id`."""

    request_id: str
    first: int
    count: int
    shared: bool = False  # read them in the shared-memory file, if there is one


class CudaSlots(Message, kw_only=True):
    """A prefill rank's slots in GPU memory, as CUDA IPC opens them in another process: the
    fields of torch's own handle (`UntypedStorage._share_cuda_`), the GPU's UUID (device
    numbers differ between processes) and the slots' shape in bytes."""

    gpu_uuid: str
    handle: bytes
    storage_bytes: int
    storage_offset: int
    ref_counter: bytes
    ref_counter_offset: int
    event: bytes
    event_sync: bool
    shape: list[int]


class KVFetchReply(Message, tag=True, kw_only=True):
    """The answer to a KVFetch; with `error` empty, the bytes follow in the next frame."""

    block_bytes: int = 0
    error: str = ""
    # A shared fetch: the file (or the GPU memory) the slots are in, and the blocks' slots
    # there, in order.
    shared_file: str = ""
    cuda_slots: CudaSlots | None = None
    slots: list[int] = []


class KVRelease(Message, tag=True):
    """A shared fetch of the export of `request_id` is done: its slots are free again."""

    request_id: str


class KVTransferStats(Message, kw_only=True):
    """Prefill/decode disaggregation, totals since start: blocks this engine handed over to
    decode engines, blocks it fetched from prefill engines, and fetches that failed (their
    requests computed their prompts again)."""

    blocks_exported: int = 0
    blocks_imported: int = 0
    failed_imports: int = 0
    import_seconds: float = 0.0  # the decode executor's time fetching and copying them
    block_bytes: int = 0  # a block's KV, every layer and rank
