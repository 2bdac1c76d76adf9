"""The sync's checksum on the device: the value the CPU gives for the same bytes (every path: word by word, one and
two levels of row and column sums, tail bytes, views not 8-byte aligned), enqueued without waiting for the GPU."""

from __future__ import annotations

import pytest
import torch
from gpu_cases import DEVICE, ON_GPU, gpu_tier

from shardplan.sync.schedule import _LAST, _ROW, checksum_tensor

pytestmark = gpu_tier
ROW_BYTES = 8 * _ROW
SIZES = [0, 1, 7, 8, 803, 8 * _LAST, 8 * _LAST + 1, 20 * ROW_BYTES + 141, 1 << 20, (_LAST + 3) * ROW_BYTES + 78]


def host_bytes(nbytes: int) -> torch.Tensor:
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=torch.Generator().manual_seed(nbytes))


@pytest.mark.parametrize("offset", [0, 3, 8])
@pytest.mark.parametrize("nbytes", SIZES + [(65 << 20) + 5])
def test_the_device_and_the_cpu_agree(nbytes, offset):
    host = host_bytes(nbytes + offset)
    got = checksum_tensor(host.to(DEVICE)[offset:])
    assert got.device.type == torch.device(DEVICE).type and got.dtype == torch.int64 and got.shape == ()
    assert int(got) == int(checksum_tensor(host[offset:]))


@pytest.mark.skipif(not ON_GPU, reason="CUDA only")
def test_the_checksum_is_enqueued_not_waited_for():
    buf = host_bytes((9 << 20) + 11).to(DEVICE)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # any call that waits for the GPU raises
    try:
        sums = [checksum_tensor(buf[o : o + n]) for n in SIZES for o in (0, 3)]
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert all(s.is_cuda for s in sums)
