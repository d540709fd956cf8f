"""Tokens/s of plain vs speculative decoding with the EAGLE-3 draft, on this machine.

Sweep: batch {1, 8, 64} x k {2, 4, 6, adaptive} x draft {untrained, trained} (``--batches``,
``--ks``, ``--no-adaptive`` narrow it), plus plain
decoding (``draft: none``), greedy, ``--new-tokens`` per response from ragged prompts; then plain vs
the trained draft at k = 4 sampling at temperature 1 (RL's setting). Every point is the run
of median wall time of ``--repeats`` (``generate``'s wall time, prefill included; each run's
is in the record's ``call_s``), each right after a weight load (as in the RL loop), all
configs of a batch size interleaved in a fresh random order every repeat: the cores here are
shared (identical calls range over 1.5x), and interleaving makes a slow spell hit every
config alike.

``k = adaptive`` is the RL loop's choice (``titan_cotrain.engine.speculation.SpeculationTuner``,
``k`` in 0..6 chosen every decoding round from the live rows): a tuner per draft and batch size
first learns from ``--adaptive-warmup`` calls (the first drafts, measuring every ``k`` in turn,
the second decodes plainly; then each round runs its bucket's best, exploring a neighbour every
8th round), then chooses afresh at every timed call and round, still learning; the mean ``k``
of each timed call's rounds is listed. Its goal: at least 0.95 x the best of
plain and every fixed ``k`` with the same draft, at every batch size (``adaptive_met``).

The target is the llama3 debug model, first fit for a few seconds to a small synthetic
*phrase language* (24 random phrases of 4-10 tokens; each phrase is followed by one of three
others with probabilities 0.6 / 0.3 / 0.1), so that its outputs have structure a draft can
learn, as a real LM's do; a random-weight target emits near-random tokens that no draft
predicts. The *trained* draft is fit with the TTT loss (``titan_cotrain.cotrain.ttt``) on
the target's own outputs (sampled and greedy continuations of language prefixes); the
*untrained* one is its random initialisation. The engine switches between them with
``load_weights``, as the RL loop refreshes it after each step.

The physical bound: a round costs one verify forward plus ``k`` draft forwards (``k - 1``
chain steps and one catch-up pass), so with ``c`` = (time of one draft forward) / (time of
one plain decode step) the speedup is at most ``(k + 1) / (1 + k c)`` (every draft
accepted, verifying k + 1 tokens as cheap as decoding one). ``c`` and ``v`` = (verify time
per round) / (plain decode step) are measured from the engine's own timers; the speedup
the measured acceptance length ``tau`` allows is then ``tau / (v + k c)``.

Mixed lengths (``mixed`` in the JSON): the paged engine with continuous batching and shared
prompt blocks against the static layout (``paged=False``: a whole-sequence row per
sequence, waves), both under one KV budget that holds ``MIXED_BUDGET`` sequences at their
longest, on ``MIXED_PROMPTS`` prompts of 4-48 tokens x ``MIXED_GROUP`` samples (a GRPO
group), greedy with an EOS chosen so that response lengths spread (the token whose first
occurrence varies most over the rows), plain and with the trained draft at k = 4. Reported:
tokens/s, the KV blocks held at the peak and the pool allocated, rounds and the mean
sequences decoding per round. Both engines must give the same tokens.

Checks first that speculative greedy decoding reproduces plain greedy decoding token for
token (every draft, every k, ragged prompts, EOS mid-batch), and that the paged and static
engines agree; exits 1 on a mismatch or if ``--min-speedup`` (batch 1, trained draft, best
k) is not met.

With ``--compile`` the summary says whether torch ran the engine's compiled steps as CUDA
graphs (``cuda_graphs_captured``: true or false on a GPU, null elsewhere; the steps it skipped,
with inductor's reason, in ``cuda_graph_skips``) and what a release between rollouts costs
(``release_cost``): the median call at the largest batch (trained draft, k = 4, T = 1) right
after ``release()`` and a weight load, as in the RL loop, against right after a weight load
alone, and how many of the engine's storages came back at another address each time (on a GPU
every graph such a call runs is then recorded anew).

On a GPU (``--device cuda``) the target and the drafts are bf16, fitted and decoding (the
engine's dtype there, and the flash kernels'); the greedy checks stay exact: the fitted
target's choices are far from ties (a phrase continues one way, and its successors are
0.6 / 0.3 / 0.1 likely), so rounding does not flip them.

    PYTHONPATH=. .venv/bin/python scripts/bench_rollout.py     # about 10 minutes on one CPU thread
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import random
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from titan_cotrain.cotrain.ttt import draft_loss, pass_weights, ttt_unroll
from titan_cotrain.data.packing import layout_one_doc_per_row
from titan_cotrain.models.args import model_args_for
from titan_cotrain.models.draft import Draft, DraftArgs
from titan_cotrain.models.transformer import Transformer
from titan_cotrain.engine.kv_budget import kv_bytes_per_sequence
from titan_cotrain.engine.rollout import RolloutEngine, RolloutStats
from titan_cotrain.engine.sampling import SamplingParams
from titan_cotrain.engine.speculation import SpeculationTuner

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchtools import command_line, optional_plot, pyplot, save_figure  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
BATCHES, KS = (1, 8, 64), (2, 4, 6)
SAMPLED_K = 4  # k of the sampled (T = 1) sweep and of the mixed-lengths engines
ADAPTIVE_GOAL = 0.95
TRAIN_NEW_TOKENS = 112  # response tokens of the draft's training rows
MIXED_PROMPTS, MIXED_GROUP, MIXED_BUDGET, MIXED_PROMPT_LENS = 16, 4, 16, (4, 48)


class PhraseLanguage:
    """Documents made of random phrases; the phrase after each is one of three, 0.6/0.3/0.1."""

    def __init__(self, vocab: int, n_phrases: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.phrases = [torch.randint(1, vocab, (int(torch.randint(4, 11, (1,), generator=g)),), generator=g)
                        for _ in range(n_phrases)]
        self.successors = torch.stack([torch.randperm(n_phrases, generator=g)[:3] for _ in range(n_phrases)])
        self.weights = torch.tensor([0.6, 0.3, 0.1])

    def document(self, length: int, g: torch.Generator) -> torch.Tensor:
        parts, phrase = [], int(torch.randint(len(self.phrases), (1,), generator=g))
        while sum(p.numel() for p in parts) < length:
            parts.append(self.phrases[phrase])
            phrase = int(self.successors[phrase, torch.multinomial(self.weights, 1, generator=g)])
        return torch.cat(parts)[:length]

    def prompts(self, n: int, g: torch.Generator, lengths=(8, 16)) -> list[torch.Tensor]:
        return [self.document(int(torch.randint(lengths[0], lengths[1] + 1, (1,), generator=g)), g) for _ in range(n)]


def fit_target(target: Transformer, language: PhraseLanguage, steps: int, g: torch.Generator) -> float:
    """Next-token training on the language; returns the last loss."""
    opt = torch.optim.AdamW(target.parameters(), lr=3e-3)
    device = target.embed_tokens.weight.device
    for _ in range(steps):
        x = torch.stack([language.document(128, g) for _ in range(16)]).to(device)
        loss = F.cross_entropy(target(x)[:, :-1].flatten(0, 1), x[:, 1:].flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
    return loss.item()


def fit_draft(draft: Draft, target: Transformer, engine: RolloutEngine, language: PhraseLanguage, steps: int,
              ttt_steps: int, g: torch.Generator) -> list[float]:
    """TTT on the target's own continuations (half sampled at T = 1, half greedy) of language
    prefixes; the loss covers the responses. Returns the last step's per-pass top-1 accuracy."""
    device = engine.device
    rows = []
    for temperature in (1.0, 0.0):
        prompts = language.prompts(32, g, lengths=(16, 16))
        params = SamplingParams(temperature=temperature, max_new_tokens=TRAIN_NEW_TOKENS)
        out = engine.generate(prompts, params, draft_tokens=0, generator=torch.Generator(device).manual_seed(len(rows)))
        rows.append(torch.cat([torch.stack(prompts).to(device), out.tokens], dim=1))
    tokens = torch.cat(rows)
    n, s = tokens.shape
    with torch.no_grad():
        target_out = target(tokens, return_taps=True)
    taps = torch.cat(target_out.taps, -1)
    region = torch.zeros(n, s, dtype=torch.bool, device=device)
    region[:, 16:] = True
    micro = 16
    layout = layout_one_doc_per_row(micro, s, device)
    weights = pass_weights(ttt_steps, 0.8)
    opt = torch.optim.AdamW(draft.parameters(), lr=3e-3)
    for _ in range(steps):
        idx = torch.randint(n, (micro,), generator=g)
        stats = ttt_unroll(draft, taps[idx].flatten(0, 1), target_out.embeddings[idx].flatten(0, 1),
                           tokens[idx].flatten(), layout.positions.flatten(), layout.cu_seqlens,
                           region[idx].flatten(), ttt_steps, teacher_logits=target_out.logits[idx].flatten(0, 1))
        loss = draft_loss(stats, weights, (weights * stats.count).sum())
        opt.zero_grad()
        loss.backward()
        opt.step()
    return (stats.correct / stats.count.clamp(min=1)).tolist()


def check_greedy(engine: RolloutEngine, prompts: list[torch.Tensor], new_tokens: int, ks) -> list[str]:
    """Speculative greedy == plain greedy, token for token, ragged prompts, with an EOS."""
    plain = engine.generate(prompts, SamplingParams(temperature=0, max_new_tokens=new_tokens), draft_tokens=0)
    eos = int(plain.tokens[0, new_tokens // 3])
    params = SamplingParams(temperature=0, max_new_tokens=new_tokens, eos_token_id=eos)
    plain = engine.generate(prompts, params, draft_tokens=0)
    failures = []
    for k in ks:
        spec = engine.generate(prompts, params, draft_tokens=k)
        same = torch.equal(spec.tokens, plain.tokens) and torch.equal(spec.response_lens, plain.response_lens)
        if not same:
            failures.append(f"k={k}: speculative greedy output differs from plain greedy")
    return failures


@dataclass
class AdaptiveK:
    """A draft's ``SpeculationTuner`` and the mean ``k`` its rounds drafted at each timed call."""

    tuner: SpeculationTuner
    chosen: list[float] = field(default_factory=list)


def measure(engine: RolloutEngine, prompts, params: SamplingParams, policy_state: dict, drafts: dict,
            configs: list[tuple[str, int | str]], repeats: int, seed: int,
            adaptive: dict[str, AdaptiveK] | None = None) -> dict[tuple[str, int | str], list[RolloutStats]]:
    """``repeats`` runs of every ``(draft, k)`` config (``("none", 0)``: plain;
    ``k = "adaptive"``: the draft's tuner in ``adaptive`` chooses, and learns from, every
    call, and its choices are listed there), the configs interleaved within each repeat so
    that a load spike on a shared machine hits them alike rather than one config in full,
    in a fresh random order every repeat."""
    runs: dict[tuple[str, int | str], list[RolloutStats]] = {}
    order = random.Random(seed)
    for _ in range(repeats):
        # A fresh order every repeat: no config always follows the same one.
        for name, k in order.sample(configs, len(configs)):
            # Every call follows a weight load, as a rollout phase follows the engine's refresh
            # (plain decoding reloads the untrained draft, which it does not read).
            engine.load_weights(policy_state, drafts["untrained" if name == "none" else name])
            runs.setdefault((name, k), []).append(_generate(engine, prompts, params, name, k, seed, adaptive))
    return runs


def release_cost(engine: RolloutEngine, prompts, params: SamplingParams, policy_state: dict, draft_state: dict,
                 repeats: int) -> dict:
    """The trained draft's call at ``k = SAMPLED_K`` right after ``release()`` and a weight load
    (``release_and_load_s``) and right after a weight load alone (``load_s``), medians of
    ``repeats`` each, alternating; ``moved``: per release, how many of the engine's
    ``storages`` (caches, weights) came back at another address."""
    def addresses() -> list[int]:
        return [t.data_ptr() for t in (*engine.cache_tensors(), *engine.policy.parameters(),
                                       *engine.draft.parameters())]

    calls: dict[str, list[float]] = {"load_s": [], "release_and_load_s": []}
    moved = []
    for _ in range(repeats):
        for key, runs in calls.items():
            before = addresses()
            if key == "release_and_load_s":
                engine.release()
            engine.load_weights(policy_state, draft_state)
            if key == "release_and_load_s":
                moved.append(sum(a != b for a, b in zip(before, addresses())))
            runs.append(_generate(engine, prompts, params, "trained", SAMPLED_K, 0, None).total_s)
    return dict(**{key: sorted(runs)[len(runs) // 2] for key, runs in calls.items()}, storages=len(before),
                moved=moved)


def ratio_band(mine: list[RolloutStats], rivals: list[list[RolloutStats]], rng: random.Random,
               resamples: int = 2000) -> tuple[float, float]:
    """How far the ratio of ``mine``'s median tokens/s to the best rival's moves with the
    machine's noise alone: its 5th and 95th percentiles over resamples of every config's
    runs (with replacement, the bootstrap)."""
    def median_rate(runs: list[RolloutStats]) -> float:
        return median_run([rng.choice(runs) for _ in runs]).tokens_per_s

    ratios = sorted(median_rate(mine) / max(median_rate(r) for r in rivals) for _ in range(resamples))
    return ratios[resamples // 20], ratios[resamples - resamples // 20 - 1]


def median_run(runs: list[RolloutStats]) -> RolloutStats:
    """The run of median wall time. Not the fastest: identical calls here range over 1.5x,
    and the fast end is a rare quiet spell of the machine that one config or another catches."""
    return sorted(runs, key=lambda stats: stats.total_s)[len(runs) // 2]


def medians(runs: dict) -> dict:
    """Each config's ``median_run``."""
    return {config: median_run(config_runs) for config, config_runs in runs.items()}


def _generate(engine, prompts, params, name, k, seed, adaptive) -> RolloutStats:
    generator = torch.Generator(engine.device).manual_seed(seed)
    gc.collect()  # a collection inside one timed call and not another is noise
    if k != "adaptive":
        return engine.generate(prompts, params, draft_tokens=k, generator=generator).stats
    tuner = adaptive[name].tuner
    follows = tuner.start_call()
    stats = engine.generate(prompts, params, draft_tokens=tuner.choose_round if follows else 0,
                            generator=generator).stats
    tuner.observe(stats.rounds, stats.prefill_s, follows)
    pairs = stats.rounds.live.sum(0)  # (sequence, round) pairs per mode: plain, then k = 0..k_max
    adaptive[name].chosen.append(round(float((pairs[1:] * torch.arange(len(pairs) - 1)).sum() / pairs.sum()), 2))
    return stats


def warm_tuners(engine, prompts, params, policy_state, drafts, calls: int, seed: int,
                k_max: int) -> dict[str, AdaptiveK]:
    """A fresh tuner per draft, taught by ``calls`` calls at this batch size (their choices
    are not listed: only the timed calls' are)."""
    adaptive = {}
    for name, state in drafts.items():
        engine.load_weights(policy_state, state)
        teaching = {name: AdaptiveK(SpeculationTuner(k_max))}
        for _ in range(calls):
            _generate(engine, prompts, params, name, "adaptive", seed, teaching)
        adaptive[name] = AdaptiveK(teaching[name].tuner)
    return adaptive


def spread_eos(tokens: torch.Tensor, lengths: torch.Tensor) -> int:
    """The token whose first occurrence in the rows of ``tokens [B, N]`` (valid below
    ``lengths``) varies most, among those that occur in at least half the rows."""
    n = tokens.shape[1]
    valid = torch.arange(n) < lengths.unsqueeze(1)
    best, best_std = 0, -1.0
    for token in tokens[valid].unique().tolist():
        hit = (tokens == token) & valid
        first = torch.where(hit.any(1), hit.float().argmax(1), torch.tensor(n)).float()
        if hit.any(1).float().mean() >= 0.5 and float(first.std()) > best_std:
            best, best_std = token, float(first.std())
    return best


def mixed_lengths(target: Transformer, draft: Draft, language: PhraseLanguage, args, repeats: int, k_max: int,
                  g: torch.Generator) -> tuple[dict, list[str]]:
    """Paged + continuous vs static under one KV budget on mixed prompt and response lengths."""
    prompts = language.prompts(MIXED_PROMPTS, g, lengths=MIXED_PROMPT_LENS)
    max_len = MIXED_PROMPT_LENS[1] + args.new_tokens
    dtype = target.embed_tokens.weight.dtype
    budget = MIXED_BUDGET * kv_bytes_per_sequence(target.args, draft.args, max_len, k_max, dtype)
    engines = {paged: RolloutEngine(copy.deepcopy(target), copy.deepcopy(draft), max_batch_size=MIXED_PROMPTS
                                    * MIXED_GROUP, max_seq_len=max_len, max_draft_tokens=k_max,
                                    kv_cache_gib=budget / 2**30, paged=paged, block_size=args.kv_block_size,
                                    compile=args.compile)
               for paged in (False, True)}
    probe = engines[False].generate(prompts, SamplingParams(temperature=0, max_new_tokens=args.new_tokens),
                                    draft_tokens=0)
    params = SamplingParams(temperature=0, max_new_tokens=args.new_tokens,
                            eos_token_id=spread_eos(probe.tokens, probe.response_lens))
    runs, failures, outputs = {}, [], {}
    for _ in range(repeats):
        for k in (0, SAMPLED_K):
            for paged, engine in engines.items():
                out = engine.generate(prompts, params, samples_per_prompt=MIXED_GROUP, draft_tokens=k)
                outputs[paged, k] = out
                runs.setdefault((paged, k), []).append(out.stats)
    median = medians(runs)
    reference = outputs[False, 0]
    for (paged, k), out in outputs.items():
        if not (torch.equal(out.tokens, reference.tokens) and torch.equal(out.response_lens, reference.response_lens)):
            failures.append(f"mixed lengths: {'paged' if paged else 'static'} engine at k={k} differs from static "
                            "plain greedy")
    records = []
    for (paged, k), stats in sorted(median.items(), key=lambda item: (item[0][1], item[0][0])):
        engine = engines[paged]
        decoding = stats.new_tokens / max(stats.acceptance_length, 1e-9)  # (round, sequence) pairs
        records.append(dict(engine="paged" if paged else "static", k=k, tokens_per_s=stats.tokens_per_s,
                            kv_peak_bytes=stats.kv_peak_bytes,
                            kv_pool_bytes=sum(t.numel() * t.element_size() for t in engine.cache_tensors()),
                            rows=engine.max_batch_size, rounds=stats.target_forwards,
                            mean_decoding=decoding / max(stats.target_forwards, 1),
                            acceptance_length=stats.acceptance_length, total_s=stats.total_s,
                            call_s=[run.total_s for run in runs[paged, k]]))
        print(f"mixed  {records[-1]['engine']:6s} k={k}  {stats.tokens_per_s:8.0f} tok/s  KV peak "
              f"{stats.kv_peak_bytes / 2**20:.1f} MiB of {records[-1]['kv_pool_bytes'] / 2**20:.1f}  "
              f"{stats.target_forwards} rounds, {records[-1]['mean_decoding']:.1f} decoding", flush=True)
    lens = reference.response_lens.tolist()
    mixed = dict(prompts=MIXED_PROMPTS, group=MIXED_GROUP, prompt_lengths=[len(p) for p in prompts],
                 response_lengths=dict(min=min(lens), median=sorted(lens)[len(lens) // 2], max=max(lens)),
                 eos_token_id=params.eos_token_id, budget_sequences=MIXED_BUDGET, kv_budget_bytes=budget,
                 block_size=engines[True].block_size, records=records,
                 paged_over_static={k: {"tokens_per_s": median[True, k].tokens_per_s / median[False, k].tokens_per_s,
                                        "kv_peak": median[True, k].kv_peak_bytes / median[False, k].kv_peak_bytes}
                                    for k in (0, SAMPLED_K)})
    return mixed, failures


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--new-tokens", type=int, default=96, help="response tokens per prompt")
    parser.add_argument("--repeats", type=int, default=7, help="runs per point; the median counts")
    parser.add_argument("--target-steps", type=int, default=120, help="steps fitting the target to the language")
    parser.add_argument("--draft-steps", type=int, default=150, help="TTT steps fitting the trained draft")
    parser.add_argument("--model", default="llama3/debugmodel", help="architecture/flavor of the target, e.g. qwen3/1.7B")
    parser.add_argument("--device", default="cpu", help="cpu or cuda (bf16; the GPU path is not yet run)")
    parser.add_argument("--batches", type=int, nargs="+", default=list(BATCHES), help="batch sizes of the sweeps")
    parser.add_argument("--ks", type=int, nargs="+", default=list(KS), help="fixed k of the greedy sweep")
    parser.add_argument("--adaptive", action=argparse.BooleanOptionalAction, default=True,
                        help="also the adaptive k (the RL loop's tuner) in the greedy sweep")
    parser.add_argument("--compile", action="store_true", help="torch.compile the engine's decode/verify/draft steps")
    parser.add_argument("--kv-block-size", type=int, default=16,
                        help="positions per KV block (the paged flash kernel on a GPU reads multiples of 256)")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (the cores here are shared)")
    parser.add_argument("--min-speedup", type=float, default=0.0,
                        help="fail unless batch 1 with the trained draft reaches this speedup (0: report only)")
    parser.add_argument("--adaptive-warmup", type=int, default=4,
                        help="calls that teach each adaptive tuner before the timed ones")
    parser.add_argument("--json", type=Path, default=ROOT / "assets" / "bench_rollout.json")
    parser.add_argument("--png", type=Path, default=ROOT / "assets" / "bench_rollout.png")
    parser.add_argument("--replot", action="store_true", help="only redraw --png from an existing --json")
    args = parser.parse_args()
    if args.replot:
        result = json.loads(args.json.read_text())
        plot(result["records"], result["bounds"], args.png)
        if "mixed" in result:
            plot_engines(result["mixed"], engine_png(args.png))
        return 0
    torch.set_num_threads(args.threads)
    if args.device == "cpu":
        device_name = f"cpu ({args.threads} thread{'s' if args.threads > 1 else ''})"
    else:
        device_name = torch.cuda.get_device_name(args.device)
    g = torch.Generator().manual_seed(0)
    t0 = time.perf_counter()

    with torch.device(args.device):
        target = Transformer(model_args_for(*args.model.split("/")))
        untrained = Draft(DraftArgs.from_target(target.args, n_taps=len(target.tap_layers)))
    # init_weights draws each weight whole on the host and copies it to the device, so its
    # generator is a CPU one on every device (the same draws as on CPU).
    target.init_weights(generator=torch.Generator().manual_seed(0))
    untrained.init_weights(generator=torch.Generator().manual_seed(1))
    if args.device != "cpu":
        target, untrained = target.to(torch.bfloat16), untrained.to(torch.bfloat16)
    batches, ks = args.batches, tuple(args.ks)
    k_max = max(*ks, SAMPLED_K)
    language = PhraseLanguage(target.args.vocab_size, n_phrases=24, seed=0)
    target_loss = fit_target(target, language, args.target_steps, g)
    trained = copy.deepcopy(untrained)
    max_len = 16 + max(args.new_tokens, TRAIN_NEW_TOKENS)
    engine = RolloutEngine(copy.deepcopy(target), copy.deepcopy(untrained), max_batch_size=max(batches),
                           max_seq_len=max_len, max_draft_tokens=k_max, block_size=args.kv_block_size,
                           compile=args.compile)
    accuracy = fit_draft(trained, target, engine, language, args.draft_steps, k_max, g)
    print(f"fit: target loss {target_loss:.3f}, trained draft top-1 per pass "
          f"{[round(a, 3) for a in accuracy]} ({time.perf_counter() - t0:.0f}s)", flush=True)

    policy_state = target.state_dict()
    drafts = {"untrained": untrained.state_dict(), "trained": trained.state_dict()}
    check_prompts = language.prompts(6, g)
    failures = []
    for name, state in drafts.items():
        engine.load_weights(policy_state, state)
        failures += [f"{name} draft, {f}" for f in check_greedy(engine, check_prompts, 40, ks)]
    if failures:
        for failure in failures:
            print(f"FAIL: {failure}", file=sys.stderr)
        return 1
    print(f"check: speculative greedy == plain greedy (ragged prompts, EOS mid-batch, k in {ks}, both drafts)")

    mixed, failures = mixed_lengths(target, trained, language, args, args.repeats, k_max, g)
    if failures:
        for failure in failures:
            print(f"FAIL: {failure}", file=sys.stderr)
        return 1

    greedy = SamplingParams(temperature=0, max_new_tokens=args.new_tokens)
    configs = [("none", 0)] + [(name, k) for name in drafts for k in (*ks, *["adaptive"] * args.adaptive)]
    records, bounds, adaptive = [], [], []

    def record(batch: int, name: str, k: int | str, runs: list[RolloutStats], plain: RolloutStats,
               temperature: float, **extra) -> None:
        stats = median_run(runs)
        records.append(dict(device=device_name, model=args.model, batch=batch, k=k, draft=name,
                            tokens_per_s=stats.tokens_per_s, acceptance_length=stats.acceptance_length,
                            temperature=temperature, speedup=stats.tokens_per_s / plain.tokens_per_s,
                            acceptance_rate=[round(r, 4) for r in stats.acceptance_rate],
                            call_s=[run.total_s for run in runs], **extra))

    for batch in batches:
        prompts = language.prompts(batch, g)
        tuners = (warm_tuners(engine, prompts, greedy, policy_state, drafts, args.adaptive_warmup, batch, max(ks))
                  if args.adaptive else {})
        runs = measure(engine, prompts, greedy, policy_state, drafts, configs, args.repeats, batch, tuners)
        median = medians(runs)
        chosen = {name: a.chosen for name, a in tuners.items()}
        plain = median["none", 0]
        step_s = plain.verify_s / plain.target_forwards
        print(f"batch {batch:2d}  plain             {plain.tokens_per_s:8.0f} tok/s  step {step_s * 1e3:.2f} ms")
        for (name, k), s in median.items():
            record(batch, name, k, runs[name, k], plain, 0.0, **({"chosen_k": chosen[name]} if k == "adaptive" else {}))
            if name == "none":
                continue
            if k == "adaptive":
                rival_configs = [("none", 0), *((name, j) for j in ks)]
                rivals = [median[c].tokens_per_s for c in rival_configs]
                band = ratio_band(runs[name, k], [runs[c] for c in rival_configs], random.Random(batch))
                adaptive.append(dict(batch=batch, draft=name, tokens_per_s=s.tokens_per_s, best_other=max(rivals),
                                     ratio=s.tokens_per_s / max(rivals), ratio_band_90=band, chosen_k=chosen[name]))
                print(f"batch {batch:2d}  {name:9s} adaptive {s.tokens_per_s:8.0f} tok/s  "
                      f"{adaptive[-1]['ratio']:.2f} x the best of plain and fixed k (90% of resamples "
                      f"{band[0]:.2f}-{band[1]:.2f}; chose {chosen[name]})", flush=True)
                continue
            c = s.draft_s / (s.target_forwards * k) / step_s
            v = s.verify_s / s.target_forwards / step_s
            speedup = s.tokens_per_s / plain.tokens_per_s
            bounds.append(dict(batch=batch, k=k, draft=name, c=c, v=v, bound=(k + 1) / (1 + k * c),
                               allowed_by_tau=s.acceptance_length / (v + k * c), speedup=speedup))
            print(f"batch {batch:2d}  {name:9s} k={k}  {s.tokens_per_s:8.0f} tok/s  x{speedup:.2f}  "
                  f"tau {s.acceptance_length:.2f}  c {c:.3f}  v {v:.2f}  bound x{bounds[-1]['bound']:.2f}  "
                  f"tau allows x{bounds[-1]['allowed_by_tau']:.2f}", flush=True)

    # RL samples at temperature 1: plain vs the trained draft at k = 4.
    sampled = SamplingParams(temperature=1.0, max_new_tokens=args.new_tokens)
    for batch in batches:
        runs = measure(engine, language.prompts(batch, g), sampled, policy_state, drafts,
                       [("none", 0), ("trained", SAMPLED_K)], args.repeats, batch)
        median = medians(runs)
        for (name, k), config_runs in runs.items():
            record(batch, name, k, config_runs, median["none", 0], 1.0)
        spec = median["trained", SAMPLED_K]
        print(f"batch {batch:2d}  T=1 trained k={SAMPLED_K}  {spec.tokens_per_s:8.0f} tok/s  "
              f"x{spec.tokens_per_s / median['none', 0].tokens_per_s:.2f}  tau {spec.acceptance_length:.2f}", flush=True)

    released = (release_cost(engine, language.prompts(max(batches), g), sampled, policy_state, drafts["trained"],
                             args.repeats) if args.compile else None)
    if released is not None:
        print(f"after a release: {released['release_and_load_s']:.3f}s a call against {released['load_s']:.3f}s; "
              f"storages moved {released['moved']} of {released['storages']}", flush=True)
    best_b1 = max((b["speedup"] for b in bounds if b["batch"] == 1 and b["draft"] == "trained"), default=None)
    summary = dict(
        target_fit_loss=target_loss, trained_draft_top1_per_pass=accuracy, new_tokens=args.new_tokens,
        best_speedup_batch1_trained=best_b1, goal_batch1=2.0, goal_met=best_b1 is not None and best_b1 >= 2.0,
        adaptive_goal=ADAPTIVE_GOAL, adaptive_worst_ratio=min((a["ratio"] for a in adaptive), default=None),
        adaptive_met=all(a["ratio"] >= ADAPTIVE_GOAL for a in adaptive) if adaptive else None,
        cuda_graphs_captured=engine.cuda_graphs_captured, cuda_graph_skips=engine.cuda_graph_skips,
        release_cost=released, runtime_s=time.perf_counter() - t0,
    )
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(dict(records=records, bounds=bounds, adaptive=adaptive, mixed=mixed,
                                         summary=summary, command=command_line()), indent=1) + "\n")
    plot(records, bounds, args.png)
    plot_engines(mixed, engine_png(args.png))
    if best_b1 is not None:
        print(f"best batch-1 speedup with the trained draft: x{best_b1:.2f} (goal x2.0)")
    print(f"{summary['runtime_s']:.0f}s; wrote {args.json} and {args.png}")
    if args.min_speedup and (best_b1 is None or best_b1 < args.min_speedup):
        print(f"FAIL: batch-1 speedup x{best_b1:.2f} < --min-speedup {args.min_speedup}", file=sys.stderr)
        return 1
    return 0


@optional_plot
def plot(records: list[dict], bounds: list[dict], path: Path) -> None:
    """Greedy speedup over plain decoding: per batch size, bars for each fixed k (2, 4, 6) with
    the untrained and the trained draft, and the bound (k + 1) / (1 + k c) over each trained bar."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(9, 5.5))
    width = 0.38
    ticks, labels = [], []
    batches = sorted({b["batch"] for b in bounds})
    ks = sorted({b["k"] for b in bounds})
    for i, batch in enumerate(batches):
        for j, k in enumerate(ks):
            x = i * (len(ks) + 1) + j
            ticks.append(x)
            labels.append(f"k={k}\nbatch {batch}" if j == len(ks) // 2 else f"k={k}")
            for m, (name, color) in enumerate((("untrained", "tab:grey"), ("trained", "tab:blue"))):
                r = next(r for r in records if r["batch"] == batch and r["k"] == k and r["draft"] == name
                         and r["temperature"] == 0)
                ax.bar(x + (m - 0.5) * width, r["speedup"], width, color=color,
                       label=f"{name} draft" if (i, j) == (0, 0) else None)
            bound = next(b["bound"] for b in bounds if b["batch"] == batch and b["k"] == k and b["draft"] == "trained")
            ax.plot([x, x + width], [bound, bound], color="black", lw=2,
                    label="bound (k+1)/(1+kc), trained" if (i, j) == (0, 0) else None)
    ax.axhline(1, color="grey", ls="--", lw=1)
    ax.axhline(2, color="tab:red", ls="--", lw=1, label="2x goal (batch 1)")
    ax.set_xticks(ticks, labels)
    ax.set_ylabel("speculative / plain tokens per s")
    r0 = records[0]
    ax.set_title(f"greedy decoding speedup, {r0['model']}, {r0['device']}")
    ax.grid(alpha=0.3, axis="y")
    ax.set_ylim(0, 1.2 * max(b["bound"] for b in bounds if b["draft"] == "trained"))
    ax.legend(loc="upper center", ncol=2, fontsize="small")
    save_figure(fig, path)


def engine_png(path: Path) -> Path:
    return path.with_name(path.stem + "_engine" + path.suffix)


@optional_plot
def plot_engines(mixed: dict, path: Path) -> None:
    """Mixed lengths: tokens/s and the KV held at the peak, paged vs static, per k."""
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(10, 4.5))
    ks = sorted({r["k"] for r in mixed["records"]})
    for ax, key, scale, label in ((axes[0], "tokens_per_s", 1, "tokens / s"),
                                  (axes[1], "kv_peak_bytes", 2**-20, "KV held at the peak (MiB)")):
        for m, (engine, color) in enumerate((("static", "tab:grey"), ("paged", "tab:blue"))):
            values = [next(r[key] for r in mixed["records"] if (r["engine"], r["k"]) == (engine, k)) * scale
                      for k in ks]
            ax.bar([i + (m - 0.5) * 0.38 for i in range(len(ks))], values, 0.38, color=color, label=engine)
        ax.set_xticks(range(len(ks)), ["plain" if k == 0 else f"trained draft, k={k}" for k in ks])
        ax.set_ylabel(label)
        ax.grid(alpha=0.3, axis="y")
        ax.legend()
    lens = mixed["response_lengths"]
    fig.suptitle(f"{mixed['prompts']} prompts x {mixed['group']} samples, responses {lens['min']}-{lens['max']} "
                 f"tokens, one KV budget ({mixed['budget_sequences']} sequences at their longest)")
    save_figure(fig, path)


if __name__ == "__main__":
    sys.exit(main())
