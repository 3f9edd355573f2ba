"""Property-based tests (hypothesis) of the data path: tokenizing, packing, collating, batching.

Samples are made so that every token says where it came from: token ``1000 * d + p + 1``
is position ``p`` of document ``d``, and a trained label is the id of the next token of the
same document. So any token lost, duplicated, moved to another document, or any label
shifted by one shows in the ids themselves. Lengths are drawn at random, with a strategy
that favours exact fits (documents that fill ``seq_len`` to the token) and lengths of 1.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from nbtune.data import (IGNORE, BatchStream, DataError, Example, Sample, collate, format_prompt,
                         pack, tokenize, tokenize_all)
from nbtune.models.tiny import byte_tokenizer

# No example database (no .hypothesis folder in the checkout), no per-example deadline
# (2 busy CPU cores), few examples: the whole file runs in a few seconds.
PROPERTIES = settings(max_examples=60, deadline=None, database=None,
                      suppress_health_check=[HealthCheck.too_slow])
PAD = 0  # no token below is 0 (ids start at 1), so padding is never mistaken for data
TOK = byte_tokenizer()


def token(doc: int, pos: int) -> int:
    return 1000 * doc + pos + 1


def where(tok: int) -> tuple[int, int]:
    """(document, position) of a token made by ``token``."""
    return (tok - 1) // 1000, (tok - 1) % 1000


def make_samples(lengths: list[int], trained: list[list[bool]] | None = None) -> list[Sample]:
    """Document ``d`` of ``lengths[d]`` tokens; label ``p`` is token ``p + 1`` where trained."""
    out = []
    for d, n in enumerate(lengths):
        keep = trained[d] if trained is not None else [True] * n
        ids = [token(d, p) for p in range(n)]
        labels = [token(d, p + 1) if keep[p] else IGNORE for p in range(n)]
        out.append(Sample(torch.tensor(ids), torch.tensor(labels)))
    return out


@st.composite
def lengths_and_seq_len(draw, max_seq_len: int = 40, max_docs: int = 14):
    """(lengths, seq_len) with every length in [1, seq_len], as ``tokenize`` guarantees.

    Half the draws are runs of exact fits: groups of documents whose lengths add up to
    ``seq_len`` exactly, the boundary a packing off-by-one gets wrong.
    """
    seq_len = draw(st.integers(1, max_seq_len))
    if draw(st.booleans()):
        return draw(st.lists(st.integers(1, seq_len), min_size=1, max_size=max_docs)), seq_len
    lengths: list[int] = []
    for _ in range(draw(st.integers(1, 4))):
        cuts = sorted(draw(st.sets(st.integers(1, seq_len - 1), max_size=min(4, seq_len - 1)))) \
            if seq_len > 1 else []
        bounds = [0, *cuts, seq_len]
        lengths += [b - a for a, b in zip(bounds, bounds[1:])]
    return lengths, seq_len


@st.composite
def samples_and_seq_len(draw):
    lengths, seq_len = draw(lengths_and_seq_len())
    trained = [draw(st.lists(st.booleans(), min_size=n, max_size=n)) for n in lengths]
    return make_samples(lengths, trained), seq_len


def documents_of(row: Sample) -> list[tuple[int, int]]:
    """(start, end) of each document's run of tokens in a packed row, by its document id."""
    ids = row.document_ids.tolist()
    runs, start = [], 0
    for i in range(1, len(ids) + 1):
        if i == len(ids) or ids[i] != ids[start]:
            runs.append((start, i))
            start = i
    return runs


# ---- pack ---------------------------------------------------------------------------------

def check_pack(samples: list[Sample], seq_len: int) -> None:
    rows = pack(samples, seq_len)
    lengths = [len(s.input_ids) for s in samples]
    # No row longer than seq_len, none empty.
    assert all(0 < len(r.input_ids) <= seq_len for r in rows)
    # No token lost, duplicated or reordered, and its label travels with it.
    assert torch.equal(torch.cat([r.input_ids for r in rows]), torch.cat([s.input_ids for s in samples]))
    assert torch.equal(torch.cat([r.labels for r in rows]), torch.cat([s.labels for s in samples]))
    assert Counter(where(t) for r in rows for t in r.input_ids.tolist()) == Counter(
        (d, p) for d, n in enumerate(lengths) for p in range(n))
    doc = 0  # the next document, in order
    for r in rows:
        assert r.input_ids.shape == r.labels.shape == r.document_ids.shape == r.positions.shape
        runs = documents_of(r)
        # Document ids number the row's documents 0, 1, 2, ... in order; each document is
        # whole (never split over two rows) and its positions restart at 0.
        assert [r.document_ids[a].item() for a, _ in runs] == list(range(len(runs)))
        for a, b in runs:
            assert b - a == lengths[doc], "a document was split or merged with another"
            assert r.positions[a:b].tolist() == list(range(b - a))
            assert [where(t) for t in r.input_ids[a:b].tolist()] == [(doc, p) for p in range(b - a)]
            # Labels aligned: a trained label is the next token of the same document.
            for p, label in enumerate(r.labels[a:b].tolist()):
                assert label in (IGNORE, token(doc, p + 1))
            doc += 1
    assert doc == len(samples)
    # Greedy, in order: a row is closed only when the next document does not fit, so
    # documents that fill seq_len exactly share a row.
    for row, following in zip(rows, rows[1:]):
        first = documents_of(following)[0]
        assert len(row.input_ids) + (first[1] - first[0]) > seq_len


@PROPERTIES
@given(samples_and_seq_len())
@example((make_samples([1]), 1))  # the shortest document in the shortest row
@example((make_samples([1, 1, 1, 1]), 2))  # exact fits of length 1
@example((make_samples([3, 2, 5, 1, 4]), 5))  # 3+2 and 1+4 fill a row exactly
@example((make_samples([5, 5, 5]), 5))  # each document fills a row alone
def test_pack_keeps_every_token_document_and_label(case):
    samples, seq_len = case
    check_pack(samples, seq_len)


def test_pack_fills_exact_fits_and_splits_just_beyond():
    # Deterministic boundary cases beside the random ones.
    assert [len(r.input_ids) for r in pack(make_samples([3, 2, 5, 1, 4]), 5)] == [5, 5, 5]
    assert [len(r.input_ids) for r in pack(make_samples([3, 3, 6]), 6)] == [6, 6]
    assert [len(r.input_ids) for r in pack(make_samples([3, 4, 2]), 6)] == [3, 6]
    assert [len(r.input_ids) for r in pack(make_samples([1] * 5), 1)] == [1] * 5


# ---- collate ------------------------------------------------------------------------------

def check_collate(samples: list[Sample], pad_id: int) -> dict:
    batch = collate(samples, pad_id)
    longest = max(len(s.input_ids) for s in samples)
    packed = samples[0].document_ids is not None
    names = ["input_ids", "labels"] + (["document_ids", "positions"] if packed else [])
    assert sorted(batch) == sorted(names)
    fill = {"input_ids": pad_id, "labels": IGNORE, "document_ids": -1, "positions": 0}
    for name in names:
        assert batch[name].shape == (len(samples), longest) and batch[name].dtype == torch.long
        for row, sample in enumerate(samples):
            n = len(sample.input_ids)
            assert torch.equal(batch[name][row, :n], getattr(sample, name)), name
            # Padding: the pad id, never trained, its own document -1 at position 0.
            assert (batch[name][row, n:] == fill[name]).all(), name
    return batch


@PROPERTIES
@given(samples_and_seq_len(), st.booleans())
def test_collate_pads_with_pad_id_and_ignored_labels(case, packed):
    samples, seq_len = case
    check_collate(pack(samples, seq_len) if packed else samples, PAD)


# ---- BatchStream --------------------------------------------------------------------------

def row_documents(batch: dict) -> list[int]:
    """Which document each row of a batch is (unpacked samples: one document per row)."""
    return [where(int(row[0]))[0] for row in batch["input_ids"]]


@st.composite
def streams(draw):
    lengths = draw(st.lists(st.integers(1, 12), min_size=1, max_size=10))
    batch_size = draw(st.integers(1, len(lengths) + 3))  # larger than the data too
    seed = draw(st.integers(0, 2**16))
    return make_samples(lengths), batch_size, seed


@PROPERTIES
@given(streams())
@example((make_samples([2, 1, 3]), 2, 0))  # batches straddle the epoch boundary
@example((make_samples([4]), 3, 5))  # one sample, batches of three
def test_every_sample_once_per_epoch_in_the_seeded_order(case):
    samples, batch_size, seed = case
    n = len(samples)
    stream = BatchStream(samples, batch_size, PAD, seed=seed)
    epochs = 3
    batches = [stream.next() for _ in range(-(-epochs * n // batch_size))]
    seen = [d for b in batches for d in row_documents(b)]
    for e in range(epochs):
        order = seen[e * n:(e + 1) * n]
        assert sorted(order) == list(range(n)), f"epoch {e}: {order}"  # each sample exactly once
        # The documented order: a permutation seeded with seed + epoch, new each epoch.
        expected = torch.randperm(n, generator=torch.Generator().manual_seed(seed + e)).tolist()
        assert order == expected, f"epoch {e}"
    for b in batches:
        picked = [samples[d] for d in row_documents(b)]
        assert b["input_ids"].shape == (batch_size, max(len(s.input_ids) for s in picked))
        check_collate(picked, PAD)  # the batch is exactly the collated samples


@PROPERTIES
@given(streams(), st.integers(0, 12), st.integers(1, 12))
def test_saved_position_replays_the_same_batches(case, before, after):
    """A stream put back to a saved position (a rollback, or a fresh stream on resume)
    gives the batches the original gave from there, across epoch boundaries."""
    samples, batch_size, seed = case
    stream = BatchStream(samples, batch_size, PAD, seed=seed)
    for _ in range(before):
        stream.next()
    state = dict(stream.state_dict())
    ahead = stream.copy()
    expected = [stream.next() for _ in range(after)]
    # The copy moves independently of the original.
    assert all(torch.equal(ahead.next()["input_ids"], b["input_ids"]) for b in expected)
    fresh = BatchStream(samples, batch_size, PAD, seed=seed)
    fresh.load_state_dict(state)
    stream.load_state_dict(state)  # rolled back, possibly over an epoch boundary
    for b in expected:
        for other in (fresh, stream):
            got = other.next()
            assert got.keys() == b.keys() and all(torch.equal(got[k], b[k]) for k in b)


def test_batch_size_change_goes_on_through_the_epoch():
    samples = make_samples([1 + i % 5 for i in range(10)])
    old = BatchStream(samples, 3, PAD, seed=4)
    first = row_documents(old.next())
    new = BatchStream(samples, 2, PAD, seed=4)
    new.continue_from(old)
    rest = [d for _ in range(4) for d in row_documents(new.next())]
    assert sorted(first + rest[:7]) == list(range(10))  # the rest of the epoch, once each
    other = BatchStream(samples, 2, PAD, seed=5)
    other.continue_from(old)  # another seed: another order, so it starts over
    assert (other.epoch, other.position) == (0, 0)


# ---- tokenize_all -------------------------------------------------------------------------

# Text without the special tokens' characters (the byte tokenizer would read "<|end|>" as
# one token), with multi-byte characters so character and byte offsets differ.
TEXT = st.text(st.sampled_from(list("abcxyz XYZ019.,!?\n\t") + ["é", "€", "😀", "ß"]), max_size=30)


def expected_alpaca(instruction: str, input: str, output: str, seq_len: int):
    """Ids and labels from the bytes: BOS, prompt (untrained), output + EOS (trained), cut
    to seq_len + 1 ids; input t predicts id t + 1. None when no trained label is left."""
    prompt = TOK.encode(format_prompt(instruction, input))
    answer = TOK.encode(output) + [TOK.eos_id]
    ids = [TOK.bos_id] + prompt + answer
    trained = [False] * (1 + len(prompt)) + [True] * len(answer)
    ids, trained = ids[: seq_len + 1], trained[: seq_len + 1]
    labels = [i if keep else IGNORE for i, keep in zip(ids[1:], trained[1:])]
    return None if all(x == IGNORE for x in labels) else (ids[:-1], labels)


@st.composite
def alpaca_rows(draw):
    rows = draw(st.lists(st.tuples(TEXT, st.one_of(st.just(""), TEXT), TEXT.filter(bool)),
                         min_size=1, max_size=6))
    return rows, draw(st.integers(1, 120))


@PROPERTIES
@given(alpaca_rows())
@example(([("a", "", "b")], 1))  # seq_len 1: only BOS is read; nothing trained survives
@example(([("a", "", "b")], 34))  # BOS + the 34-token prompt: "b" is cut, the row dropped
@example(([("a", "", "b")], 35))  # exact fit: BOS + prompt read, "b" its last label
@example(([("a", "", "b")], 36))  # exact fit of the whole row: "b" read, EOS its last label
@example(([("a", "", "b"), ("a", "", "bb")], 36))  # one cut at EOS, one whole
def test_tokenize_all_masks_the_prompt_and_cuts_at_seq_len(case):
    rows, seq_len = case
    assert all(len(TOK.encode(t)) == len(t.encode("utf-8")) for row in rows for t in row)
    examples = [Example((("user", i), ("assistant", o)), instruction=(i, x)) for i, x, o in rows]
    expected = [expected_alpaca(i, x, o, seq_len) for i, x, o in rows]
    kept = [e for e in expected if e is not None]
    if not kept:
        with pytest.raises(DataError, match="Raise seq_len"):
            tokenize_all(examples, TOK, seq_len)
        return
    samples, dropped = tokenize_all(examples, TOK, seq_len)
    assert dropped == len(expected) - len(kept)
    assert len(samples) == len(kept)
    for sample, (ids, labels) in zip(samples, kept):
        assert sample.input_ids.tolist() == ids and sample.labels.tolist() == labels
        assert len(sample.input_ids) <= seq_len
        assert sample.input_ids.dtype == sample.labels.dtype == torch.long
        # Aligned: each trained label is the input one position later.
        for t in range(len(ids) - 1):
            assert labels[t] in (IGNORE, ids[t + 1])


# ChatML-like, on the byte tokenizer's own special tokens (as tests/test_data.py).
TEMPLATE = ("{% for m in messages %}<|begin|>{{ m.role }}\n{{ m.content }}<|end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|begin|>assistant\n{% endif %}")


@st.composite
def conversations(draw):
    turns = draw(st.integers(1, 3))
    messages = [("system", draw(TEXT))] if draw(st.booleans()) else []
    for _ in range(turns):
        messages += [("user", draw(TEXT)), ("assistant", draw(TEXT))]
    return tuple(messages), draw(st.integers(1, 160))


@PROPERTIES
@given(conversations())
def test_chat_rows_train_every_assistant_turn_and_nothing_else(case):
    messages, seq_len = case
    tok = byte_tokenizer()
    tok.chat_template = TEMPLATE
    ids, trained = [], []
    for role, content in messages:
        head = tok.encode(f"<|begin|>{role}\n")
        body = tok.encode(f"{content}<|end|>\n")  # the turn as the template writes it
        ids += head + body
        trained += [False] * len(head) + [role == "assistant"] * len(body)
    if ids[0] != tok.bos_id:  # one BOS, never two (here <|begin|> is the BOS token)
        ids, trained = [tok.bos_id] + ids, [False] + trained
    ids, trained = ids[: seq_len + 1], trained[: seq_len + 1]
    labels = [i if keep else IGNORE for i, keep in zip(ids[1:], trained[1:])]
    sample = tokenize(Example(messages), tok, seq_len)
    if all(x == IGNORE for x in labels):
        assert sample is None
        return
    assert sample.input_ids.tolist() == ids[:-1] and sample.labels.tolist() == labels


# ---- the whole data path ------------------------------------------------------------------

@PROPERTIES
@given(alpaca_rows(), st.integers(1, 5), st.integers(0, 99))
def test_packed_stream_trains_every_token_of_an_epoch_once(case, batch_size, seed):
    """tokenize_all -> pack -> BatchStream: over one epoch's rows, every (input, label) pair
    of every kept example appears exactly once, and no row exceeds seq_len."""
    rows, seq_len = case
    rows = rows * 2  # duplicates, so a lost or doubled copy is not hidden by a set
    examples = [Example((("user", i), ("assistant", o)), instruction=(i, x)) for i, x, o in rows]
    try:
        samples, _ = tokenize_all(examples, TOK, seq_len)
    except DataError:
        return  # nothing fits: covered above
    packed = pack(samples, seq_len)
    stream = BatchStream(packed, batch_size, TOK.pad_id, seed=seed)
    rows_read = []
    while len(rows_read) < len(packed):
        batch = stream.next()
        assert batch["input_ids"].shape[1] <= seq_len
        rows_read += [{k: v[r] for k, v in batch.items()} for r in range(batch_size)]
    pairs, docs = Counter(), 0
    for row in rows_read[: len(packed)]:  # the first epoch
        real = row["document_ids"] >= 0
        assert (row["input_ids"][~real] == TOK.pad_id).all() and (row["labels"][~real] == IGNORE).all()
        docs += int(row["document_ids"][real].max()) + 1
        pairs.update(zip(row["input_ids"][real].tolist(), row["labels"][real].tolist()))
    assert docs == len(samples)
    expected = Counter((i, l) for s in samples for i, l in zip(s.input_ids.tolist(), s.labels.tolist()))
    assert pairs == expected
