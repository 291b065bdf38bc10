"""``dmltrain bench losses``: forward+backward time of every instance loss.

Each loss runs on one random P×K batch (``--batch`` embeddings of ``--dim``); the figure is
the median over ``--repeat`` timed calls after warm-up, the losses interleaved round by round. Two yardsticks measured in the same
run: the bare ``B×B×D`` similarity GEMM (``x @ x.T``, the one O(B²D) step every instance
loss needs; a fused forward+backward needs three of them), and, where pytorch-metric-learning
has the same loss, PML's time for it with its default reducers and the matching miner.
The last line summarises both ratios. Nothing is asserted: it reports.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import warnings
from collections.abc import Callable

import torch
from tqdm import tqdm

from dmltrain.errors import UserError
from dmltrain.losses import build_loss, is_proxy_loss, loss_names


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--batch", type=int, default=180, help="embeddings per batch (default 180, the ICE/RLL recipes)"
    )
    parser.add_argument("--dim", type=int, default=512, help="embedding size (default 512)")
    parser.add_argument("--samples-per-class", type=int, default=3, help="K of the P×K batch (default 3: 60×3 as RLL)")
    parser.add_argument("--repeat", type=int, default=20, help="timed calls per loss (median reported; default 20)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed calls first (default 3)")
    parser.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    parser.add_argument("--losses", default=None, help="comma-separated subset of the instance losses")
    parser.add_argument("--no-pml", action="store_true", help="skip the pytorch-metric-learning comparison")


def _pml_peers() -> dict[str, Callable[[], Callable]]:
    """Our name -> factory of PML's ``fn(embeddings, labels)`` for the same loss (same hyperparameters).

    Empty when pytorch-metric-learning is not installed (it is a dev dependency).
    """
    try:
        from pytorch_metric_learning import losses, miners
    except ImportError:
        print("pytorch-metric-learning is not installed: no peer timings", file=sys.stderr)
        return {}
    # PML warns that Tn = 10 (the RLL paper's T) may overflow; it is the setting being compared
    warnings.filterwarnings("ignore", message="Values of Tp or Tn are too high")

    def with_miner(loss, miner):
        return lambda e, y: loss(e, y, miner(e, y))

    return {
        "contrastive": lambda: losses.ContrastiveLoss(pos_margin=0.0, neg_margin=1.0),
        "triplet": lambda: with_miner(
            losses.TripletMarginLoss(margin=0.2), miners.TripletMarginMiner(margin=0.2, type_of_triplets="semihard")
        ),
        "multi_similarity": lambda: with_miner(
            losses.MultiSimilarityLoss(alpha=2, beta=50, base=0.5), miners.MultiSimilarityMiner(epsilon=0.1)
        ),
        "lifted_structure": lambda: losses.LiftedStructureLoss(neg_margin=1.0, pos_margin=0.0),
        "npair": lambda: losses.NPairsLoss(),
        "snca": lambda: losses.NCALoss(softmax_scale=20.0),
        "ranked_list": lambda: losses.RankedListLoss(margin=0.4, Tn=10.0, alpha=1.2, imbalance=0.5),
    }


def _time_interleaved(
    jobs: dict[str, Callable[[], None]], repeat: int, warmup: int, sync: Callable[[], None], progress
) -> dict[str, float]:
    """Median milliseconds of each job.

    Rounds interleave the jobs (every job once per round), so a load change on a shared
    machine hits all of them alike instead of whichever ran at that moment.
    """
    times: dict[str, list[float]] = {k: [] for k in jobs}
    for i in range(warmup + repeat):
        for key, job in jobs.items():
            sync()
            t0 = time.perf_counter()
            job()
            sync()
            if i >= warmup:
                times[key].append((time.perf_counter() - t0) * 1e3)
        progress.update(1)
    return {k: statistics.median(v) for k, v in times.items()}


def _fwd_bwd(fn: Callable, x, labels) -> Callable[[], None]:
    def job() -> None:
        x.grad = None
        fn(x, labels).backward()

    return job


def run(args: argparse.Namespace) -> int:
    if args.batch < 2 or args.dim < 1 or args.repeat < 1 or args.samples_per_class < 2:
        raise UserError("bench losses: need --batch >= 2, --dim >= 1, --repeat >= 1, --samples-per-class >= 2")
    if args.batch % args.samples_per_class:
        raise UserError(
            f"bench losses: --batch {args.batch} is not a multiple of --samples-per-class {args.samples_per_class}"
        )
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise UserError(f"bench losses: --device {args.device}: no CUDA device here")
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)

    names = [n for n in loss_names() if not is_proxy_loss(n)]
    if args.losses:
        wanted = [n.strip() for n in args.losses.split(",") if n.strip()]
        unknown = sorted(set(wanted) - set(names))
        if unknown:
            raise UserError(
                f"bench losses: --losses: unknown instance loss(es) {', '.join(unknown)} (choose from {', '.join(names)})"
            )
        names = [n for n in names if n in wanted]
    peers = {} if args.no_pml else _pml_peers()

    torch.manual_seed(0)
    K = args.samples_per_class
    P = args.batch // K
    labels = torch.arange(P, device=device).repeat_interleave(K)
    x = torch.randn(args.batch, args.dim, device=device).requires_grad_(True)

    xd = x.detach()
    jobs: dict[str, Callable[[], None]] = {"gemm": lambda: xd @ xd.t()}
    for name in names:
        jobs[name] = _fwd_bwd(build_loss(name), x, labels)
        if name in peers:
            jobs["pml:" + name] = _fwd_bwd(peers[name](), x, labels)
    with tqdm(total=args.warmup + args.repeat, desc="rounds", file=sys.stderr, leave=False) as progress:
        ms = _time_interleaved(jobs, args.repeat, args.warmup, sync, progress)
    gemm = ms["gemm"]
    rows = [(name, ms[name], ms.get("pml:" + name)) for name in names]

    threads = f", {torch.get_num_threads()} threads" if device.type == "cpu" else ""
    print(
        f"losses bench: batch {args.batch} ({P}×{K}), dim {args.dim}, {device.type}{threads}, median of {args.repeat}"
    )
    print(f"similarity GEMM {args.batch}×{args.batch}×{args.dim}: {gemm:.3f} ms")
    print(f"{'loss':<18}{'ours ms':>10}{'×GEMM':>9}{'PML ms':>10}{'ours/PML':>10}")
    for name, ours, pml in rows:
        peer = f"{pml:>10.3f}{ours / pml:>10.2f}" if pml is not None else f"{'-':>10}{'-':>10}"
        print(f"{name:<18}{ours:>10.3f}{ours / gemm:>9.1f}{peer}")
    if not rows:
        print("summary: no loss measured")
        return 0
    gemm_ratio = statistics.median(ours / gemm for _, ours, _ in rows)
    paired = [ours / pml for _, ours, pml in rows if pml is not None]
    summary = f"summary: fwd+bwd median {gemm_ratio:.1f}× the similarity GEMM over {len(rows)} losses"
    if paired:
        geo = statistics.geometric_mean(paired)
        summary += f"; ours/PML geometric mean {geo:.2f} over {len(paired)} shared losses"
    print(summary)
    return 0
