"""Data valuation and pricing: which training rows are worth paying for.

- `entropy`: token surprisal and predictive entropy under the model (per token, row, source).
- `influence`: TracIn over checkpoints, per-example gradients by torch.func, random projection.
- `shapley`: TMC-, Beta- and KNN-Shapley, leave-one-out, exact enumeration.
- `features`: the model's features and the retrained-head utility the Shapley methods value.
- `merkle`: SHA-256 Merkle commitments (RFC 9162) with inclusion proofs.
- `pricing`: scores to prices per row and per source.
- `rows`, `report`, `valuation`: the `leantrain value` pipeline around them.

Modules are imported on their own (`from leantrain.data.merkle import MerkleTree`), so checking
a commitment never loads torch or transformers.
"""
