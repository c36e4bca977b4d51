"""The benchmark's GPU-time measure (gpu_busy_ms): what the block-sparse builders' share of the
kernel time is computed from."""
import time

import pytest
import torch

from cuteattn.bench.timing import gpu_busy_ms, median_ms

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def test_gpu_busy_ms_leaves_out_the_hosts_time():
    """A call that spends 0.5 ms on the host before a tiny kernel: median_ms times the call
    (>= 0.5 ms), gpu_busy_ms only the kernel (well under it); both see a long kernel."""
    device = torch.device("cuda")
    x = torch.randn(1 << 16, device=device)

    def slow_host():
        time.sleep(0.0005)
        x.mul_(1.0)

    assert median_ms(slow_host, device, warmup=2, iters=10) >= 0.5
    assert gpu_busy_ms(slow_host, device, warmup=2, iters=10) < 0.2
    big = torch.randn(4096, 4096, device=device)
    long_kernel = lambda: big @ big  # ~0.1-1 ms of GPU work, enqueued in microseconds
    assert gpu_busy_ms(long_kernel, device) == pytest.approx(median_ms(long_kernel, device), rel=0.3)
