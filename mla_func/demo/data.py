"""The demo model's text: docstrings of Python's standard library, a tokenizer, and packed windows.

Every machine with Python has this text offline. A *document* is one docstring
(of a module, class or function), named `relative/path.py:qualname`. Documents
come in a fixed order (files sorted by path, definitions in source order), and a
stable hash of the name puts about 1 in `HELDOUT_MODULUS` of them in the
held-out set used for perplexity, so the split does not depend on the order,
the number of files or the Python build.
"""

from __future__ import annotations

import ast
import hashlib
import sysconfig
import warnings
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

BOS = "<|bos|>"
EOS = "<|eos|>"
HELDOUT_MODULUS = 20  # 5% of documents are held out
# A few long-lived modules whose held-out documents make a quick perplexity check
# (about 5k tokens) that the tests can repeat without parsing the whole library.
EVAL_SUBSET_FILES = (
    "_pydecimal.py", "codecs.py", "configparser.py", "difflib.py", "ipaddress.py",
    "logging/__init__.py", "random.py", "socket.py", "typing.py",
)
# Paths under the stdlib that are not the standard library's own text.
_SKIPPED_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__"})


@dataclass(frozen=True, slots=True)
class Document:
    """One docstring: `name` is "relative/path.py:qualname" ("<module>" for a module docstring)."""

    name: str
    text: str

    @property
    def heldout(self) -> bool:
        return is_heldout(self.name)


def is_heldout(name: str) -> bool:
    """Whether the document `name` belongs to the held-out set (a stable hash, not Python's `hash`)."""
    digest = hashlib.sha256(name.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") % HELDOUT_MODULUS == 0


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_files(root: Path | None = None) -> list[Path]:
    """Every .py file of the standard library, sorted by relative path (third-party packages excluded)."""
    root = root or stdlib_root()
    files = [p for p in root.rglob("*.py") if not _SKIPPED_DIRS.intersection(p.relative_to(root).parts)]
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def file_docstrings(path: Path, root: Path) -> list[Document]:
    """The docstrings of one file in source order; [] when it does not parse (a few test files on purpose)."""
    rel = path.relative_to(root).as_posix()
    try:
        source = path.read_bytes()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # invalid escape sequences in old files
            tree = ast.parse(source, filename=rel)
    except (SyntaxError, ValueError, UnicodeDecodeError, OSError):
        return []
    docs: list[Document] = []

    def visit(node: Any, qualname: str) -> None:
        text = ast.get_docstring(node, clean=True)
        if text and text.strip():
            docs.append(Document(f"{rel}:{qualname}", text.strip()))
        walk(node, qualname)

    def walk(node: Any, qualname: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                visit(child, child.name if qualname == "<module>" else f"{qualname}.{child.name}")
            elif not isinstance(child, ast.expr):
                # Definitions nested in if/try/with blocks still belong to this scope.
                walk(child, qualname)

    visit(tree, "<module>")
    return docs


def stdlib_documents(files: Iterable[Path] | None = None, root: Path | None = None) -> list[Document]:
    """Docstrings of `files` (default: the whole standard library) in a fixed order.

    A name that occurs twice (a function redefined under `if`) keeps its first docstring.
    """
    root = root or stdlib_root()
    seen: set[str] = set()
    out: list[Document] = []
    for path in (stdlib_files(root) if files is None else files):
        for doc in file_docstrings(Path(path), root):
            if doc.name not in seen:
                seen.add(doc.name)
                out.append(doc)
    return out


def split_documents(docs: Sequence[Document]) -> tuple[list[Document], list[Document]]:
    """(training documents, held-out documents), each in the input order."""
    train = [d for d in docs if not d.heldout]
    heldout = [d for d in docs if d.heldout]
    return train, heldout


def text_digest(docs: Sequence[Document]) -> str:
    """sha256 over the documents' names and texts: tells whether two machines see the same text."""
    h = hashlib.sha256()
    for d in docs:
        h.update(d.name.encode("utf-8") + b"\0" + d.text.encode("utf-8") + b"\0")
    return h.hexdigest()


def train_tokenizer(texts: Iterable[str], vocab_size: int) -> Any:
    """A byte-level BPE tokenizer trained on `texts`, with `<|bos|>` = 0 and `<|eos|>` = 1.

    `encode(text)` prepends `<|bos|>` (a template post-processor), so that text
    given to the model always starts the way every training document does;
    `encode(text, add_special_tokens=False)` does not.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.BPE())
    # No prefix space: docstrings start at the beginning of a line, and the first
    # word of a prompt should tokenize as it did at the start of a document.
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=[BOS, EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    bos, eos = tokenizer.token_to_id(BOS), tokenizer.token_to_id(EOS)
    if (bos, eos) != (0, 1):
        raise RuntimeError(f"special tokens got ids {bos}, {eos}; expected 0, 1")
    tokenizer.post_processor = processors.TemplateProcessing(single=f"{BOS} $A", special_tokens=[(BOS, bos)])
    return tokenizer


def encode_documents(tokenizer: Any, docs: Sequence[Document]) -> list[list[int]]:
    """Each document as [bos, tokens..., eos]."""
    eos = tokenizer.token_to_id(EOS)
    encodings = tokenizer.encode_batch([d.text for d in docs])
    return [list(e.ids) + [eos] for e in encodings]


def pack(token_docs: Iterable[Sequence[int]], length: int) -> list[list[int]]:
    """Concatenate documents and cut the stream into windows of `length + 1` tokens.

    Window i covers stream[i * length : i * length + length + 1]: its first
    `length` tokens are inputs and its last `length` the targets, so every
    stream token after the first is a target exactly once. A short tail is dropped.
    """
    stream = [t for doc in token_docs for t in doc]
    return [stream[i : i + length + 1] for i in range(0, len(stream) - length, length)]


def iter_batches(windows: Sequence[Sequence[int]], batch_size: int, seed: int) -> Iterator[list[Sequence[int]]]:
    """Endless batches of `batch_size` windows, reshuffled every epoch by a seeded generator."""
    import random

    rng = random.Random(seed)
    order = list(range(len(windows)))
    while True:
        rng.shuffle(order)
        for i in range(0, len(order) - batch_size + 1, batch_size):
            yield [windows[j] for j in order[i : i + batch_size]]
