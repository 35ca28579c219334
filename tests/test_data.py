"""Tests for picotron/data.py: tokenizer, corpus, files, windows, the dp/cp split, accuracy."""

import dataclasses
import json
import re

import pytest
import torch

from picotron import data
from picotron.config import TrainConfig
from picotron.data import (ARITHMETIC_DIGITS, Batch, ByteTokenizer, DataLoader, TokenDataset, arithmetic_accuracy,
                           arithmetic_digit_accuracy,
                           arithmetic_corpus, arithmetic_eval_problems, build_dataset, load_text,
                           make_loader)


def test_tokenizer_round_trip():
    tokenizer = ByteTokenizer()
    text = "417+2085=2502\nnaïve café, 東京 🚀"
    ids = tokenizer.encode(text)
    assert all(0 <= i < tokenizer.vocab_size for i in ids)
    assert len(ids) == len(text.encode("utf-8"))
    assert tokenizer.decode(ids) == text
    assert tokenizer.decode(ids[:-1]).endswith("\ufffd")   # a cut character is replaced, not an error


def test_corpus_is_deterministic_and_well_formed():
    text = arithmetic_corpus(500, seed=3)
    assert text == arithmetic_corpus(500, seed=3)
    assert text != arithmetic_corpus(500, seed=4)
    lines = text.splitlines()
    assert len(lines) == 500 and text.endswith("\n")
    lengths = set()
    for line in lines:
        a, b, c = map(int, re.fullmatch(r"(\d+)\+(\d+)=(\d+)", line).groups())
        assert a + b == c
        lengths.add(len(str(a)))
    assert lengths == set(range(1, ARITHMETIC_DIGITS + 1))


def test_eval_problems_are_held_out_from_training():
    problems = arithmetic_eval_problems(300, seed=0)
    assert len(problems) == len(set(problems)) == 300
    for prompt, answer in problems:
        a, b = map(int, prompt.rstrip("=").split("+"))
        assert prompt.endswith("=") and int(answer) == a + b
    # Compare unordered pairs: 3+5 held out means 5+3 never appears in training either.
    pair = lambda text: tuple(sorted(map(int, text.split("=")[0].split("+"))))
    train_pairs = {pair(line) for line in arithmetic_corpus(20_000, seed=0).splitlines()}
    assert not train_pairs & {pair(prompt) for prompt, _ in problems}


def test_load_text_txt_jsonl_and_folder(tmp_path):
    (tmp_path / "a.txt").write_text("hello\n", encoding="utf-8")
    (tmp_path / "b.jsonl").write_text('{"text": "one"}\n\n{"text": "two", "id": 2}\n', encoding="utf-8")
    (tmp_path / "notes.md").write_text("ignored in a folder")
    assert load_text(tmp_path / "a.txt") == "hello\n"
    assert load_text(tmp_path / "b.jsonl") == "one\ntwo"
    assert load_text(tmp_path) == "hello\n\none\ntwo"


def test_load_text_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="missing.txt"):
        load_text(tmp_path / "missing.txt")
    (tmp_path / "data.csv").write_text("x")
    with pytest.raises(ValueError, match=r"'\.csv'"):
        load_text(tmp_path / "data.csv")
    (tmp_path / "bad.jsonl").write_text('{"text": "ok"}\n{"content": "no text"}\n')
    with pytest.raises(ValueError, match=r"bad\.jsonl line 2 has no string 'text'"):
        load_text(tmp_path / "bad.jsonl")
    (tmp_path / "broken.jsonl").write_text('{"text": \n')
    with pytest.raises(ValueError, match=r"broken\.jsonl line 1 is not valid JSON"):
        load_text(tmp_path / "broken.jsonl")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="no .txt or .jsonl"):
        load_text(tmp_path / "empty")


def test_token_dataset_windows():
    tokens = torch.arange(30)
    dataset = TokenDataset(tokens, seq_len=8)
    assert len(dataset) == 3                      # 29 // 8: window 3 would need token 32
    for i in range(len(dataset)):
        inputs, targets = dataset[i]
        assert torch.equal(inputs, tokens[i * 8: i * 8 + 8])
        assert torch.equal(targets, inputs + 1)   # shifted by one
    with pytest.raises(IndexError):
        dataset[3]
    with pytest.raises(ValueError, match="too short for one window"):
        TokenDataset(torch.arange(8), seq_len=8)
    for seq_len in (0, -3):   # not a ZeroDivisionError in len(), nor windows running backwards
        with pytest.raises(ValueError, match=re.escape(f"seq_len={seq_len} must be at least 1")):
            TokenDataset(tokens, seq_len=seq_len)


def _loader(micro_batch_size, dp_rank=0, dp_size=1, seed=7, **cp):
    dataset = TokenDataset(torch.arange(64 * 16 + 1) % 256, seq_len=16)   # 64 windows
    return DataLoader(dataset, micro_batch_size, dp_rank=dp_rank, dp_size=dp_size, seed=seed, **cp)


def test_loader_dp_ranks_concatenate_to_single_process_batch():
    single = _loader(micro_batch_size=12)
    ranks = [_loader(micro_batch_size=3, dp_rank=r, dp_size=4) for r in range(4)]
    for step in range(4):
        for micro_step in range(3):
            reference = single.get_batch(step, micro_step)
            batches = [rank.get_batch(step, micro_step) for rank in ranks]
            for name in ("input_ids", "targets", "sample_ids", "position_ids"):
                joined = torch.cat([getattr(b, name) for b in batches])
                assert torch.equal(joined, getattr(reference, name)), (name, step, micro_step)
            assert len(torch.cat([b.sample_ids for b in batches]).unique()) == 12   # disjoint ranks
    assert not torch.equal(single.get_batch(0, 0).sample_ids, single.get_batch(0, 1).sample_ids)
    assert not torch.equal(single.get_batch(0).sample_ids, single.get_batch(1).sample_ids)
    assert torch.equal(single.get_batch(2, 1).input_ids, _loader(12).get_batch(2, 1).input_ids)


def test_loader_batch_contents_and_errors():
    batch = _loader(micro_batch_size=5).get_batch(3)
    assert batch.input_ids.shape == batch.targets.shape == (5, 16) and batch.input_ids.dtype == torch.long
    assert torch.equal(batch.input_ids[:, 1:], batch.targets[:, :-1])
    assert torch.equal(batch.input_ids[:, 0], batch.sample_ids * 16 % 256)   # window i starts at i * seq_len
    plain = Batch(batch.input_ids, batch.targets, batch.sample_ids)   # position_ids left to the default
    assert torch.equal(plain.position_ids, torch.arange(16).repeat(5, 1))
    assert torch.equal(batch.to("cpu").position_ids, plain.position_ids)
    with pytest.raises(ValueError, match="dp_rank=4"):
        _loader(2, dp_rank=4, dp_size=4)
    with pytest.raises(ValueError, match="dataset has only 64"):
        _loader(20, dp_size=4)
    with pytest.raises(ValueError, match="micro_batch_size=0 must be at least 1"):   # not empty batches
        _loader(0)


@pytest.mark.parametrize("cp_size", [2, 4])
def test_seq_slice_for_context_parallelism(cp_size):
    batch = _loader(micro_batch_size=3).get_batch(0)
    pieces = [batch.seq_slice(r, cp_size) for r in range(cp_size)]
    for name in ("input_ids", "targets", "position_ids"):
        assert torch.equal(torch.cat([getattr(p, name) for p in pieces], dim=1), getattr(batch, name))
    width = 16 // cp_size
    for r, piece in enumerate(pieces):
        assert torch.equal(piece.position_ids, torch.arange(r * width, (r + 1) * width).expand(3, width))
        assert torch.equal(piece.sample_ids, batch.sample_ids)
    with pytest.raises(ValueError, match="cp_size=3 does not divide seq_len=16"):
        batch.seq_slice(0, 3)


@pytest.mark.parametrize("cp_size", [2, 4])
def test_zigzag_slice_pairs_an_early_and_a_late_chunk(cp_size):
    batch = _loader(micro_batch_size=3).get_batch(0)
    chunk = 16 // (2 * cp_size)
    for r in range(cp_size):
        piece = batch.seq_slice(r, cp_size, zigzag=True)
        late = 2 * cp_size - 1 - r
        expected = torch.cat([torch.arange(r * chunk, (r + 1) * chunk), torch.arange(late * chunk, (late + 1) * chunk)])
        assert torch.equal(piece.position_ids, expected.expand(3, 2 * chunk))
        for name in ("input_ids", "targets"):   # the tokens at those positions
            assert torch.equal(getattr(piece, name), getattr(batch, name)[:, expected])
    with pytest.raises(ValueError, match=r"cp_size=4 does not divide seq_len=12 evenly \(zig-zag cuts it into "
                                         r"2\*cp_size = 8 chunks\)"):
        Batch(batch.input_ids[:, :12], batch.targets[:, :12], batch.sample_ids).seq_slice(0, 4, zigzag=True)


@pytest.mark.parametrize("zigzag", [False, True], ids=["contiguous", "zigzag"])
def test_loader_gives_each_cp_rank_its_tokens(zigzag):
    """dp=2 x cp=2: the cp ranks of a dp rank share its windows and together hold every token once."""
    single = _loader(micro_batch_size=6)
    for step in range(2):
        reference = single.get_batch(step)
        for dp_rank in range(2):
            rows = slice(3 * dp_rank, 3 * dp_rank + 3)
            pieces = [_loader(3, dp_rank=dp_rank, dp_size=2, cp_rank=cp_rank, cp_size=2, zigzag=zigzag).get_batch(step)
                      for cp_rank in range(2)]
            positions = torch.cat([p.position_ids for p in pieces], dim=1)              # (3, 16), a permutation
            assert torch.equal(positions.sort(dim=1).values, torch.arange(16).expand(3, 16))
            for piece in pieces:
                assert torch.equal(piece.sample_ids, reference.sample_ids[rows])
                assert torch.equal(piece.input_ids, reference.input_ids[rows].gather(1, piece.position_ids))
                assert torch.equal(piece.targets, reference.targets[rows].gather(1, piece.position_ids))
    with pytest.raises(ValueError, match="cp_rank=2 must be in"):
        _loader(3, cp_rank=2, cp_size=2)


def _oracle(problems):
    """A logits_fn that knows every answer: it scores the right next byte highest."""
    continuations = {"\n" + prompt: answer + "\n" for prompt, answer in problems}

    def logits_fn(ids):
        logits = torch.zeros(*ids.shape, 256)
        for row, text in enumerate(ByteTokenizer().decode(r) for r in ids.tolist()):
            prompt = next(p for p in continuations if text.startswith(p))
            answer, position = continuations[prompt], len(text) - len(prompt)
            logits[row, -1, ord(answer[position] if position < len(answer) else "\n")] = 1.0
        return logits
    return logits_fn


def test_arithmetic_accuracy():
    problems = arithmetic_eval_problems(40, seed=1)
    assert arithmetic_accuracy(_oracle(problems), problems) == 1.0
    always_one = lambda ids: torch.nn.functional.one_hot(torch.full_like(ids, ord("1")), 256).float()
    assert arithmetic_accuracy(always_one, problems) == 0.0   # never emits the closing "\n"
    wrong = [(prompt, str(int(answer) + 1)) for prompt, answer in problems[:10]]
    assert arithmetic_accuracy(_oracle(problems), problems[:10] + wrong) == 0.5


def test_arithmetic_digit_accuracy():
    problems = arithmetic_eval_problems(40, seed=1)
    # Looks one byte ahead: right everywhere, so 1.0.
    peek = lambda ids: torch.nn.functional.one_hot(_next_true_bytes(ids, problems), 256).float()
    assert arithmetic_digit_accuracy(peek, problems) == 1.0
    always_one = lambda ids: torch.nn.functional.one_hot(torch.full_like(ids, ord("1")), 256).float()
    answer_bytes = "".join(answer + "\n" for _, answer in problems)
    expected = answer_bytes.count("1") / len(answer_bytes)
    assert arithmetic_digit_accuracy(always_one, problems) == pytest.approx(expected)


def _next_true_bytes(ids, problems):
    texts = {"\n" + p + a + "\n" for p, a in problems}
    rows = []
    for row in ids.tolist():
        prefix = ByteTokenizer().decode(row)
        full = next(t for t in texts if t.startswith(prefix) and len(t) == len(prefix) + 1)
        rows.append(ByteTokenizer().encode(full)[1:])
    return torch.tensor(rows)


def test_make_loader_from_config(tmp_path, monkeypatch):
    monkeypatch.setattr(data, "ARITHMETIC_LINES", 5_000)   # the wiring, not the full 100k lines
    config = TrainConfig(seq_len=64, micro_batch_size=4, seed=0)
    dataset = build_dataset(config)
    assert len(dataset) > 500 and dataset.tokens.dtype == torch.uint8
    batch = make_loader(config, dp_rank=1, dp_size=2).get_batch(0)
    assert batch.input_ids.shape == (4, 64)
    assert set(ByteTokenizer().decode(batch.input_ids[0].tolist())) <= set("0123456789+=\n")
    (tmp_path / "mine.jsonl").write_text(json.dumps({"text": "abcdefgh" * 20}) + "\n")
    own = make_loader(TrainConfig(dataset=str(tmp_path / "mine.jsonl"), seq_len=8, micro_batch_size=2))
    assert ByteTokenizer().decode(own.get_batch(0).input_ids[0].tolist()) == "abcdefgh"


# ---- a real tokenizer (issue 20): trained here on text the test writes, offline --------------------------------

TEXT = "\n".join(f"the {c} cat sat on the {d} mat, and the {d} dog ran after the {c} cat." for c in
                 ("red", "blue", "green", "grey", "black") for d in ("big", "small", "old", "new")) + "\n"


def _tokenizer(tmp_path, vocab_size=120, name="tokenizer.json"):
    """A byte-level BPE tokenizer trained on TEXT, saved as a Hugging Face tokenizer.json."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.train_from_iterator([TEXT], trainers.BpeTrainer(vocab_size=vocab_size, show_progress=False))
    path = tmp_path / name
    tokenizer.save(str(path))
    return path, tokenizer


def test_a_tokenizer_corpus_is_tokenized_once_into_a_memory_mapped_file(tmp_path):
    pytest.importorskip("tokenizers")
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(TEXT)
    path, tokenizer = _tokenizer(tmp_path)
    config = TrainConfig(dataset=str(corpus), tokenizer=str(path), cache_dir=str(tmp_path / "cache"), seq_len=16)
    dataset = data.build_dataset(config)
    ids = tokenizer.encode(TEXT, add_special_tokens=False).ids
    assert tokenizer.decode(ids) == TEXT                              # byte-level BPE: lossless
    assert len(ids) < len(TEXT.encode()) / 2                          # real merges: fewer tokens than bytes
    assert dataset.tokens.tolist() == ids and dataset.tokens.dtype == "uint16"
    first = torch.tensor(ids[:17])
    assert torch.equal(dataset[0][0], first[:-1]) and torch.equal(dataset[0][1], first[1:])
    assert dataset[0][0].dtype == torch.long and len(dataset) == (len(ids) - 1) // 16
    (cached,) = (tmp_path / "cache").glob("tokens-*.bin")
    written = cached.stat().st_mtime_ns
    again = data.build_dataset(config)                                # the second time only maps the file
    assert cached.stat().st_mtime_ns == written and again.tokens.tolist() == ids
    other, _ = _tokenizer(tmp_path, vocab_size=60, name="other.json")    # another tokenizer: a file of its own
    data.build_dataset(dataclasses.replace(config, tokenizer=str(other)))
    assert len(list((tmp_path / "cache").glob("tokens-*.bin"))) == 2


def test_bad_tokenizer_inputs_are_clear_errors(tmp_path):
    pytest.importorskip("tokenizers")
    from picotron.config import Config, ModelConfig
    from picotron.layout import validate
    with pytest.raises(FileNotFoundError, match="tokenizer .*missing.json does not exist; give the path of a "
                                                "Hugging Face tokenizer.json"):
        data.load_tokenizer(tmp_path / "missing.json")
    broken = tmp_path / "broken.json"
    broken.write_text('{"model": 3}')
    with pytest.raises(ValueError, match="broken.json is not a tokenizer.json the tokenizers library can read"):
        data.load_tokenizer(broken)
    path, tokenizer = _tokenizer(tmp_path)
    vocab = tokenizer.get_vocab_size()
    with pytest.raises(ValueError, match=rf"has {vocab} tokens but the model's vocab_size=32: .* set vocab_size to "
                                         rf"at least {vocab}"):
        validate(Config(model=ModelConfig(vocab_size=32), train=TrainConfig(tokenizer=str(path))))
    validate(Config(model=ModelConfig(vocab_size=vocab), train=TrainConfig(tokenizer=str(path))))   # it fits


def test_the_trainer_trains_on_real_tokens(tmp_path, capsys):
    """`python -m picotron.train --dataset corpus.txt --tokenizer tokenizer.json` end to end, in this process."""
    pytest.importorskip("tokenizers")
    from picotron.train import main
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(TEXT * 4)
    path, _ = _tokenizer(tmp_path)
    history = main(["--dp", "1", "--steps", "6", "--seq-len", "16", "--micro-batch-size", "4",
                    "--dataset", str(corpus), "--tokenizer", str(path), "--cache-dir", str(tmp_path / "cache")])
    assert len(history["loss"]) == 6 and history["loss"][-1] < history["loss"][0]
    assert history["accuracy"] == {}                                  # the held-out sums are a byte-level task
    assert len(list((tmp_path / "cache").glob("tokens-*.bin"))) == 1
