"""Peak host memory of ``python -m titan_cotrain.export`` against the size of what it writes.

Claim: the export streams the policy from the DCP checkpoint into its safetensors file one
tensor at a time, so its peak RSS is the interpreter's own (torch and the project imported)
plus the draft (held whole, one layer) plus a few copies of the largest tensor, not plus the
policy's size: a policy twice as deep exports in the same peak.

Method, each measured process a child of this one (peak RSS: ``wait4``'s ``ru_maxrss``):

1. ``model``: a Llama-shaped policy described by a ``config.json`` (``[model] hf_path``;
   width 1024, FFN 4096, a 32000-token vocabulary, 8 and 16 layers: 730 and 1234 MiB in fp32,
   the largest tensors the 125 MiB embedding and head) and its EAGLE-3 draft (full vocabulary,
   205 MiB), randomly initialised and saved as the trainer's checkpointer lays a step out (the
   policy at the top level, the draft under ``draft``), in fp32;
2. ``export``: ``python -m titan_cotrain.export`` of that step (fp32, as the job's end on a CPU);
3. ``baseline``: the same command on the embedded debug model's checkpoint (about 2 MB);
4. ``whole``: for comparison, the policy read whole from the checkpoint and written with
   ``save_hf``, as a writer handed the whole state needs.

    .venv/bin/python scripts/export_memory.py        # about 3 minutes on 2 cores; assets/export_memory.json
"""

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchtools import command_line  # noqa: E402

WIDE = dict(dim=1024, n_heads=16, n_kv_heads=8, head_dim=64, ffn_dim=4096, vocab_size=32000, max_seq_len=4096)
DEPTHS = (8, 16)


def _job(model: Path | None) -> list[str]:
    from titan_cotrain.eval import ONE_PROCESS

    return [*(["--model.hf_path", str(model)] if model else []), *ONE_PROCESS]


def make_checkpoint(step: Path, model: Path | None) -> dict:
    """A random policy and draft of the job's shapes saved as ``step`` (a DCP ``step-N`` folder)."""
    import warnings

    import torch
    import torch.distributed.checkpoint as dcp

    from titan_cotrain.config import load_job_config
    from titan_cotrain.models.build import build_draft, resolve_model_args, resolve_tap_layers
    from titan_cotrain.models.transformer import Transformer

    config = load_job_config(_job(model), world_size=1)
    args = resolve_model_args(config)
    policy = Transformer(args, tap_layers=resolve_tap_layers(config, args.n_layers))
    policy.init_weights(generator=torch.Generator().manual_seed(0))
    draft = build_draft(config, policy)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.save({**policy.state_dict(), "draft": draft.state_dict()}, checkpoint_id=str(step), no_dist=True)
    size = lambda module: sum(t.nbytes for t in module.state_dict().values())  # noqa: E731
    return {"policy_bytes": size(policy), "draft_bytes": size(draft),
            "largest_tensor_bytes": max(t.nbytes for t in policy.state_dict().values())}


def write_whole(step: Path, model: Path, out: Path) -> None:
    """The comparison writer: every policy tensor read from ``step`` first, then ``save_hf``."""
    from titan_cotrain.config import load_job_config
    from titan_cotrain.export import CheckpointTensors
    from titan_cotrain.models.build import build_target
    from titan_cotrain.models.hf import save_hf

    config = load_job_config(_job(model), world_size=1)
    policy = build_target(config, device="meta")
    saved = CheckpointTensors(str(step))
    policy.load_state_dict({name: saved[name] for name in policy.state_dict()}, assign=True)
    save_hf(policy, out)


def _peak_rss(cmd: list[str]) -> tuple[int, float]:
    """Run ``cmd``; its peak RSS in bytes and its wall seconds."""
    t0 = time.perf_counter()
    process = subprocess.Popen(cmd, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"})
    _, status, usage = os.wait4(process.pid, 0)
    process.returncode = os.waitstatus_to_exitcode(status)
    if process.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed with {process.returncode}")
    return usage.ru_maxrss * 1024, time.perf_counter() - t0


def _child(args: argparse.Namespace) -> int:
    model = Path(args.model) if args.model else None
    if args.child == "model":
        Path(args.facts).write_text(json.dumps(make_checkpoint(Path(args.step), model)))
    else:
        write_whole(Path(args.step), model, Path(args.out))
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", default=str(ROOT / "assets" / "export_memory.json"))
    parser.add_argument("--child", choices=("model", "whole"), help=argparse.SUPPRESS)
    parser.add_argument("--step", help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--facts", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return _child(args)

    from titan_cotrain.models import ModelArgs, hf_config_from_model_args

    me = [sys.executable, __file__]
    export = [sys.executable, "-m", "titan_cotrain.export"]
    mib = lambda n: round(n / 2**20, 1)  # noqa: E731
    runs = []
    with tempfile.TemporaryDirectory() as work:
        work = Path(work)
        subprocess.run([*me, "--child", "model", "--step", str(work / "tiny" / "step-1"), "--facts",
                        str(work / "tiny.json")], cwd=ROOT, check=True)
        baseline, _ = _peak_rss([*export, "--checkpoint", str(work / "tiny" / "step-1"),
                                 "--out", str(work / "tiny_out")])
        for n_layers in DEPTHS:
            model, step = work / f"model{n_layers}", work / f"wide{n_layers}" / "step-1"
            shutil.copytree(ROOT / "assets" / "tokenizer", model)
            (model / "config.json").write_text(json.dumps(hf_config_from_model_args(ModelArgs(**WIDE,
                                                                                               n_layers=n_layers))))
            subprocess.run([*me, "--child", "model", "--model", str(model), "--step", str(step), "--facts",
                            str(work / "facts.json")], cwd=ROOT, check=True)
            facts = json.loads((work / "facts.json").read_text())
            streamed, seconds = _peak_rss([*export, "--model.hf_path", str(model), "--checkpoint", str(step),
                                           "--out", str(work / "streamed")])
            whole, _ = _peak_rss([*me, "--child", "whole", "--model", str(model), "--step", str(step),
                                  "--out", str(work / "whole")])
            written = sum(p.stat().st_size for p in (work / "streamed").rglob("*.safetensors"))
            runs.append({
                "n_layers": n_layers, "policy_mib": mib(facts["policy_bytes"]), "draft_mib": mib(facts["draft_bytes"]),
                "largest_tensor_mib": mib(facts["largest_tensor_bytes"]), "written_mib": mib(written),
                "export_peak_rss_mib": mib(streamed), "export_above_baseline_mib": mib(streamed - baseline),
                "export_seconds": round(seconds, 1), "whole_state_writer_peak_rss_mib": mib(whole),
                "whole_state_above_baseline_mib": mib(whole - baseline),
            })
            shutil.rmtree(step.parent)
    result = {"command": command_line(), "model": WIDE, "dtype": "float32", "baseline_peak_rss_mib": mib(baseline),
              "runs": runs}
    Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
