"""Can two processes on one GPU overlap a memory-bound decode loop with compute-bound GEMMs?
The question behind running a colocated trainer and vLLM engine under CUDA MPS.

    python benchmarks/mps_overlap.py plain            # as the GPU comes: time-sliced
    export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps-pipe CUDA_MPS_LOG_DIRECTORY=/tmp/mps-log
    mkdir -p $CUDA_MPS_PIPE_DIRECTORY $CUDA_MPS_LOG_DIRECTORY && nvidia-cuda-mps-control -d
    python benchmarks/mps_overlap.py mps
    echo quit | nvidia-cuda-mps-control

'decode': batch-64 bf16 matmuls over 24 weights of 4096 x 4096 (768 MB, more than the L2 holds), as
a decode step reads its weights; 'train': 8192^3 bf16 GEMMs. Each runs 8 s alone, then both at once;
the line says each one's rate. Last, a CUDA tensor handed to a child process (CUDA IPC, as the
colocated weight sync does) is read back. The argument only labels the lines.
Figures: benchmarks/README.md, "7B LoRA at 8k with the causal kernels; MPS for the colocated GPU".
"""

import sys
import time

import torch
import torch.multiprocessing as mp


def decode(seconds, q):
    ws = [torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16) for _ in range(24)]
    x = torch.randn(64, 4096, device="cuda", dtype=torch.bfloat16)
    for w in ws:
        x = (x @ w).tanh_()
    torch.cuda.synchronize()
    n = 0
    t0 = time.time()
    while time.time() - t0 < seconds:
        for w in ws:
            x = (x @ w).tanh_()
        torch.cuda.synchronize()
        n += 1
    q.put(("decode sweeps/s", n / (time.time() - t0)))


def train(seconds, q):
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn_like(a)
    _ = a @ b  # the first GEMM pays cuBLAS's set-up
    torch.cuda.synchronize()
    n = 0
    t0 = time.time()
    while time.time() - t0 < seconds:
        for _ in range(10):
            _ = a @ b
        torch.cuda.synchronize()
        n += 10
    q.put(("train TFLOP/s", n * 2 * 8192**3 / (time.time() - t0) / 1e12))


def ipc_child(t, q):
    q.put(("ipc sum", float(t.sum().item())))


if __name__ == "__main__":
    mp.set_start_method("spawn")
    q = mp.Queue()
    label = sys.argv[1] if len(sys.argv) > 1 else "run"
    for names in (["decode"], ["train"], ["decode", "train"]):
        ps = [mp.Process(target={"decode": decode, "train": train}[n], args=(8, q)) for n in names]
        for p in ps:
            p.start()
        got = [q.get(timeout=120) for _ in ps]
        for p in ps:
            p.join()
        print(label, "+".join(names), ", ".join(f"{k} {v:.1f}" for k, v in got), flush=True)
    t = torch.ones(1000, device="cuda")
    p = mp.Process(target=ipc_child, args=(t, q))
    p.start()
    print(label, "CUDA IPC:", q.get(timeout=60), flush=True)
    p.join()
