"""Data: a built-in synthetic corpus, a byte tokenizer, your own files, a rank-aware loader.

The default dataset is made by this file, so nothing is downloaded: lines of addition such as
"47+85=132\n" (operands of 1-2 digits). A ~1M-parameter byte-level model learns the format
within ~100 steps, so the loss falls visibly (5.5 -> 1.6 nats), and then the sums themselves:
after the default run's 600 steps (75 s on 2 CPU cores) it answers most held-out sums
exactly (1.02 nats per byte is the floor: the operands are random). One problem in ten (chosen
by a hash of the operand pair) never appears in training: `arithmetic_eval_problems` draws from
those, so `arithmetic_accuracy` measures generalisation, not recall. Operands of up to 4 digits
(ARITHMETIC_DIGITS) make a task of thousands of steps. Bytes are the tokens (vocabulary 256): no
tokenizer to train.

Your own text: set `TrainConfig.dataset` to a .txt file, a .jsonl file (one object with a
"text" field per line) or a folder of them; see `load_text`. With `TrainConfig.tokenizer` (a
Hugging Face tokenizer.json, read by the `tokenizers` library) the text is tokenized once into a
file of token ids that every later run and every rank memory-maps (`tokenize_to_cache`).

How ranks share the data (what the parallel chapters rely on):
- Data parallelism: the global micro-batch for (step, micro_step) is dp_size *
  micro_batch_size windows drawn from a generator seeded by (seed, step, micro_step);
  dp rank r takes the r-th contiguous slice. Concatenating the dp ranks' batches gives
  exactly the batch of one process with dp_size times the micro-batch size.
- Context parallelism: `Batch.seq_slice(cp_rank, cp_size, zigzag)` keeps a cp rank's
  tokens of every sequence: the cp_rank-th of cp_size contiguous pieces, or under zig-zag
  chunks cp_rank and 2*cp_size-1-cp_rank of 2*cp_size (picotron/parallel/context_parallel.py),
  with their position ids, so RoPE still sees true positions. A loader built with cp_rank and
  cp_size returns these slices; the cp ranks of one dp rank share its sample ids.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from picotron.config import TrainConfig

ARITHMETIC_LINES = 100_000    # ~0.8 MB, ~13k windows of 64 bytes, generated in ~0.3 s
ARITHMETIC_DIGITS = 2         # operands of 1 to this many digits


class ByteTokenizer:
    """UTF-8 bytes as tokens: every text encodes, nothing to download or train."""

    vocab_size = 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        # A window may cut a multi-byte character in half; show it as U+FFFD, don't fail.
        return bytes(ids).decode("utf-8", errors="replace")


# ---- the built-in corpus: addition ----

def _is_held_out(a: int, b: int) -> bool:
    """One operand pair in ten is kept for evaluation, and its swap with it (so 5+3 in
    training does not give away 3+5). A real hash: Python's hash() differs between
    processes, and a formula in a and b would hold out a pattern (sums ending in 7)."""
    digest = hashlib.blake2b(f"{min(a, b)}+{max(a, b)}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") % 10 == 0


def _draw_operand(rng: random.Random) -> int:
    # Length first, then the number: otherwise almost every operand would have 4 digits.
    digits = rng.randint(1, ARITHMETIC_DIGITS)
    return rng.randrange(10 ** (digits - 1) if digits > 1 else 0, 10 ** digits)


def _draw_problems(num: int, seed: int, held_out: bool) -> list[tuple[int, int]]:
    rng = random.Random(seed)
    problems = []
    while len(problems) < num:
        a, b = _draw_operand(rng), _draw_operand(rng)
        if _is_held_out(a, b) == held_out:
            problems.append((a, b))
    return problems


def arithmetic_corpus(num_lines: int, seed: int) -> str:
    """`num_lines` training lines "a+b=c\\n", the same text for the same seed."""
    return "".join(f"{a}+{b}={a + b}\n" for a, b in _draw_problems(num_lines, seed, held_out=False))


def arithmetic_eval_problems(num: int, seed: int) -> list[tuple[str, str]]:
    """`num` distinct held-out problems as (prompt, answer), e.g. ("47+85=", "132")."""
    # A tenth of the pairs is held out (~1000 of 100 x 100): 4x the draws leave enough distinct ones.
    problems = list(dict.fromkeys(_draw_problems(4 * num, seed, held_out=True)))[:num]
    if len(problems) < num:
        raise ValueError(f"only {len(problems)} distinct held-out problems of up to {ARITHMETIC_DIGITS} digits; "
                         f"ask for fewer than num={num}")
    return [(f"{a}+{b}=", str(a + b)) for a, b in problems]


@torch.no_grad()
def arithmetic_accuracy(logits_fn: Callable[[torch.Tensor], torch.Tensor],
                        problems: list[tuple[str, str]], device: str | torch.device = "cpu") -> float:
    """Fraction of problems whose greedy answer is exactly right (digits, then "\\n").

    `logits_fn` maps input ids (batch, seq) to logits (batch, seq, 256). Prompts of the same
    length are decoded together, so no padding and no attention mask are needed. Each prompt
    starts with "\\n" because in the training stream every problem follows one.
    """
    tokenizer, correct = ByteTokenizer(), 0
    by_length: dict[int, list[tuple[str, str]]] = {}
    for prompt, answer in problems:
        by_length.setdefault(len(prompt), []).append(("\n" + prompt, answer + "\n"))
    for group in by_length.values():
        ids = torch.tensor([tokenizer.encode(prompt) for prompt, _ in group], device=device)
        for _ in range(max(len(answer) for _, answer in group)):
            next_ids = logits_fn(ids)[:, -1].argmax(dim=-1, keepdim=True)   # (batch, 1)
            ids = torch.cat([ids, next_ids.to(ids.dtype)], dim=1)
        for row, (prompt, answer) in zip(ids.tolist(), group):
            correct += tokenizer.decode(row[len(prompt):len(prompt) + len(answer)]) == answer
    return correct / max(len(problems), 1)


@torch.no_grad()
def arithmetic_digit_accuracy(logits_fn: Callable[[torch.Tensor], torch.Tensor],
                              problems: list[tuple[str, str]], device: str | torch.device = "cpu") -> float:
    """Fraction of answer bytes (digits and the closing "\n") predicted right given the true
    bytes before them (teacher forcing).

    A finer gauge than exact answers, which come later: the length of a sum and its leading digit
    come early, the carries late.
    """
    tokenizer, right, total = ByteTokenizer(), 0, 0
    by_length: dict[int, list[tuple[str, int]]] = {}   # texts of equal length, with answer bytes
    for prompt, answer in problems:
        text = "\n" + prompt + answer + "\n"
        by_length.setdefault(len(text), []).append((text, len(answer) + 1))
    for group in by_length.values():
        ids = torch.tensor([tokenizer.encode(text) for text, _ in group], device=device)  # (batch, seq)
        hits = logits_fn(ids[:, :-1]).argmax(dim=-1) == ids[:, 1:]                        # (batch, seq-1)
        for row, (_, answer_bytes) in enumerate(group):
            right += int(hits[row, -answer_bytes:].sum())
            total += answer_bytes
    return right / max(total, 1)


# ---- your own files ----

def load_text(path: str | Path) -> str:
    """Text of a .txt file, a .jsonl file ("text" field of each line) or a folder of them
    (sorted by path, searched recursively). Documents are joined by "\\n"."""
    return "\n".join(_read_utf8(file) if file.suffix == ".txt" else "\n".join(_jsonl_texts(file))
                     for file in dataset_files(path))


def dataset_files(path: str | Path) -> list[Path]:
    """The files `load_text` reads for `path`: the file itself, or a folder's .txt and .jsonl files (sorted,
    searched recursively). FileNotFoundError or ValueError naming the fix if there are none; cheap (nothing is
    read), so `python -m picotron.train` checks --dataset with it before any rank starts."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"dataset path {path} does not exist; give a .txt or .jsonl file, "
                                f"a folder of them, or dataset='arithmetic' (--dataset arithmetic: the built-in sums)")
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.suffix in (".txt", ".jsonl") and p.is_file())
        if not files:
            raise ValueError(f"folder {path} holds no .txt or .jsonl files; put the corpus there as .txt files or "
                             f".jsonl files of {{\"text\": \"...\"}} lines")
        return files
    if path.suffix not in (".txt", ".jsonl"):
        raise ValueError(f"{path} has extension {path.suffix!r}; picotron reads .txt and .jsonl files")
    return [path]


def _read_utf8(path: Path) -> str:
    """The text of a file, with an error naming the file and the byte if it is not UTF-8."""
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as error:
        raise ValueError(f"{path} is not UTF-8 text (byte {error.start} is {error.object[error.start]:#04x}); "
                         f"convert it to UTF-8 (e.g. iconv -f latin1 -t utf-8)") from None


def _jsonl_texts(path: Path) -> list[str]:
    """The "text" field of every line of a .jsonl file; a line that is not such an object names its number."""
    texts = []
    for number, line in enumerate(_read_utf8(path).splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as error:
            raise ValueError(f"{path} line {number} is not valid JSON ({error.msg} at column {error.colno}); "
                             f"each line must be one JSON object such as {{\"text\": \"...\"}}") from None
        if not isinstance(record, dict) or not isinstance(record.get("text"), str):
            raise ValueError(f"{path} line {number} has no string 'text' field; "
                             f"each line must look like {{\"text\": \"...\"}}")
        texts.append(record["text"])
    return texts


# ---- windows and batches ----

class TokenDataset:
    """Non-overlapping windows of seq_len + 1 tokens: input = window[:-1], target = window[1:].

    `tokens` is 1-D and may be any integer dtype (uint8 keeps a byte corpus at one byte a
    token), a tensor or a numpy array (a memory-mapped token file: a window is read when it is
    asked for); windows come out as long tensors.
    """

    def __init__(self, tokens: torch.Tensor | np.ndarray, seq_len: int):
        if tokens.ndim != 1:
            raise ValueError(f"tokens must be 1-D, got shape {tuple(tokens.shape)}")
        if seq_len < 1:
            raise ValueError(f"seq_len={seq_len} must be at least 1 (tokens per training sequence)")
        if len(tokens) < seq_len + 1:
            raise ValueError(f"text of {len(tokens)} tokens is too short for one window of seq_len + 1 = "
                             f"{seq_len + 1} tokens; use more text or a smaller seq_len")
        self.tokens, self.seq_len = tokens, seq_len

    def __len__(self) -> int:
        return (len(self.tokens) - 1) // self.seq_len   # the last target needs one token more

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not 0 <= i < len(self):
            raise IndexError(f"window {i} out of range for a dataset of {len(self)} windows")
        window = self.tokens[i * self.seq_len: i * self.seq_len + self.seq_len + 1]
        window = torch.from_numpy(window.astype(np.int64)) if isinstance(window, np.ndarray) else window.long()
        return window[:-1], window[1:]


# ---- who holds which tokens under context parallelism (chapters/05_context_parallel.ipynb) ----

def cp_chunks(cp_rank: int, cp_size: int, zigzag: bool = False) -> list[int]:
    """The chunks of the sequence a cp rank holds, in order: of cp chunks, or of 2 cp under zig-zag.

    Zig-zag pairs an early chunk with a late one: rank r holds r and 2cp-1-r, so every rank's
    queries see about as many earlier keys as any other's.
    """
    if not 0 <= cp_rank < cp_size:
        raise ValueError(f"cp_rank={cp_rank} must be in [0, cp_size={cp_size})")
    return [cp_rank, 2 * cp_size - 1 - cp_rank] if zigzag else [cp_rank]


def cp_positions(seq_len: int, cp_rank: int, cp_size: int, zigzag: bool = False) -> torch.Tensor:
    """Positions (indices into the sequence) a cp rank holds, (seq_len / cp_size,) long."""
    num_chunks = 2 * cp_size if zigzag else cp_size
    if seq_len % num_chunks:
        layout = f"zig-zag cuts it into 2*cp_size = {num_chunks} chunks" if zigzag else "each rank takes 1/cp_size"
        raise ValueError(f"cp_size={cp_size} does not divide seq_len={seq_len} evenly ({layout}); "
                         f"pick a seq_len that is a multiple of {num_chunks}")
    width = seq_len // num_chunks
    return torch.cat([torch.arange(c * width, (c + 1) * width) for c in cp_chunks(cp_rank, cp_size, zigzag)])


@dataclass
class Batch:
    input_ids: torch.Tensor                     # (batch, seq) long
    targets: torch.Tensor                       # (batch, seq) long: input_ids shifted left by one
    sample_ids: torch.Tensor                    # (batch,) long: which dataset windows these are
    position_ids: torch.Tensor | None = None    # (batch, seq) long; None means 0 .. seq-1

    def __post_init__(self) -> None:
        if self.position_ids is None:
            batch, seq = self.input_ids.shape
            self.position_ids = torch.arange(seq, device=self.input_ids.device).repeat(batch, 1)

    def seq_slice(self, cp_rank: int, cp_size: int, zigzag: bool = False) -> "Batch":
        """A context-parallel rank's tokens of every sequence, with their position ids.

        Contiguous: the cp_rank-th of cp_size pieces. zigzag=True: chunks cp_rank and
        2*cp_size-1-cp_rank of 2*cp_size, so that causal attention costs every rank the same.
        """
        seq = self.input_ids.shape[1]
        if seq % cp_size:
            raise ValueError(f"cp_size={cp_size} does not divide seq_len={seq}; pick a seq_len that it divides")
        index = cp_positions(seq, cp_rank, cp_size, zigzag).to(self.input_ids.device)   # (seq/cp,)
        return Batch(self.input_ids[:, index], self.targets[:, index], self.sample_ids,
                     self.position_ids[:, index])                 # (batch, seq/cp) each

    def to(self, device: str | torch.device) -> "Batch":
        return Batch(self.input_ids.to(device), self.targets.to(device),
                     self.sample_ids.to(device), self.position_ids.to(device))


def _step_seed(seed: int, step: int, micro_step: int) -> int:
    # A hash so that nearby (step, micro_step) pairs give unrelated generators.
    digest = hashlib.sha256(f"{seed}/{step}/{micro_step}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


class DataLoader:
    """Micro-batches for one data-parallel rank, as a pure function of (step, micro_step).

    Each global micro-batch is the first dp_size * micro_batch_size entries of a fresh
    random permutation of the windows. Why this choice: a batch never holds a window twice
    (so dp ranks never share a sample), and no state is carried between steps, so resuming
    at step k or skipping steps gives the same data. The cost is a permutation of all
    windows per micro-batch: ~0.2 ms for the built-in corpus. Across micro-batches windows
    can repeat, as in sampling with replacement.

    With cp_size > 1 the cp ranks of one dp rank draw the same windows and each keeps its own
    tokens of them (`Batch.seq_slice`, zig-zag order when zigzag=True).
    """

    def __init__(self, dataset: TokenDataset, micro_batch_size: int, *,
                 dp_rank: int = 0, dp_size: int = 1, cp_rank: int = 0, cp_size: int = 1, zigzag: bool = False,
                 seed: int = 0):
        if micro_batch_size < 1:
            raise ValueError(f"micro_batch_size={micro_batch_size} must be at least 1 (windows per rank per "
                             f"micro-batch)")
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank={dp_rank} must be in [0, dp_size={dp_size})")
        if not 0 <= cp_rank < cp_size:
            raise ValueError(f"cp_rank={cp_rank} must be in [0, cp_size={cp_size})")
        if dp_size * micro_batch_size > len(dataset):
            fits = len(dataset) // dp_size
            smaller = (f"micro_batch_size at most {fits} (--micro-batch-size)" if fits else
                       f"dp_size at most {len(dataset)} (--dp)")
            raise ValueError(f"a global micro-batch of dp_size * micro_batch_size = {dp_size} * "
                             f"{micro_batch_size} windows, but the dataset has only {len(dataset)} windows of "
                             f"seq_len = {dataset.seq_len} tokens; use more text, a smaller seq_len "
                             f"(--seq-len) or {smaller}")
        self.dataset, self.micro_batch_size, self.seed = dataset, micro_batch_size, seed
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.cp_rank, self.cp_size, self.zigzag = cp_rank, cp_size, zigzag

    def global_sample_ids(self, step: int, micro_step: int = 0) -> torch.Tensor:
        """Window ids of the whole micro-batch over all dp ranks, (dp_size * micro_batch_size,)."""
        generator = torch.Generator().manual_seed(_step_seed(self.seed, step, micro_step))
        permutation = torch.randperm(len(self.dataset), generator=generator)
        return permutation[: self.dp_size * self.micro_batch_size].clone()   # don't keep the rest alive

    def get_batch(self, step: int, micro_step: int = 0) -> Batch:
        start = self.dp_rank * self.micro_batch_size
        sample_ids = self.global_sample_ids(step, micro_step)[start: start + self.micro_batch_size]
        inputs, targets = zip(*(self.dataset[i] for i in sample_ids.tolist()))
        batch = Batch(torch.stack(inputs), torch.stack(targets), sample_ids)
        if self.cp_size > 1:   # context parallelism: this rank's tokens of every sequence
            batch = batch.seq_slice(self.cp_rank, self.cp_size, self.zigzag)
        return batch


def build_dataset(train_config: TrainConfig) -> TokenDataset:
    """Tokens of train_config.dataset ("arithmetic" or a path), cut into windows: its bytes, or with
    train_config.tokenizer the tokenizer's ids, read from a memory-mapped cache (`tokenize_to_cache`)."""
    if train_config.dataset == "arithmetic":
        text = arithmetic_corpus(ARITHMETIC_LINES, train_config.seed)
    else:
        text = load_text(train_config.dataset)
    if train_config.tokenizer:
        path = tokenize_to_cache(text, train_config.tokenizer, train_config.cache_dir or DEFAULT_CACHE)
        tokens = read_token_file(path)
    else:
        data = bytearray(text.encode("utf-8"))
        # uint8: one byte a token, 8x less than long; frombuffer wraps the bytes without a copy
        # (torch.tensor(data) takes 0.1 s a MB) but refuses an empty buffer.
        tokens = torch.frombuffer(data, dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)
    seq_len = train_config.seq_len
    if seq_len >= 1 and len(tokens) < seq_len + 1:   # TokenDataset would say so too, without naming the dataset
        what = f"tokenized by {train_config.tokenizer}" if train_config.tokenizer else "bytes"
        smaller = f" or seq_len at most {len(tokens) - 1}" if len(tokens) > 1 else ""
        raise ValueError(f"dataset {train_config.dataset} holds {len(tokens)} tokens ({what}): too short for one "
                         f"window of seq_len + 1 = {seq_len + 1} tokens; use more text (--dataset){smaller} "
                         f"(--seq-len)")
    return TokenDataset(tokens, seq_len)


# ---- a real tokenizer: tokenized once, memory-mapped after -------------------------------------

DEFAULT_CACHE = Path.home() / ".cache" / "picotron"


def load_tokenizer(path: str | Path):
    """A Hugging Face `tokenizers.Tokenizer` from its tokenizer.json, with a clear error if it cannot be read."""
    try:
        from tokenizers import Tokenizer  # the `tokenizers` library: only runs that ask for a tokenizer load it
    except ImportError:
        raise ImportError("reading a tokenizer.json needs the `tokenizers` library, a dependency of picotron: "
                          "pip install tokenizers (or reinstall picotron)") from None
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"tokenizer {path} does not exist; give the path of a Hugging Face tokenizer.json "
                                f"(e.g. from a model's folder on the Hub), or leave tokenizer empty for bytes")
    try:
        return Tokenizer.from_file(str(path))
    except Exception as error:   # the library raises its own Exception type for a malformed file
        raise ValueError(f"{path} is not a tokenizer.json the tokenizers library can read: {error}") from None


def tokenize_to_cache(text: str, tokenizer_path: str | Path, cache_dir: str | Path) -> Path:
    """Tokenize `text` once and keep the ids in a flat file of cache_dir; return its path.

    The file's name is a hash of the text and of the tokenizer.json, so a changed corpus or a
    changed tokenizer gets a file of its own, and an unchanged pair is never tokenized twice: every
    later run (and every rank) only maps the file into memory. Ids are stored as uint16 when the
    vocabulary fits (2 bytes a token), else uint32; a .json beside the .bin says which. The file is
    written under a temporary name and renamed, so ranks that build it at once never read half of it.
    """
    tokenizer_bytes = Path(tokenizer_path).read_bytes() if Path(tokenizer_path).is_file() else b""
    tokenizer = load_tokenizer(tokenizer_path)
    key = hashlib.sha256(hashlib.sha256(tokenizer_bytes).digest() + text.encode("utf-8")).hexdigest()[:24]
    cache_dir = Path(cache_dir)
    path = cache_dir / f"tokens-{key}.bin"
    if path.is_file() and path.with_suffix(".json").is_file():
        return path
    try:
        cache_dir.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise ValueError(f"cache_dir={str(cache_dir)!r} (--cache-dir) cannot be created: {error.strerror or error}; "
                         f"choose a directory this process may write to") from None
    vocab = tokenizer.get_vocab_size()
    dtype = np.uint16 if vocab <= 2**16 else np.uint32
    ids = np.asarray(tokenizer.encode(text, add_special_tokens=False).ids, dtype=dtype)
    meta = {"dtype": np.dtype(dtype).name, "tokens": int(ids.size), "vocab_size": vocab,
            "tokenizer": str(tokenizer_path)}
    # Named by host and process: ranks on nodes sharing a file system may tokenize at once.
    temporary = path.with_name(f"{path.name}.{socket.gethostname()}.{os.getpid()}.tmp")
    ids.tofile(temporary)
    path.with_suffix(".json").write_text(json.dumps(meta))
    os.replace(temporary, path)
    return path


def read_token_file(path: str | Path) -> np.memmap:
    """The token ids of a `tokenize_to_cache` file, memory-mapped (read on demand, never copied whole)."""
    path = Path(path)
    meta = json.loads(path.with_suffix(".json").read_text())
    return np.memmap(path, dtype=np.dtype(meta["dtype"]), mode="r", shape=(meta["tokens"],))


def make_loader(train_config: TrainConfig, *, dp_rank: int = 0, dp_size: int = 1, cp_rank: int = 0,
                cp_size: int = 1, zigzag: bool = False) -> DataLoader:
    """The loader of one data-parallel (and context-parallel) rank. The dataset does not depend
    on dp_size or cp_size, so runs with different dp and cp see the same windows."""
    return DataLoader(build_dataset(train_config), train_config.micro_batch_size, dp_rank=dp_rank,
                      dp_size=dp_size, cp_rank=cp_rank, cp_size=cp_size, zigzag=zigzag, seed=train_config.seed)
