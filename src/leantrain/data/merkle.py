"""Dataset commitments: a SHA-256 Merkle tree over rows, its root, and inclusion proofs.

The tree is RFC 9162's (Certificate Transparency v2): a leaf hashes `0x00 || row` and an inner
node `0x01 || left || right`, so a leaf can never pass for a node (the second-preimage attack on
plain Merkle trees). A tree of n > 1 rows splits at the largest power of two below n instead of
duplicating an odd last node, so no two different row lists share a root (Bitcoin's duplication
made [a, b, c] and [a, b, c, c] collide). The root commits to every row, its position and the row
count: a changed, added, removed or reordered row changes the root, and an inclusion proof binds
one row to one index of one tree size.

Rows are bytes; `file_rows` reads a file's lines exactly as stored (without the `\n`), so the
commitment is to the file, not to a parse of it. Knows nothing about what the rows mean.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from leantrain.errors import LeantrainError

LEAF_PREFIX = b"\x00"
NODE_PREFIX = b"\x01"


def leaf_hash(row: bytes) -> bytes:
    return hashlib.sha256(LEAF_PREFIX + row).digest()


def node_hash(left: bytes, right: bytes) -> bytes:
    return hashlib.sha256(NODE_PREFIX + left + right).digest()


def _split(n: int) -> int:
    """The largest power of two strictly below n (n >= 2): where RFC 9162 splits a tree."""
    return 1 << ((n - 1).bit_length() - 1)


@dataclass(frozen=True)
class InclusionProof:
    """That row `index` of a tree of `tree_size` rows hashes, with `path` (sibling hashes from
    the leaf up, hex), to the root."""

    index: int
    tree_size: int
    path: tuple[str, ...]

    def to_json(self) -> dict[str, object]:
        return {"index": self.index, "tree_size": self.tree_size, "path": list(self.path)}

    @classmethod
    def from_json(cls, obj: object) -> InclusionProof:
        """Parse `to_json`'s output; a LeantrainError says what is malformed."""
        if not isinstance(obj, dict) or not {"index", "tree_size", "path"} <= obj.keys():
            raise LeantrainError("proof: expected an object with index, tree_size and path")
        index, size, path = obj["index"], obj["tree_size"], obj["path"]
        if not (isinstance(index, int) and isinstance(size, int) and isinstance(path, list)):
            raise LeantrainError("proof: index and tree_size must be integers, path a list")
        try:
            for h in path:
                if len(bytes.fromhex(h)) != 32:
                    raise ValueError
        except (TypeError, ValueError):
            raise LeantrainError("proof: every path entry must be a 64-digit hex hash") from None
        return cls(index, size, tuple(path))


class MerkleTree:
    """All node hashes of the tree over `rows`, for the root and any row's inclusion proof.

    Building hashes each row once and each inner node once (2n - 1 hashes); a proof is then
    log2(n) dictionary look-ups.
    """

    def __init__(self, rows: Sequence[bytes]) -> None:
        self.size = len(rows)
        self._nodes: dict[tuple[int, int], bytes] = {}  # (start, end) row range -> its hash
        self._root = self._build(rows, 0, self.size) if rows else hashlib.sha256(b"").digest()

    def _build(self, rows: Sequence[bytes], start: int, end: int) -> bytes:
        if end - start == 1:
            digest = leaf_hash(rows[start])
        else:
            mid = start + _split(end - start)
            digest = node_hash(self._build(rows, start, mid), self._build(rows, mid, end))
        self._nodes[start, end] = digest
        return digest

    @property
    def root(self) -> str:
        """The dataset commitment, hex. An empty dataset's root is SHA-256 of nothing."""
        return self._root.hex()

    def proof(self, index: int) -> InclusionProof:
        """The audit path of row `index` (RFC 9162 PATH), leaf level first."""
        if not 0 <= index < self.size:
            raise LeantrainError(f"row index {index} out of range for {self.size} rows")
        path: list[str] = []
        start, end = 0, self.size
        while end - start > 1:  # walk down from the root, keeping the sibling of each turn
            mid = start + _split(end - start)
            if index < mid:
                path.append(self._nodes[mid, end].hex())
                end = mid
            else:
                path.append(self._nodes[start, mid].hex())
                start = mid
        return InclusionProof(index, self.size, tuple(reversed(path)))


def verify_inclusion(row: bytes, proof: InclusionProof, root: str) -> bool:
    """Whether `row` is row `proof.index` of the `proof.tree_size`-row dataset committed by `root`
    (RFC 9162 section 2.1.3.2). False for any changed byte, index, size, path or root."""
    index, last = proof.index, proof.tree_size - 1
    if not 0 <= index <= last:
        return False
    digest = leaf_hash(row)
    for sibling_hex in proof.path:
        sibling = bytes.fromhex(sibling_hex)
        if last == 0:  # the path is longer than this tree is deep
            return False
        if index % 2 == 1 or index == last:
            digest = node_hash(sibling, digest)
            if index % 2 == 0:  # a right-edge node with no sibling at these levels: skip them
                while index % 2 == 0 and index != 0:
                    index, last = index >> 1, last >> 1
        else:
            digest = node_hash(digest, sibling)
        index, last = index >> 1, last >> 1
    return last == 0 and digest.hex() == root.lower()


def file_rows(path: Path) -> list[bytes]:
    """The lines of `path` as stored, without their `\\n` (a `\\r` stays, so CRLF -> LF is a
    change). A final newline does not start another row; blank lines are rows."""
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise LeantrainError(f"cannot read {path}: {exc.strerror or exc}") from None
    rows = data.split(b"\n")
    if rows and rows[-1] == b"":
        rows.pop()
    return rows


def load_proofs(path: Path) -> dict[int, InclusionProof]:
    """Proofs written by `leantrain value` (proofs.jsonl: one {"line", "index", "tree_size",
    "path"} object per line), by 1-based line number."""
    proofs = {}
    for number, raw in enumerate(file_rows(path), start=1):
        try:
            obj = json.loads(raw)
            line = obj["line"]
        except (ValueError, TypeError, KeyError):
            raise LeantrainError(f"{path}:{number}: expected a JSON object with a line") from None
        try:
            proofs[line] = InclusionProof.from_json(obj)
        except LeantrainError as exc:
            raise LeantrainError(f"{path}:{number}: {exc}") from None
    return proofs


def check_file(
    path: Path, root: str, proofs: dict[int, InclusionProof] | None = None
) -> tuple[bool, list[str]]:
    """Whether the lines of `path` hash to `root`, and if not, what the proofs tell: which lines
    no longer match their proof (changed or moved) and whether lines were added or removed."""
    rows = file_rows(path)
    if MerkleTree(rows).root == root.lower():
        return True, []
    problems = ["the file's Merkle root differs from the committed root"]
    if proofs:
        size = next(iter(proofs.values())).tree_size
        if len(rows) != size:
            problems.append(f"the file has {len(rows)} lines, the commitment {size}")
        for line in range(1, min(len(rows), size) + 1):
            proof = proofs.get(line)
            if proof is None or not verify_inclusion(rows[line - 1], proof, root):
                problems.append(f"line {line} is not the committed line {line}")
    return False, problems
