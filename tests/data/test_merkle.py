"""Merkle commitments: RFC 9162 hashing, proofs for every row of every small tree size, and
every kind of tampering (changed, added, removed, reordered rows; forged proofs) detected."""

from __future__ import annotations

import hashlib
import json

import pytest

from leantrain.data.merkle import (
    InclusionProof,
    MerkleTree,
    file_rows,
    leaf_hash,
    node_hash,
    verify_inclusion,
)
from leantrain.errors import LeantrainError


def rows(n: int) -> list[bytes]:
    return [json.dumps({"prompt": f"p{i}", "answer": str(i)}).encode() for i in range(n)]


def sha(data: bytes) -> bytes:
    return hashlib.sha256(data).digest()


def test_hashes_are_domain_separated_and_the_tree_splits_at_a_power_of_two() -> None:
    a, b, c = b"a", b"b", b"c"
    assert leaf_hash(a) == sha(b"\x00a")
    assert node_hash(leaf_hash(a), leaf_hash(b)) == sha(b"\x01" + sha(b"\x00a") + sha(b"\x00b"))
    # Three rows: ((a, b), c), not ((a, b), (c, c)).
    expected = node_hash(node_hash(leaf_hash(a), leaf_hash(b)), leaf_hash(c))
    assert MerkleTree([a, b, c]).root == expected.hex()
    assert MerkleTree([]).root == sha(b"").hex()
    assert MerkleTree([a]).root == leaf_hash(a).hex()


def test_a_leaf_cannot_pass_for_an_inner_node() -> None:
    """Without domain separation the 64-byte concatenation of two leaf hashes, offered as one
    row, would hash to the two-row root."""
    tree = MerkleTree([b"a", b"b"])
    forged_row = leaf_hash(b"a") + leaf_hash(b"b")
    assert MerkleTree([forged_row]).root != tree.root
    assert not verify_inclusion(forged_row, InclusionProof(0, 1, ()), tree.root)


def test_duplicating_the_last_row_changes_the_root() -> None:
    assert MerkleTree(rows(3)).root != MerkleTree([*rows(3), rows(3)[-1]]).root


@pytest.mark.parametrize("n", [*range(1, 18), 33, 100])
def test_every_row_proof_verifies_and_only_for_its_own_row_and_index(n: int) -> None:
    data = rows(n)
    tree = MerkleTree(data)
    for i, row in enumerate(data):
        proof = tree.proof(i)
        assert len(proof.path) <= max(1, (n - 1).bit_length())
        assert verify_inclusion(row, proof, tree.root)
        assert not verify_inclusion(row + b" ", proof, tree.root)  # changed row
        other = (i + 1) % n
        if other != i:
            assert not verify_inclusion(data[other], proof, tree.root)  # another row here
            moved = InclusionProof(other, n, proof.path)
            assert not verify_inclusion(row, moved, tree.root)  # the row claimed elsewhere


@pytest.mark.parametrize("n", [2, 5, 8, 13])
def test_forged_proofs_fail(n: int) -> None:
    data = rows(n)
    tree = MerkleTree(data)
    proof = tree.proof(n - 1)
    flipped = proof.path[0][:-1] + ("0" if proof.path[0][-1] != "0" else "1")
    forgeries = [
        InclusionProof(proof.index, proof.tree_size, (flipped, *proof.path[1:])),
        InclusionProof(proof.index, proof.tree_size, proof.path[:-1]),  # too short
        InclusionProof(proof.index, proof.tree_size, (*proof.path, proof.path[0])),  # too long
        InclusionProof(proof.index, proof.tree_size + 1, proof.path),  # another size
        InclusionProof(proof.index, proof.tree_size - 1, proof.path),
        InclusionProof(n, n, proof.path),  # index past the end
        InclusionProof(-1, n, proof.path),
    ]
    for forged in forgeries:
        assert not verify_inclusion(data[-1], forged, tree.root), forged
    assert not verify_inclusion(data[-1], proof, MerkleTree(data[:-1]).root)


def test_changed_added_removed_and_reordered_rows_change_the_root() -> None:
    data = rows(10)
    root = MerkleTree(data).root
    changed = [*data]
    changed[4] = changed[4].replace(b"p4", b"p5")
    swapped = [*data]
    swapped[2], swapped[7] = swapped[7], swapped[2]
    variants = {
        "changed": changed,
        "added": [*data, b"{}"],
        "inserted": [*data[:3], b"{}", *data[3:]],
        "removed": data[:-1],
        "removed first": data[1:],
        "reordered": swapped,
        "reversed": data[::-1],
        "trailing space": [*data[:-1], data[-1] + b" "],
    }
    for name, variant in variants.items():
        assert MerkleTree(variant).root != root, name
    assert MerkleTree(list(data)).root == root


def test_proof_round_trips_through_json_and_rejects_malformed_input() -> None:
    proof = MerkleTree(rows(6)).proof(3)
    assert InclusionProof.from_json(json.loads(json.dumps(proof.to_json()))) == proof
    for bad in (
        {"index": 1},
        {"index": "1", "tree_size": 6, "path": []},
        [1, 2],
        {"index": 1, "tree_size": 6, "path": ["zz"]},
    ):
        with pytest.raises(LeantrainError, match="proof"):
            InclusionProof.from_json(bad)
    with pytest.raises(LeantrainError, match="out of range"):
        MerkleTree(rows(6)).proof(6)


def test_file_rows_keep_bytes_exactly(tmp_path) -> None:
    path = tmp_path / "d.jsonl"
    path.write_bytes(b'{"a": 1}\r\n\n{"b": 2}\n')
    assert file_rows(path) == [b'{"a": 1}\r', b"", b'{"b": 2}']
    path.write_bytes(b'{"a": 1}\n{"b": 2}')  # no final newline: same rows as with one
    assert file_rows(path) == [b'{"a": 1}', b'{"b": 2}']
    with pytest.raises(LeantrainError, match="cannot read"):
        file_rows(tmp_path / "missing.jsonl")
