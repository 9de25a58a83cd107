"""GPU memory shared between processes by CUDA IPC, its handle as plain fields (a message, not
a pickle): a prefill executor shares its export slots, a decode executor that sees the same
GPU opens them and copies device to device (runner/kv_exports.py, runner/kv_imports.py).

torch's own handle is used (what torch.multiprocessing sends for a CUDA tensor): it names the
allocation the tensor's storage is in, and a counter in shared memory that keeps the
exporter's allocator from reusing the memory while another process holds it open.
"""

from __future__ import annotations

import logging

import torch

from shared.protocol import CudaSlots

logger = logging.getLogger(__name__)


def share(slots: torch.Tensor) -> CudaSlots:
    """The handle of `slots` (a contiguous CUDA tensor of bytes, kept alive by the caller)."""
    (device, handle, size, offset, counter, counter_offset, event, event_sync) = (
        slots.untyped_storage()._share_cuda_()  # type: ignore[attr-defined]
    )
    return CudaSlots(
        gpu_uuid=gpu_uuid(torch.device("cuda", device)),
        handle=handle,
        storage_bytes=size,
        storage_offset=offset,
        ref_counter=counter,
        ref_counter_offset=counter_offset,
        event=event or b"",
        event_sync=event_sync,
        shape=list(slots.shape),
    )


def open_shared(shared: CudaSlots) -> torch.Tensor | None:
    """The slots in this process, on the device of this process that is their GPU; None
    where this process sees no such GPU or CUDA cannot open the handle (another host,
    another container without the GPU, the exporting process itself)."""
    device = local_device(shared.gpu_uuid)
    if device is None:
        return None
    try:
        storage = torch.UntypedStorage._new_shared_cuda(  # type: ignore[attr-defined]
            device.index,
            shared.handle,
            shared.storage_bytes,
            shared.storage_offset,
            shared.ref_counter,
            shared.ref_counter_offset,
            shared.event,
            shared.event_sync,
        )
    except (RuntimeError, TypeError) as exc:
        logger.info("could not open the KV slots of GPU %s here: %s", shared.gpu_uuid, exc)
        return None
    flat = torch.empty(0, dtype=torch.uint8, device=device).set_(storage)
    return flat.view(shared.shape)


def gpu_uuid(device: torch.device) -> str:
    return str(torch.cuda.get_device_properties(device).uuid)


def local_device(uuid: str) -> torch.device | None:
    """This process's device that is the GPU `uuid`, if it sees that GPU."""
    if not torch.cuda.is_available():
        return None
    for index in range(torch.cuda.device_count()):
        device = torch.device("cuda", index)
        if gpu_uuid(device) == uuid:
            return device
    return None
