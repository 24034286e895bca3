"""GPU load for the real-GPU tests, run as child processes (needs torch)."""

WORKLOAD = r"""
import os, sys, time, torch
mode, seconds = sys.argv[1], float(sys.argv[2])
dev = torch.device("cuda")
x = torch.empty(1, device=dev)
if mode == "hold":
    held = torch.empty(int(sys.argv[3]) * (1 << 20), dtype=torch.uint8, device=dev)
    torch.cuda.synchronize()
if mode == "fork-hold":
    held = torch.empty(int(sys.argv[3]) * (1 << 20), dtype=torch.uint8, device=dev)
    torch.cuda.synchronize()
    child = os.fork()
    if child == 0:          # inherits the device files, never touches CUDA again
        time.sleep(seconds)
        os._exit(0)
    print(child, flush=True)
print("ready", flush=True)
end = time.time() + seconds
if mode == "heavy":
    a = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
    b = torch.randn_like(a)
    while time.time() < end:
        for _ in range(20):
            c = a @ b
        torch.cuda.synchronize()
elif mode == "spin":        # one one-thread kernel after another: a kernel always resident
    while time.time() < end:
        for _ in range(50):
            torch.cuda._sleep(1_000_000)  # spins one thread ~0.5 ms at ~2 GHz
        torch.cuda.synchronize()
elif mode == "tiny":        # a 1-element kernel every ~2 ms: the GPU idle almost always
    while time.time() < end:
        x.add_(1)
        torch.cuda.synchronize()
        time.sleep(0.002)
elif mode == "copy":        # host <-> device copies over PCIe (pinned: full link speed)
    host = torch.empty(256 << 20, dtype=torch.uint8).pin_memory()
    device = torch.empty_like(host, device=dev)
    while time.time() < end:
        device.copy_(host, non_blocking=True)
        host.copy_(device, non_blocking=True)
        torch.cuda.synchronize()
else:
    while time.time() < end:
        time.sleep(0.1)
"""
