"""The context-parallel ring at W ranks against one device, under torchrun.

Every rank runs ``bench_cp.ring_errors``: the zigzag ring of the draft's branch attention
(``ring_branch_attention``, forward and all five input gradients) over CP groups of all W
ranks and of each half, against ``branch_attention`` on the rank's own device alone, both
measured against the fp64 result. On GPUs: NCCL, one GPU per rank, bf16 (the flash kernels'
dtypes); otherwise gloo and fp32 (the CPU check ``bench_cp.py`` runs at W = 4).

    torchrun --standalone --nproc_per_node 8 scripts/ring_check.py --json ring_w8.json

Writes ``--json`` on rank 0 (the worst error of every tensor over the ranks, the single
device's beside it) and exits 1 when a rank's ring is further from the exact result than
``bench_cp.ring_errors`` allows.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_cp import ring_errors  # noqa: E402
from titan_cotrain.ops.ring_attention import DEFAULT_PIECES  # noqa: E402
from titan_cotrain.parallel.process_end import exit_process, leave_process_group  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seq-len", type=int, default=1000, help="tokens of the packed row (uneven documents)")
    parser.add_argument("--pieces", type=int, default=DEFAULT_PIECES, help="messages per ring hop")
    parser.add_argument("--json", type=Path, required=True)
    args = parser.parse_args()
    cuda = torch.cuda.is_available()
    if cuda:
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
        torch.set_num_threads(1)
    dist.init_process_group("nccl" if cuda else "gloo", device_id=device if cuda else None)
    rank, world = dist.get_rank(), dist.get_world_size()
    dtype = torch.bfloat16 if cuda else torch.float32
    try:
        errors, failure = ring_errors(args.pieces, impls=("ring",), device=device, dtype=dtype, seq_len=args.seq_len), ""
    except AssertionError as e:
        errors, failure = {}, f"rank {rank}: {e}"
    except Exception:  # noqa: BLE001 - every rank reports, so rank 0 can write the JSON
        errors, failure = {}, f"rank {rank}:\n{traceback.format_exc()}"
    gathered = [None] * world
    dist.all_gather_object(gathered, (errors, failure))
    leave_process_group(succeeded=True)
    failures = [f for _, f in gathered if f]
    if rank == 0:
        worst = {}
        for rank_errors, _ in gathered:
            for key, e in rank_errors.items():
                if key not in worst or e["error"] > worst[key]["error"]:
                    worst[key] = e
        result = {"world": world, "device": torch.cuda.get_device_name(device) if cuda else "cpu",
                  "backend": "nccl" if cuda else "gloo", "dtype": str(dtype).removeprefix("torch."),
                  "seq_len": args.seq_len, "pieces": args.pieces, "passed": not failures, "failures": failures,
                  "max_abs_error": worst}
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1) + "\n")
        for f in failures:
            print(f"FAIL: {f}", file=sys.stderr)
        print(f"ring at W = {world} ({result['backend']}, {result['dtype']}) vs one device: "
              f"{'passed' if not failures else 'FAILED'}; wrote {args.json}")
    return 1 if failures else 0


if __name__ == "__main__":
    exit_process(main())  # no interpreter finalization (titan_cotrain.parallel.process_end)
