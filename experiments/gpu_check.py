"""The CUDA paths, checked in one short run on a machine with a GPU (prints a comparison).

    PYTHONPATH=. python -m experiments.gpu_check

A. DDLStrategy + dense sync on one GPU over NCCL vs stock Lightning DDP (deterministic kernels):
   the final parameters must be bit-identical.
B. DenseAllreduce on CUDA tensors across 2 processes sharing the GPU over gloo: the averages must
   equal an allreduce oracle exactly, with bytes accounted and completion timestamps set.
Needs torch with CUDA and pytorch-lightning; no Hydra.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist


def _dense_on_cuda(rank: int, world: int) -> dict:
    from ddlscale.sync import DenseAllreduce

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4)).cuda()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randint(-2, 3, p.shape, device="cuda").float())
    sync = DenseAllreduce(bucket_mb=0.01, first_bucket_mb=0.01)
    named = list(model.named_parameters())
    sync.setup(named, device=torch.device("cuda"))
    for _, p in named:
        p.register_post_accumulate_grad_hook(sync.grad_ready)
    x = torch.randint(-2, 3, (8, 64), device="cuda").float() * (rank + 1)
    model(x).sum().backward()
    local = [p.grad.clone() for _, p in named]
    stats = sync.finish_step()
    exact = True
    for g, (_, p) in zip(local, named, strict=True):
        scaled = g * (1.0 / world)
        dist.all_reduce(scaled)
        exact &= torch.equal(scaled, p.grad)
    return {"exact": exact, "bytes": stats.bytes_sent, "collectives": len(stats.collectives),
            "stamped": all(r.end is not None for r in stats.collectives)}


def _fit(strategy, make_model) -> str:
    import pytorch_lightning as pl

    from ddlscale.trainer.metrics import param_sha256

    pl.seed_everything(3, verbose=False)
    model = make_model()
    trainer = pl.Trainer(accelerator="gpu", devices=1, strategy=strategy, max_steps=20, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         deterministic=True, limit_val_batches=0, num_sanity_val_steps=0)
    trainer.fit(model)
    return param_sha256(model)


def main() -> int:
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to check")
        return 0
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    ok = True
    from ddlscale.cluster import run_workers

    results = run_workers(_dense_on_cuda, 2, start_method="spawn")
    print("B dense sync on CUDA tensors, 2 ranks over gloo:", results)
    ok &= all(r["exact"] and r["stamped"] for r in results)

    from pytorch_lightning.strategies import DDPStrategy

    from ddlscale.strategy import DDLStrategy
    from ddlscale.workloads import LSTMLanguageModel, ResNetCNN

    for name, make in {"cnn": ResNetCNN, "lstm": LSTMLanguageModel}.items():
        ours = _fit(DDLStrategy(start_method="popen"), make)
        ddp = _fit(DDPStrategy(), make)
        same = ours == ddp
        ok &= same
        print(f"A {name} on 1 GPU, NCCL: ddlscale {ours[:12]} ddp {ddp[:12]} identical={same}")
    print("GPU CHECK", "PASSED" if ok else "FAILED", torch.cuda.get_device_name(0))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
