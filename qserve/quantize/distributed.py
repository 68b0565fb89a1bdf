"""Data-parallel calibration: llm-compressor's oneshot in N processes started by torchrun.

Each rank calibrates on its own contiguous share of the calibration samples; llm-compressor sums
the GPTQ Hessians (and reduces observer statistics) across ranks: the single-process computation
with the floating-point sums in another order, so close to it but not bit-exact (README, "Scale").

Two things qserve does itself, both measured here with llm-compressor 0.14 / compressed-tensors 0.19:
- It splits the samples before oneshot. Handed the same dataset on every rank, llm-compressor's
  sampler selects each rank's share but the DataLoader indexes the full dataset with it
  (llmcompressor/datasets/utils.py, `_make_sampler` and its caller): every rank calibrates on the
  first 1/N of the samples, and the rest are never seen.
- It starts the process group with gloo when there is no accelerator: compressed-tensors'
  `init_dist` reads `torch.accelerator.current_accelerator().type`, which fails on a CPU-only
  machine (compressed_tensors/distributed/utils.py). With an accelerator, `init_dist` runs as is.
"""

from __future__ import annotations

import json
import os
import shlex
import sys
from pathlib import Path

from qserve.errors import QserveError
from qserve.progress import info
from qserve.quantize.experts import check_every_expert_calibrated, sum_records
from qserve.runtime.process import ProcessGroup
from qserve.spec.recipe import Recipe


def torchrun_command(job: Path, nproc: int, nnodes: int = 1, node_rank: int = 0, rdzv_endpoint: str | None = None) -> list[str]:
    """`torchrun` (as `python -m torch.distributed.run`) starting this module's worker on `job`;
    node 0 is the machine `qserve quantize` runs on."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc)]
    if nnodes > 1:
        if not rdzv_endpoint:
            raise QserveError("--nnodes above 1 needs --rdzv-endpoint HOST:PORT (the node-rank-0 machine)")
        cmd += ["--nnodes", str(nnodes), "--node-rank", str(node_rank), "--rdzv-backend", "c10d"]
        cmd += ["--rdzv-endpoint", rdzv_endpoint]
    else:
        cmd += ["--standalone"]
    return cmd + ["-m", "qserve.quantize.distributed", str(job)]


def check_nodes(nnodes: int, accelerator: str | None) -> None:
    """Calibration across machines only where llm-compressor puts each rank on a device it has. Its
    get_main_device (llmcompressor/utils/dev.py, 0.14) takes the device index from the GLOBAL rank, so
    a second node's ranks would ask for `cuda:8` and up; on CPUs every rank calibrates on the CPU."""
    if nnodes > 1 and accelerator is not None:
        raise QserveError(
            f"--nnodes {nnodes} on {accelerator}: llm-compressor puts rank R on {accelerator}:R (the global rank), "
            f"so the ranks of every node after the first ask for devices they do not have; calibrate on one node "
            f"(--nproc up to its device count)"
        )


def current_accelerator() -> str | None:
    """torch's accelerator type here (cuda, xpu, ...), None on a CPU-only machine."""
    import torch

    return torch.accelerator.current_accelerator().type if torch.accelerator.is_available() else None


def samples_per_rank(count: int, world: int) -> list[int]:
    return [len(range(*share_bounds(count, r, world))) for r in range(world)]


def share_bounds(count: int, rank: int, world: int) -> tuple[int, int]:
    """Rank `rank`'s contiguous share of `count` samples (llm-compressor's own partition formula)."""
    return count * rank // world, count * (rank + 1) // world


def launch(
    model_path: Path, recipe: Recipe, texts: list[str], out_dir: Path, trust_remote_code: bool, nproc: int, **nodes
) -> dict:
    """Run the workers (their output goes where this process's stdout/stderr go: the run's log);
    returns what the manifest records: ranks, samples per rank, each rank's peak RSS."""
    if len(texts) < nproc * nodes.get("nnodes", 1):
        raise QserveError(f"{len(texts)} calibration samples cannot be split between {nproc} processes")
    job = out_dir.parent / f"{out_dir.name}.job.json"
    job.write_text(
        json.dumps(
            {
                "model": str(model_path),
                "recipe": recipe.model_dump(),
                "texts": texts,
                "out": str(out_dir),
                "trc": trust_remote_code,
            }
        )
    )
    cmd = torchrun_command(job, nproc, **nodes)
    _tell_other_nodes(job, nproc, **nodes)
    env = os.environ | {"OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // nproc))}
    try:
        # A process group of its own with a guard: the workers end with qserve, however it ends.
        workers = ProcessGroup(cmd, env=env, stdout=None, stderr=None)
        try:
            code = workers.wait()
        finally:
            workers.close()
        if code != 0:
            raise QserveError(f"torchrun exited with {code}; the workers' errors are in the log")
        peaks = [json.loads(p.read_text()) for p in sorted(out_dir.parent.glob(f"{out_dir.name}.rank-*.json"))]
    finally:
        job.unlink(missing_ok=True)
        for p in out_dir.parent.glob(f"{out_dir.name}.rank-*.json"):
            p.unlink()
    world = nproc * nodes.get("nnodes", 1)
    counts = [p.pop("experts") for p in peaks]
    experts_record = sum_records(counts) if counts and counts[0] else None
    if experts_record:
        check_every_expert_calibrated(experts_record)
    return {
        "experts": experts_record,
        "nproc": nproc,
        "world_size": world,
        "samples_per_rank": samples_per_rank(len(texts), world),
        "ranks": peaks,
        "torchrun": cmd[1:-1],
    }


def _tell_other_nodes(job: Path, nproc: int, nnodes: int = 1, rdzv_endpoint: str | None = None) -> None:
    """The command each other machine runs; the job file, model and output must be on storage they share."""
    for rank in range(1, nnodes):
        info(f"on node {rank} run: {shlex.join(torchrun_command(job, nproc, nnodes, rank, rdzv_endpoint))}")


def init_process_group() -> None:
    """compressed-tensors' init_dist with an accelerator; gloo on CPU, where init_dist fails."""
    import torch
    import torch.distributed as dist

    if torch.accelerator.is_available():
        from compressed_tensors.offload import init_dist

        init_dist()
    else:
        dist.init_process_group(backend="gloo", init_method="env://")


def worker(job_path: Path) -> None:
    """One rank: its share of the samples through the llm-compressor backend, saving collectively."""
    import torch.distributed as dist

    from qserve.quantize.backends import llmcompressor
    from qserve.quantize.execution import peak_rss_mib

    job = json.loads(job_path.read_text())
    init_process_group()
    try:
        rank, world = dist.get_rank(), dist.get_world_size()
        start, end = share_bounds(len(job["texts"]), rank, world)
        out = Path(job["out"])
        recipe = Recipe.model_validate(job["recipe"])
        experts = llmcompressor.run_oneshot(
            Path(job["model"]), recipe, job["texts"][start:end], out, job["trc"], distributed=True
        )
        peak = {"rank": rank, "samples": end - start, "peak_rss_mib": peak_rss_mib(), "experts": experts}
        (out.parent / f"{out.name}.rank-{rank}.json").write_text(json.dumps(peak))
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    worker(Path(sys.argv[1]))
