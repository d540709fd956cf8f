"""The reduced draft vocabulary: counted from a corpus of token-id lists, the most frequent ids
chosen (brute force agrees), a corpus too small for the size refused with the keys to change,
and a draft folder's own vocabulary kept."""

import random
from collections import Counter

import pytest
import torch

from titan_cotrain.config import load_job_config
from titan_cotrain.models.build import build_draft, build_target, draft_vocab_maps
from titan_cotrain.models.draft_vocab import MIN_SEEN_FRACTION, count_tokens, draft_vocab_from_counts
from titan_cotrain.models.eagle3 import save_eagle3

VOCAB, DRAFT_VOCAB = 300, 40


def _chosen(maps) -> list[int]:
    d2t, t2d = maps
    ids = (torch.arange(d2t.numel()) + d2t).tolist()
    assert ids == torch.nonzero(t2d).flatten().tolist()  # both maps name the same ids
    return ids


def test_the_most_frequent_ids_of_a_corpus_are_chosen():
    rng = random.Random(0)
    # Zipf-like text: a few ids very often, most rarely, some never.
    corpus = [[min(int(rng.paretovariate(0.7)), VOCAB - 1) for _ in range(rng.randint(0, 50))] for _ in range(400)]
    counts = count_tokens(corpus, VOCAB)
    brute = Counter(t for ids in corpus for t in ids)
    assert counts.tolist() == [brute[t] for t in range(VOCAB)]
    assert len(brute) >= DRAFT_VOCAB  # enough distinct ids for the rule below
    # Most frequent first, the lower id first among equal counts.
    top = sorted(sorted(range(VOCAB), key=lambda t: (-brute[t], t))[:DRAFT_VOCAB])
    assert _chosen(draft_vocab_from_counts(counts, DRAFT_VOCAB)) == top


@pytest.mark.parametrize("seen", [0, 1, int(MIN_SEEN_FRACTION * DRAFT_VOCAB) - 1])
def test_a_corpus_with_too_few_distinct_tokens_is_refused(seen):
    counts = torch.zeros(VOCAB, dtype=torch.int64)
    counts[torch.randperm(VOCAB, generator=torch.Generator().manual_seed(seen))[:seen]] = 1000
    with pytest.raises(ValueError, match=f"holds {seen} distinct tokens, fewer than 0.5 x the {DRAFT_VOCAB} draft ids"):
        draft_vocab_from_counts(counts, DRAFT_VOCAB)


def test_half_the_draft_ids_seen_is_enough():
    counts = torch.zeros(VOCAB, dtype=torch.int64)
    counts[VOCAB - DRAFT_VOCAB // 2:] = 7
    ids = _chosen(draft_vocab_from_counts(counts, DRAFT_VOCAB))
    assert ids[DRAFT_VOCAB // 2:] == list(range(VOCAB - DRAFT_VOCAB // 2, VOCAB))  # every seen id is in


def test_the_refusal_names_the_keys_to_change():
    config = load_job_config(["--draft.vocab_size", "64"], world_size=1)
    with pytest.raises(ValueError) as err:
        draft_vocab_maps(config, torch.zeros(256, dtype=torch.int64))
    for key in ("[draft] vocab_size = 64", "vocab_samples", "vocab_generations", "set it to 0"):
        assert key in str(err.value)


def test_a_draft_folder_brings_its_own_vocabulary(tmp_path):
    """``[draft] init_path``: the folder's ``d2t`` / ``t2d`` are the vocabulary (no counting);
    a ``vocab_size`` that disagrees with it is refused."""
    config = load_job_config(["--draft.vocab_size", "16"], world_size=1)
    target = build_target(config)
    counts = torch.zeros(256, dtype=torch.int64)
    counts[100:116] = 1
    draft = build_draft(config, target, token_counts=counts)
    save_eagle3(draft, tmp_path, target.tap_layers)
    for size in ("0", "16"):
        loaded = build_draft(load_job_config(["--draft.init_path", str(tmp_path), "--draft.vocab_size", size],
                                             world_size=1), target)
        assert _chosen((loaded.d2t, loaded.t2d)) == list(range(100, 116))
    with pytest.raises(ValueError, match="draft.vocab_size = 20, but draft.init_path .* 16-token vocabulary"):
        build_draft(load_job_config(["--draft.init_path", str(tmp_path), "--draft.vocab_size", "20"], world_size=1),
                    target)
